"""Learning rate as a pure function of the optimizer step: resume needs no scheduler state."""

from __future__ import annotations

import math


def lr_at(step: int, *, peak_lr: float, max_steps: int, name: str = "cosine",
          warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """LR used for optimizer step `step` (0-based).

    Warmup rises linearly to peak over `warmup_steps` (step 0 gets peak/warmup, not 0, so no
    step is wasted); then constant, or a linear / cosine decay reaching peak*min_lr_ratio at the
    last step.
    """
    if step < 0:
        raise ValueError("step must be >= 0")
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if name == "constant":
        return peak_lr
    floor = peak_lr * min_lr_ratio
    decay_steps = max(1, max_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if name == "linear":
        return floor + (peak_lr - floor) * (1.0 - progress)
    if name == "cosine":
        return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {name!r}")
