"""A step whose loss or gradient norm is not finite: the run stops there (the default) or, with
training.on_nonfinite: skip, the step updated nothing and is counted. Either way no NaN weights
are exported, and the checkpoints written before it stay as they were."""

from __future__ import annotations

import math
from pathlib import Path

from lisaft.errors import RunFailed
from lisaft.train.session import Session
from lisaft.train.step import StepResult


def what_is_nonfinite(result: StepResult) -> str | None:
    """'loss nan', 'gradient norm inf', both, or None when the step's figures are finite."""
    bad = []
    if not math.isfinite(result.loss):
        bad.append(f"loss {result.loss}")
    if result.grad_norm is not None and not math.isfinite(result.grad_norm):
        bad.append(f"gradient norm {result.grad_norm}")
    return " and ".join(bad) or None


def check_step(session: Session, step: int, result: StepResult, base: Path | None) -> None:
    """Count a skipped step; stop the run at a non-finite one that was not skipped."""
    what = what_is_nonfinite(result)
    if what is None:
        return
    if result.skipped:
        session.progress.skipped_steps += 1
        return
    raise stopped(session, step + 1, what, base)


def stopped(session: Session, step: int, what: str, base: Path | None) -> RunFailed:
    lr = session.recipe.optimizer.lr
    kept = (f"checkpoint {base.name} (written before it) is kept" if base is not None
            else "no checkpoint was written before it")
    run = session.run_dir
    start_over = "start over with a lower optimizer.lr (`lisaft train RECIPE --overwrite --set optimizer.lr=...`)"
    go_on = (f"`lisaft resume {run} --set training.on_nonfinite=skip` continues from it skipping such steps, "
             f"or {start_over}" if base is not None else start_over[0].upper() + start_over[1:])
    return RunFailed(
        f"step {step}: {what}; stopped with no final/ written and {kept}. Likely causes: a learning rate too "
        f"high for this model (optimizer.lr {lr:g}), a bad data row, or overflow in low precision. {go_on}")
