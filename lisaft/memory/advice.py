"""What to change when an estimate does not fit, and the largest shapes that do."""

from __future__ import annotations

import json
from dataclasses import dataclass

from lisaft.memory.estimate import Estimate, Settings, compute
from lisaft.memory.optimizer_state import OPTIMIZERS


@dataclass(frozen=True)
class Change:
    overrides: dict  # recipe keys and values, as `--set key=value` takes them
    why: str
    estimate: Estimate

    @property
    def what(self) -> str:
        return ", ".join(f"{k}: {json.dumps(v)}" for k, v in self.overrides.items())


def _candidates(s: Settings, layer_count: int) -> list[tuple[dict, str, Settings]]:
    out = []
    if not s.gradient_checkpointing:
        out.append(({"model.gradient_checkpointing": True}, "keep one hidden state per layer",
                    s.with_(gradient_checkpointing=True)))
    if s.attention == "eager":
        attention = "flash_attention_2" if s.device == "cuda" else "sdpa"
        out.append(({"model.attention": attention}, "no s x s score matrix", s.with_(attention=attention)))
    if s.optimizer != "paged_adamw_8bit" and s.device == "cuda":
        out.append(({"optimizer.name": "paged_adamw_8bit"}, "2 B/param of moments, paged on pressure",
                    s.with_(optimizer="paged_adamw_8bit")))
    elif s.optimizer not in ("adamw_8bit", "paged_adamw_8bit"):
        out.append(({"optimizer.name": "adamw_8bit"}, "2 B/param of moments",
                    s.with_(optimizer="adamw_8bit")))
    if not s.lisa:
        gamma = min(2, layer_count)
        out.append(({"lisa.enabled": True, "lisa.active_layers": gamma}, f"train {gamma} layers at a time",
                    s.with_(lisa=True, active_layers=gamma)))
    elif s.active_layers > 1:
        gamma = max(1, s.active_layers // 2)
        out.append(({"lisa.active_layers": gamma}, "fewer layers' gradients and moments",
                    s.with_(active_layers=gamma)))
    if not s.cpu_offload and s.device == "cuda":
        offloaded = s.with_(cpu_offload=True, in_backward=False,
                            clipping=s.clipping if not s.in_backward else True)
        keys = {"optimizer.cpu_offload": True}
        if s.in_backward:
            keys.update({"optimizer.in_backward": False, "training.max_grad_norm": 1.0})
        host = compute(offloaded).host_bytes
        out.append((keys, f"moments, gradients and the step on the CPU (needs {host / 1024**3:.1f} GiB of RAM)",
                    offloaded))
    if not s.in_backward and not s.cpu_offload and s.grad_accum_steps == 1:
        out.append(({"optimizer.in_backward": True, "training.max_grad_norm": None},
                    "no full gradient set resident", s.with_(in_backward=True, clipping=False)))
    if s.batch_size > 1:
        accum = s.grad_accum_steps * s.batch_size
        out.append(({"training.batch_size": 1, "training.grad_accum_steps": accum},
                    "fewer tokens in flight, same batch", s.with_(batch_size=1, grad_accum_steps=accum)))
    return out


def leanest(s: Settings, layer_count: int) -> Change:
    """Every candidate change at once: the least memory lisaft can train this model in."""
    combined, overrides = s, {}
    for changes, _, changed in _candidates(s, layer_count):
        overrides.update(changes)
        combined = combined.with_(**{f: getattr(changed, f) for f in _CHANGED_FIELDS
                                     if getattr(changed, f) != getattr(s, f)})
    if combined.cpu_offload and combined.in_backward:
        # The step on the CPU replaces the step in backward: the device holds neither moments nor
        # a gradient set.
        combined = combined.with_(in_backward=False, clipping=s.clipping)
        overrides = {k: v for k, v in overrides.items() if k not in ("optimizer.in_backward", "training.max_grad_norm")}
        if s.in_backward:
            overrides.update({"optimizer.in_backward": False, "training.max_grad_norm": 1.0})
    if combined.lisa and combined.active_layers > 1:  # the candidates above stop short of γ=1
        overrides["lisa.active_layers"] = 1
        combined = combined.with_(active_layers=1)
    return Change(overrides, "every change above at once", compute(combined))


_CHANGED_FIELDS = ("gradient_checkpointing", "attention", "optimizer", "lisa", "active_layers",
                   "in_backward", "cpu_offload", "clipping", "batch_size", "grad_accum_steps")


def advice(est: Estimate, layer_count: int) -> list[Change]:
    """Single changes that each lower the total, smallest total first; when none fits alone,
    the combination of all of them is offered too."""
    s = est.settings
    changes = []
    for overrides, why, changed in _candidates(s, layer_count):
        e = compute(changed)
        if e.total_bytes < est.total_bytes:
            changes.append(Change(overrides, why, e))
    changes.sort(key=lambda c: c.estimate.total_bytes)
    if changes and not any(c.estimate.fits for c in changes):
        lean = leanest(s, layer_count)
        if lean.estimate.total_bytes < changes[0].estimate.total_bytes:
            changes.append(lean)
    seq = largest_fitting(s, "seq_len")
    if not est.fits and seq and seq < s.seq_len:
        changes.append(Change({"data.max_seq_len": seq}, "largest sequence length that fits",
                              compute(s.with_(seq_len=seq))))
    return changes


def largest_fitting(s: Settings, field: str, limit: int | None = None) -> int | None:
    """Largest value of `field` (seq_len or batch_size) whose estimate fits with nothing paged;
    None if even 1 does not. Memory grows with both, so a binary search is exact. Sequences stop
    at the model's context length."""
    from lisaft.models import context_length

    if limit is None:
        limit = (context_length(s.config) if field == "seq_len" else None) or 1 << 20

    def fits(v: int) -> bool:
        return compute(s.with_(**{field: v})).fits

    if not fits(1):
        return None
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= limit:
        if fits(limit):
            return limit
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def optimizer_grid(s: Settings, gamma: int) -> dict[tuple[str, str], Estimate]:
    """The four optimizers x (full fine-tuning, LISA γ), everything else as in `s`. Columns are
    keyed "full" and "lisa_<γ>"."""
    grid = {}
    for opt in OPTIMIZERS:
        grid[(opt, "full")] = compute(s.with_(optimizer=opt, lisa=False))
        grid[(opt, f"lisa_{gamma}")] = compute(s.with_(optimizer=opt, lisa=True, active_layers=gamma))
    return grid


def largest_fitting_layers(s: Settings, layer_count: int) -> Estimate | None:
    """The LISA estimate at the largest γ (1..layer_count) that fits with nothing paged; None if
    even γ=1 does not. Memory grows with γ, so a binary search is exact."""
    def estimate(gamma: int) -> Estimate:
        return compute(s.with_(lisa=True, active_layers=gamma))

    lo, hi = 0, layer_count + 1  # estimate(lo) fits (or lo is 0), estimate(hi) does not (or hi is past the top)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if estimate(mid).fits else (lo, mid)
    return estimate(lo) if lo else None
