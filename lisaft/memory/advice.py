"""What to change when an estimate does not fit, and the largest shapes that do."""

from __future__ import annotations

from dataclasses import dataclass

from lisaft.memory.estimate import Estimate, Settings, compute
from lisaft.memory.optimizer_state import OPTIMIZERS


@dataclass(frozen=True)
class Change:
    what: str  # the recipe keys or flags to set
    why: str
    estimate: Estimate


def _candidates(s: Settings, layer_count: int) -> list[tuple[str, str, Settings]]:
    out = []
    if not s.gradient_checkpointing:
        out.append(("model.gradient_checkpointing: true", "keep one hidden state per layer",
                    s.with_(gradient_checkpointing=True)))
    if s.attention == "eager":
        out.append(("model.attention: flash_attention_2 (or sdpa)", "no s x s score matrix",
                    s.with_(attention="flash_attention_2" if s.device == "cuda" else "sdpa")))
    if s.optimizer != "paged_adamw_8bit" and s.device == "cuda":
        out.append(("optimizer.name: paged_adamw_8bit", "2 B/param of moments, paged on pressure",
                    s.with_(optimizer="paged_adamw_8bit")))
    elif s.optimizer not in ("adamw_8bit", "paged_adamw_8bit"):
        out.append(("optimizer.name: adamw_8bit", "2 B/param of moments",
                    s.with_(optimizer="adamw_8bit")))
    if not s.lisa:
        out.append(("lisa.enabled: true, lisa.active_layers: 2", "train 2 layers at a time",
                    s.with_(lisa=True, active_layers=min(2, layer_count))))
    elif s.active_layers > 1:
        gamma = max(1, s.active_layers // 2)
        out.append((f"lisa.active_layers: {gamma}", "fewer layers' gradients and moments",
                    s.with_(active_layers=gamma)))
    if not s.in_backward and s.grad_accum_steps == 1:
        out.append(("optimizer.in_backward: true, training.max_grad_norm: null",
                    "no full gradient set resident", s.with_(in_backward=True, clipping=False)))
    if s.batch_size > 1:
        out.append(("training.batch_size: 1 (raise grad_accum_steps)", "fewer tokens in flight",
                    s.with_(batch_size=1, grad_accum_steps=s.grad_accum_steps * s.batch_size)))
    return out


def advice(est: Estimate, layer_count: int) -> list[Change]:
    """Single changes that each lower the total, smallest total first; when none fits alone,
    the combination of all of them is offered too."""
    s = est.settings
    changes = []
    for what, why, changed in _candidates(s, layer_count):
        e = compute(changed)
        if e.total_bytes < est.total_bytes:
            changes.append(Change(what, why, e))
    changes.sort(key=lambda c: c.estimate.total_bytes)
    if changes and not any(c.estimate.fits for c in changes):
        combined = s
        for _, _, changed in _candidates(s, layer_count):
            combined = combined.with_(**{f: getattr(changed, f) for f in (
                "gradient_checkpointing", "attention", "optimizer", "lisa", "active_layers",
                "in_backward", "clipping", "batch_size", "grad_accum_steps")
                if getattr(changed, f) != getattr(s, f)})
        if combined != s:
            changes.append(Change("all of the above", "combined", compute(combined)))
    seq = largest_fitting(s, "seq_len")
    if not est.fits and seq and seq < s.seq_len:
        changes.append(Change(f"data.max_seq_len: {seq}", "largest sequence length that fits",
                              compute(s.with_(seq_len=seq))))
    return changes


def largest_fitting(s: Settings, field: str, limit: int = 1 << 20) -> int:
    """Largest value of `field` (seq_len or batch_size) whose estimate fits with nothing paged;
    0 if even 1 does not. Memory grows with both, so a binary search is exact."""
    def fits(v: int) -> bool:
        return compute(s.with_(**{field: v})).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def optimizer_grid(s: Settings, gamma: int) -> dict[tuple[str, str], Estimate]:
    """The four optimizers x (full fine-tuning, LISA γ), everything else as in `s`."""
    grid = {}
    for opt in OPTIMIZERS:
        grid[(opt, "full")] = compute(s.with_(optimizer=opt, lisa=False))
        grid[(opt, f"lisa γ={gamma}")] = compute(s.with_(optimizer=opt, lisa=True, active_layers=gamma))
    return grid
