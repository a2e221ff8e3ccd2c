"""The parts of a transformers model LISA treats differently (decoder layers, embeddings, head),
found by attribute path, and the dtype names of the recipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lisaft.errors import LisaftError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Where each known family keeps its decoder layers, and the final norm beside them.
_LAYER_PATHS = {
    "llama": "model.layers", "mistral": "model.layers", "mixtral": "model.layers",
    "qwen2": "model.layers", "qwen3": "model.layers", "gemma": "model.layers",
    "gemma2": "model.layers", "phi3": "model.layers", "phi": "model.layers",
    "gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers",
}
_FINAL_NORM_NAMES = ("norm", "final_layer_norm", "ln_f", "final_layernorm")


@dataclass
class ModelParts:
    """The three groups LISA treats differently. Each parameter belongs to exactly one group;
    a head tied to the input embedding belongs to `embeddings`."""

    layers: nn.ModuleList
    embeddings: list[nn.Parameter]
    head: list[nn.Parameter]

    def layer_params(self, index: int) -> list[nn.Parameter]:
        return list(self.layers[index].parameters())


def _get_attr_path(root: nn.Module, dotted: str):
    node = root
    for part in dotted.split("."):
        if not hasattr(node, part):
            return None
        node = getattr(node, part)
    return node


def decoder_layers_path(model: nn.Module, layers_path: str | None = None) -> str:
    if layers_path:
        node = _get_attr_path(model, layers_path)
        if not isinstance(node, nn.ModuleList):
            raise LisaftError(f"model.layers_path: {layers_path!r} is not a ModuleList in this model")
        return layers_path
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    candidates = [_LAYER_PATHS[model_type]] if model_type in _LAYER_PATHS else []
    candidates += sorted(set(_LAYER_PATHS.values()))
    for path in candidates:
        if isinstance(_get_attr_path(model, path), nn.ModuleList):
            return path
    raise LisaftError(
        f"cannot find the decoder layers of model type {model_type!r}; set model.layers_path "
        "(e.g. 'model.layers') in the recipe"
    )


def pretrained(model: nn.Module) -> PreTrainedModel:
    """`model` as the transformers model it is (loaded or built by this module)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{type(model).__name__} is not a transformers model")
    return model


def input_embeddings(model: nn.Module) -> nn.Module:
    """A transformers model's input embedding module (nn.Module does not declare the method)."""
    get = getattr(model, "get_input_embeddings", None)
    if get is None:
        raise TypeError(f"{type(model).__name__} is not a transformers model (no get_input_embeddings)")
    return get()


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """Its output projection (the head), or None for a model without one."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if get is not None else None


def model_parts(model: nn.Module, layers_path: str | None = None) -> ModelParts:
    path = decoder_layers_path(model, layers_path)
    layers = _get_attr_path(model, path)
    parent = _get_attr_path(model, path.rsplit(".", 1)[0]) if "." in path else model
    in_layers = {id(p) for p in layers.parameters()}
    head_modules: list[nn.Module] = []
    out_emb = output_embeddings(model)
    if out_emb is not None:
        head_modules.append(out_emb)
    for name in _FINAL_NORM_NAMES:
        mod = getattr(parent, name, None)
        if isinstance(mod, nn.Module):
            head_modules.append(mod)
            break
    in_emb = input_embeddings(model)
    emb_ids = {id(p) for p in in_emb.parameters()}
    head, head_ids = [], set()
    for mod in head_modules:
        for p in mod.parameters():
            if id(p) not in emb_ids and id(p) not in head_ids:
                head.append(p)
                head_ids.add(id(p))
    # Everything outside layers and head (token and position embeddings, anything else an
    # architecture keeps at the bottom) trains with the embeddings.
    embeddings = [p for p in model.parameters() if id(p) not in in_layers and id(p) not in head_ids]
    return ModelParts(layers=layers, embeddings=embeddings, head=head)
