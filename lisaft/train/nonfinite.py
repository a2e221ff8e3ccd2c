"""Numbers a run must not be called done with. A step whose loss or gradient norm is not finite:
the run stops there (the default) or, with training.on_nonfinite: skip, the step updated nothing
and is counted. Weights that are not finite are never checkpointed or exported, and the
checkpoints written before them stay as they were. A gradient norm of exactly 0 step after step
(a dead run) is said."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lisaft.console import warn
from lisaft.distributed import dist
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
        session.progress.updated_step = step + 1
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


def _nonfinite_tensors(model: torch.nn.Module) -> tuple[list[str], int]:
    """This rank's floating-point parameters holding a NaN or inf (FSDP: its local slices), and
    how many there are in all."""
    bad, count = [], 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not local.is_floating_point():
            continue  # a 4-bit base's packed bytes
        count += 1
        if not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad, count


@torch.no_grad()
def check_weights(session: Session, step: int, base: Path | None) -> None:
    """Refuse to checkpoint or export weights that are not finite (an update of finite figures
    can still overflow): the run stops as at a non-finite loss, and the checkpoint written before
    stays the last one."""
    bad, count = _nonfinite_tensors(session.model)
    if not dist.any_rank(bool(bad)):
        return
    what = (f"the weights hold NaN or inf ({len(bad)} of {count} tensors, first {bad[0]})" if bad
            else "the weights hold NaN or inf on another rank")
    raise stopped(session, step, what, base)


def say_skipped_tail(session: Session) -> None:
    """A run whose last steps were all skipped ends with the weights of the step before them."""
    progress = session.progress
    if progress.updated_step >= progress.step:
        return
    since = (f"every step since step {progress.updated_step} was skipped" if progress.updated_step
             else "every step was skipped")
    warn(f"{since} (loss or gradient norm not finite, training.on_nonfinite: skip): final/ holds the "
         f"weights of step {progress.updated_step}, and the run trained nothing after it")


# A gradient norm of exactly 0 over this many steps: nothing trains any more (a diverged model
# whose outputs saturated, a loss that no longer depends on the weights).
DEAD_STEPS = 10


class DeadRun:
    """Watches the measured gradient norms; says once when they have been exactly 0 for
    DEAD_STEPS steps, and again at the end when the run finished that way."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.since: int | None = None  # the first step of the current run of zero norms
        self.said = False

    def see(self, step: int, result: StepResult) -> None:
        if result.grad_norm is None or result.skipped:
            return
        if result.grad_norm != 0:
            self.since = None
            return
        if self.since is None:
            self.since = step + 1
        if not self.said and step + 2 - self.since >= DEAD_STEPS and dist.is_main():
            self.said = True
            warn(f"the gradient norm has been exactly 0 since step {self.since} ({step + 2 - self.since} steps): the "
                 f"model no longer learns{self._uniform(result.loss)}; a learning rate too high "
                 f"(optimizer.lr {self.session.recipe.optimizer.lr:g}) often does this: stop the run (Ctrl-C) "
                 "and start over with a lower one")

    def _uniform(self, loss: float) -> str:
        vocab = int(getattr(self.session.model.config, "vocab_size", 0) or 0)
        if vocab < 2 or abs(loss - math.log(vocab)) > 1e-3 * math.log(vocab):
            return ""
        return f" and its loss {loss:.4f} is ln of the vocabulary size ({vocab}): it predicts every token alike"

    def at_end(self) -> None:
        if self.said and self.since is not None and dist.is_main():
            warn(f"the gradient norm was exactly 0 from step {self.since} to the end: final/ holds a model that "
                 "stopped learning there")
