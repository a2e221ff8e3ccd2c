"""No recompute of the frozen layers below the lowest trainable one under gradient checkpointing
(model.gradient_checkpointing; load.enable_checkpointing turns it on)."""

from __future__ import annotations

from torch import nn


def frozen_inputs(model: nn.Module) -> None:
    """Undo enable_input_require_grads, which transformers' checkpointing (and peft's wrapping)
    call: it makes the embeddings' output require grad, so backward recomputes and
    back-propagates every frozen layer below LISA's lowest active layer for nothing. Reentrant
    checkpointing needed it; the non-reentrant kind works with inputs that do not require grad,
    and trainable embeddings make their output require grad themselves."""
    from transformers import PreTrainedModel

    from lisaft.internals import input_require_grads_hooked

    for module in model.modules():
        # Only where the hook is: transformers 4.x raises on a model that has none.
        if isinstance(module, PreTrainedModel) and input_require_grads_hooked(module):
            module.disable_input_require_grads()
