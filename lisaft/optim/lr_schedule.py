"""Learning rate as a pure function of the optimizer step and the plan being followed.

The plan (`Plan`: the horizon, and where a resume re-planned the decay) is the only state, and
`Schedule` saves it with every checkpoint, so a resume that changes training.max_steps keeps the
curve it was on unless asked to re-plan it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def lr_at(step: int, *, peak_lr: float, max_steps: int, name: str = "cosine",
          warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """LR used for optimizer step `step` (0-based).

    Warmup rises linearly to peak over `warmup_steps` (step 0 gets peak/warmup, not 0, so no
    step is wasted); then constant, or a linear / cosine decay that would reach peak*min_lr_ratio
    one step after the last: the last step still moves the weights (with min_lr_ratio 0, an LR of
    0 there would be a wasted update). Past max_steps the LR stays at the floor.
    """
    if step < 0:
        raise ValueError("step must be >= 0")
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if name == "constant":
        return peak_lr
    floor = peak_lr * min_lr_ratio
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if name == "linear":
        return floor + (peak_lr - floor) * (1.0 - progress)
    if name == "cosine":
        return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {name!r}")


def replanned_lr_at(step: int, *, start_step: int, start_lr: float, end_step: int, floor_lr: float,
                    name: str = "cosine") -> float:
    """A schedule re-planned on resume: from `start_lr` at `start_step` it decays with the same
    shape toward `floor_lr`, reached at `end_step` (one past the last step, as in lr_at), so the
    LR does not jump at the seam."""
    if name == "constant":
        return start_lr
    progress = min(1.0, max(0, step - start_step) / max(1, end_step - start_step))
    if name == "linear":
        return floor_lr + (start_lr - floor_lr) * (1.0 - progress)
    return floor_lr + (start_lr - floor_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class Plan:
    """Which curve the LR follows. Saved with every checkpoint, so that a resume that changes
    training.max_steps keeps the curve it was on unless asked to re-plan it."""

    horizon: int                       # the schedule ends here; past it the LR stays at its floor
    start_step: int | None = None      # set when a resume re-planned the decay from this step
    start_lr: float | None = None      # ... starting from the LR the run had reached there


def lr_for(step: int, plan: Plan, *, peak_lr: float, name: str, warmup_steps: int,
           min_lr_ratio: float) -> float:
    if plan.start_step is None:
        return lr_at(step, peak_lr=peak_lr, max_steps=plan.horizon, name=name,
                     warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio)
    assert plan.start_lr is not None, "a re-planned curve has both its start step and LR"
    return replanned_lr_at(step, start_step=plan.start_step, start_lr=plan.start_lr,
                           end_step=plan.horizon, floor_lr=peak_lr * min_lr_ratio, name=name)


class Schedule:
    """The run's learning rate: the recipe's curve along the current plan; saves the plan."""

    def __init__(self, peak_lr: float, section, horizon: int) -> None:
        self.peak_lr = peak_lr
        self.section = section            # recipe.SchedulerSection: name, warmup_steps, min_lr_ratio
        self.plan = Plan(horizon=horizon)

    def lr(self, step: int, plan: Plan | None = None) -> float:
        s = self.section
        return lr_for(step, plan or self.plan, peak_lr=self.peak_lr, name=s.name,
                      warmup_steps=s.warmup_steps, min_lr_ratio=s.min_lr_ratio)

    @property
    def floor_lr(self) -> float:
        return self.peak_lr * self.section.min_lr_ratio

    def state_dict(self) -> dict:
        return asdict(self.plan)

    def load_state_dict(self, sd: dict) -> None:
        self.plan = Plan(**sd)

    def warmup_note(self) -> str | None:
        """What to tell a run whose warmup lasts as long as the run or longer: it never trains at
        the peak LR it asked for, and never decays."""
        warmup, horizon = self.section.warmup_steps, self.plan.horizon
        if warmup <= horizon or horizon < 1:
            return None
        last = self.lr(horizon - 1) / self.peak_lr
        return (f"scheduler.warmup_steps {warmup} is longer than the run (training.max_steps {horizon}): "
                f"the whole run is warmup: its last step trains at {last:.0%} of optimizer.lr and the LR "
                "never decays; give fewer warmup steps")
