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

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.disable_input_require_grads()
