"""A LoRA run's checkpoint weights: the adapters (and whatever else trains), never the frozen base.

The parallel strategy's weights component of a LoRA run, a folder component: `adapters/` holds one
safetensors file of every trainable tensor and base.json naming the base they belong to, which a
load compares with the base the run has now (lisaft/model/lora.py base_fingerprint).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lisaft.distributed import dist
from lisaft.model.lora import Adapters, check_base

FOLDER = "adapters"
WEIGHTS = "adapter_weights.safetensors"
BASE = "base.json"


class AdapterWeights:
    """Writes and reads the trainable tensors of a LoRA run (rank 0 writes; all ranks read)."""

    def __init__(self, model: nn.Module, adapters: Adapters) -> None:
        self.model = model
        self.adapters = adapters

    def write(self, folder: Path, base: Path | None) -> list[Path]:
        if not dist.is_main():
            return []
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.adapters.trainable_state(self.model).items()}
        save_file(state, str(folder / WEIGHTS), metadata={"base": json.dumps(self.adapters.base)})
        (folder / BASE).write_text(json.dumps(self.adapters.base))
        return [folder / WEIGHTS, folder / BASE]

    def read(self, folder: Path) -> None:
        read_adapters(folder.parent, self.model, self.adapters)

    def committed(self) -> None:
        pass


def read_adapters(ckpt: Path, model: nn.Module, adapters: Adapters) -> None:
    """A checkpoint's trainable tensors into `model`, after checking it names the same base."""
    folder = Path(ckpt) / FOLDER
    check_base(json.loads((folder / BASE).read_text()), adapters.base, str(ckpt))
    tensors = load_file(str(folder / WEIGHTS), device="cpu")
    expected = set(adapters.trainable_state(model))
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise RuntimeError(f"checkpoint {ckpt} holds other adapters than the recipe builds: missing "
                           f"{missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, t in tensors.items():
            params[name].copy_(t)


def adapter_component(model: nn.Module, adapters: Adapters) -> dict[str, AdapterWeights]:
    """The checkpoint's weights component of a LoRA run, as the parallel strategy hands it out."""
    return {FOLDER: AdapterWeights(model, adapters)}
