"""Every way lisaft trains a model, estimated for the same model, sequence and batch, in the
order the learning benchmark ranked what they learned (docs/learning.md, second protocol,
reduced run): full fine-tuning learned most (97.6% token accuracy on the new skill at 24 layers),
LoRA at LISA γ=2's optimizer memory beat LISA in all four comparisons measured (52.0 against
43-46 at 24 layers, 58.1 against 52-55 at 6), and LISA γ=2 came last. QLoRA and DoRA were not
measured there: QLoRA is the same adapters on a 4-bit base (ranked after LoRA, its base being
rounded), DoRA is left out of the list until it is measured. APOLLO-Mini (every weight trains,
rank-1 moments, the step in backward: recipes/llama3.1-8b-apollo-24gb.yaml) ran only in one
50-step smoke run, within two points of every other arm (docs/learning.md, "APOLLO and
APOLLO-Mini"), which ranks nothing: it comes after the ranked methods and says it is not ranked.
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


_FULL = "learned most: 97.6% token accuracy at 24 layers (docs/learning.md)"
_LORA = "beat LISA γ=2 at its optimizer memory: 52.0% against 43-46% at 24 layers (docs/learning.md)"
_QLORA = "LoRA on a 4-bit base; not measured for learning"
_LISA = "learned least of those measured: 43-46% at 24 layers (docs/learning.md)"
_APOLLO = "every weight trains; not ranked: one 50-step smoke run, within 2 points of the others (docs/learning.md)"


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
        ("LoRA r8 (bf16 base)", lora_keys, _LORA, {**plain, "lora": lora}),
        ("QLoRA r8 (4-bit base)", {**lora_keys, "model.quantize": "nf4"}, _QLORA,
         {**plain, "lora": LoraSettings(rank=8, quantize="nf4")}),
        ("LISA γ=2", {"lisa.enabled": True, "lisa.active_layers": 2, "optimizer.name": "paged_adamw_8bit"},
         _LISA, {**plain, "lisa": True, "active_layers": 2, "active_layers_auto": False,
                 "optimizer": "paged_adamw_8bit"}),
        ("APOLLO-Mini, every weight, step in backward",
         {"lisa.enabled": False, "optimizer.name": "apollo_mini", "optimizer.in_backward": True,
          "optimizer.cpu_offload": False, "training.max_grad_norm": None, "training.grad_accum_steps": 1}, _APOLLO,
         {**plain, "optimizer": "apollo_mini", "in_backward": True, "clipping": False, "grad_accum_steps": 1}),
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
