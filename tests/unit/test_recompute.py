"""No recompute below the lowest trainable layer (lisaft/model/checkpointing.py frozen_inputs): with
gradient checkpointing on and nothing below the decoder layers training (LISA's frozen
embeddings, LoRA without embedding training), the embeddings' output does not require grad, so
backward neither recomputes nor back-propagates the frozen layers below the lowest trainable one.
Layers are counted by their MLP's forward calls (one in the forward, one more for each
recompute) and by the gradients that reach the MLP's output."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _tiny import tiny as _tiny

from lisaft.config.schema import ModelSection
from lisaft.model.load import apply_model_settings
from lisaft.model.parts import model_parts

CPU = torch.device("cpu")
SECTION = ModelSection(name_or_path="unused", gradient_checkpointing=True)


def _calls(model, layers) -> tuple[Counter, Counter]:
    """Forward calls and backward passes of each decoder layer over one forward and backward."""
    forwards, backwards = Counter(), Counter()
    hooks = []

    def seen(i: int):
        def hook(module, args, out):
            if out.requires_grad:
                out.register_hook(lambda g: backwards.update([i]))
        return hook

    # On the layer's MLP: transformers checkpoints the layer's forward, inside the layer's own
    # hooks; a pre-hook, as a recompute stops once it has what backward needs (its early stop).
    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a, i=i: forwards.update([i])))
        hooks.append(layer.mlp.register_forward_hook(seen(i)))
    x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x).loss.backward()
    for h in hooks:
        h.remove()
    return forwards, backwards


def _freeze_below(model, layers, lowest: int, embeddings: bool) -> None:
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in list(layers)[lowest:]:
        layer.requires_grad_(True)
    model.get_input_embeddings().requires_grad_(embeddings)


@pytest.mark.parametrize("embeddings", [False, True], ids=["frozen-embeddings", "trained-embeddings"])
def test_frozen_layers_below_the_lowest_trainable_one_are_not_recomputed(embeddings):
    model = _tiny(0, 4)
    apply_model_settings(model, SECTION, CPU)
    layers = model_parts(model).layers
    _freeze_below(model, layers, 2, embeddings)
    forwards, backwards = _calls(model, layers)
    if embeddings:  # the gradient must reach the embeddings: every layer is recomputed
        assert forwards == {0: 2, 1: 2, 2: 2, 3: 2} and set(backwards) == {0, 1, 2, 3}
    else:
        assert forwards == {0: 1, 1: 1, 2: 2, 3: 2} and set(backwards) == {2, 3}
    assert model.get_input_embeddings().weight.grad is None or embeddings
    assert all(p.grad is not None for p in layers[2].parameters())


def test_transformers_alone_recomputes_them():
    """What frozen_inputs undoes: transformers' checkpointing makes the input require grad."""
    model = _tiny(0, 4)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model_parts(model).layers
    _freeze_below(model, layers, 2, embeddings=False)
    forwards, _ = _calls(model, layers)
    assert forwards == {0: 2, 1: 2, 2: 2, 3: 2}


def test_lora_input_does_not_require_grad():
    """peft's wrapping calls enable_input_require_grads again; attach_adapters undoes it."""
    pytest.importorskip("peft")
    from lisaft.config.schema import recipe_from_dict
    from lisaft.model.lora import attach_adapters

    model = _tiny(0, 4)
    apply_model_settings(model, SECTION, CPU)
    recipe = recipe_from_dict({"model": {"name_or_path": "unused", "dtype": "float32"}, "data": {"train": "unused"},
                               "lora": {"enabled": True, "rank": 4}, "training": {"max_steps": 1, "output_dir": "r"}})
    attach_adapters(model, recipe)
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.requires_grad))
    forwards, backwards = _calls(model, model_parts(model).layers)
    assert seen == [False]
    assert set(backwards) == {0, 1, 2, 3}  # every layer holds adapters: each one trains


def test_transformers_4_input_hook_is_undone_too(monkeypatch):
    """transformers 4.x (pyproject allows >=4.45; 4.57 checked) keeps one `_require_grads_hook` on
    the model enable_input_require_grads was called on, and its disable raises AttributeError on
    every other PreTrainedModel (the inner LlamaModel): frozen_inputs undoes it where it is."""
    from transformers import PreTrainedModel

    def enable_4x(self):
        self._require_grads_hook = self.get_input_embeddings().register_forward_hook(
            lambda m, a, out: out.requires_grad_(True))

    def disable_4x(self):
        self._require_grads_hook.remove()

    monkeypatch.setattr(PreTrainedModel, "enable_input_require_grads", enable_4x)
    monkeypatch.setattr(PreTrainedModel, "disable_input_require_grads", disable_4x)
    model = _tiny(0, 4)
    apply_model_settings(model, SECTION, CPU)
    layers = model_parts(model).layers
    _freeze_below(model, layers, 2, embeddings=False)
    forwards, backwards = _calls(model, layers)
    assert forwards == {0: 1, 1: 1, 2: 2, 3: 2} and set(backwards) == {2, 3}
