"""Every way lisaft trains a model, estimated for the same model, sequence and batch, in the
order the learning benchmark ranked what they learned (docs/learning.md, "APOLLO and APOLLO-Mini
against LISA and LoRA at equal memory": the new skill at 24 layers, lr grid, 3 seeds): full
fine-tuning learned most (94.1% token accuracy), then the APOLLO arms that update every weight
(equal-state APOLLO 87.7, APOLLO-Mini 78.1 with a fifth of that state), then LoRA at LISA γ=2's
optimizer memory (70.1) and LISA γ=2 (48.4); the same order held at 6 layers and on the new format.
QLoRA is the same adapters on a 4-bit base (ranked after LoRA: level with it at 6 layers, behind
at 24 at an lr not swept); DoRA, LoRA with learned magnitudes, after LoRA: it ran at one lr, where
it led LoRA by 2 points at 6 layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from lisaft.memory.estimate import Estimate, Settings, compute
from lisaft.memory.lora import LoraSettings


@dataclass
class Method:
    name: str
    overrides: dict      # recipe keys that select it
    learned: str         # what docs/learning.md measured, in a few words
    estimate: Estimate


_FULL = "learned most: 94.1% token accuracy on the new skill at 24 layers (docs/learning.md)"
_APOLLO = ("every weight trains: 78.1% at 24 layers with a fifth of LoRA's state; APOLLO at LoRA's state "
           "87.7% (docs/learning.md)")
_LORA = "70.1% at 24 layers at LISA γ=2's optimizer memory (docs/learning.md)"
_DORA = "LoRA with learned magnitudes: 63.6% against LoRA's 61.5 at 6 layers, one lr (docs/learning.md)"
_QLORA = "LoRA on a 4-bit base: level with LoRA at 6 layers, 61.7% against 61.5 (docs/learning.md)"
_LISA = "learned least: 48.4% at 24 layers at LoRA's optimizer memory (docs/learning.md)"


def _choices(s: Settings) -> list[tuple[str, dict, str, dict]]:
    """(name, recipe keys, learning note, Settings fields) per method, in learning order."""
    plain = {"lora": None, "lisa": False, "cpu_offload": False, "in_backward": False}
    lora = LoraSettings(rank=8)
    lora_keys = {"lora.enabled": True, "lisa.enabled": False, "optimizer.cpu_offload": False}
    return [
        ("full fine-tuning, optimizer on the CPU", {"lisa.enabled": False, "optimizer.cpu_offload": True,
                                                    "optimizer.name": "adamw_8bit"}, _FULL,
         {**plain, "cpu_offload": True, "optimizer": "adamw_8bit", "clipping": True}),
        ("full fine-tuning, paged 8-bit, step in backward",
         {"lisa.enabled": False, "optimizer.name": "paged_adamw_8bit", "optimizer.in_backward": True,
          "training.max_grad_norm": None, "training.grad_accum_steps": 1}, _FULL,
         {**plain, "optimizer": "paged_adamw_8bit", "in_backward": True, "clipping": False,
          "grad_accum_steps": 1}),
        ("APOLLO-Mini, every weight, step in backward",
         {"lisa.enabled": False, "optimizer.name": "apollo_mini", "optimizer.in_backward": True,
          "optimizer.cpu_offload": False, "training.max_grad_norm": None, "training.grad_accum_steps": 1}, _APOLLO,
         {**plain, "optimizer": "apollo_mini", "in_backward": True, "clipping": False, "grad_accum_steps": 1}),
        ("LoRA r8 (bf16 base)", lora_keys, _LORA, {**plain, "lora": lora}),
        ("DoRA r8 (bf16 base)", {**lora_keys, "lora.dora": True}, _DORA,
         {**plain, "lora": LoraSettings(rank=8, dora=True)}),
        ("QLoRA r8 (4-bit base)", {**lora_keys, "model.quantize": "nf4"}, _QLORA,
         {**plain, "lora": LoraSettings(rank=8, quantize="nf4")}),
        ("LISA γ=2", {"lisa.enabled": True, "lisa.active_layers": 2, "optimizer.name": "paged_adamw_8bit"},
         _LISA, {**plain, "lisa": True, "active_layers": 2, "active_layers_auto": False,
                 "optimizer": "paged_adamw_8bit"}),
    ]


def methods(s: Settings) -> list[Method]:
    """Each method with gradient checkpointing on, everything else as in `s`; under training.fsdp
    none (its own table answers there)."""
    if s.fsdp:
        return []
    out = []
    for name, keys, learned, fields in _choices(s):
        if fields.get("cpu_offload") and s.device != "cuda":
            continue  # on CPU the host is the device: nothing to offload to
        est = compute(s.with_(gradient_checkpointing=True, **fields))
        out.append(Method(name, {"model.gradient_checkpointing": True, **keys}, learned, est))
    return out
