"""Resume policy: which checkpoint to continue from, what a resume may change, and which LR
curve the continued run follows."""

from __future__ import annotations

from pathlib import Path

from lisaft import run_folder as runfiles
from lisaft.checkpoint.checkpointer import complete_checkpoints
from lisaft.checkpoint.components import read_components
from lisaft.checkpoint.missing import nothing_left
from lisaft.checkpoint.run_state import saved_recipe, saved_world_size
from lisaft.config.schema import CADENCE_KEYS, Recipe, flatten
from lisaft.console import first_line, warn
from lisaft.data.digest import DataChanged
from lisaft.distributed import dist
from lisaft.errors import LisaftError, OlderCheckpoint
from lisaft.model.lora import OtherBase
from lisaft.optim.lr_schedule import Plan, Schedule
from lisaft.run_folder import is_write_failure, write_failed
from lisaft.train.session import Session


def checkpoints_to_try(run_dir: Path, recipe_file: Path) -> list[Path]:
    """Complete checkpoints, newest first, whose recipe.json and state.json read (the resume's
    checks read them before any set-up); one line for each skipped; refuses when none is left."""
    candidates = []
    for ckpt in complete_checkpoints(run_dir, warn=warn):
        bad = _unreadable(ckpt)
        if bad is None:
            candidates.append(ckpt)
        else:
            warn(f"skipping checkpoint {ckpt.name}: {bad}")
    if not candidates:
        raise LisaftError(f"{run_dir}: no complete checkpoint to resume from; start over with "
                          f"{runfiles.start_over(run_dir, recipe_file)}")
    return candidates


def _unreadable(ckpt: Path) -> str | None:
    """Why the checkpoint's recipe.json or state.json cannot be read (bytes garbled in place keep
    the size the completeness check compares), or None."""
    for name, read in (("recipe.json", lambda: saved_recipe(ckpt)),
                       ("state.json", lambda: (read_components(ckpt), saved_world_size(ckpt)))):
        try:
            read()
        except (OSError, ValueError, LisaftError, KeyError, TypeError, AttributeError) as e:
            return f"{name} cannot be read ({first_line(e)})"
    return None


# A resume on another number of ranks may change these, as long as the global batch stays.
BATCH_KEYS = ("training.batch_size", "training.grad_accum_steps")
# Where the data lives may change (a moved file or folder): the training data's digest, checked as
# the checkpoint loads, decides whether it is the same data.
DATA_PATHS = ("data.train", "data.eval")


def recipe_changes(ckpt: Path, recipe: Recipe) -> list[tuple[str, object, object]]:
    """(key, saved, now) for each key the resume changes; refuses a change that alters the
    training path (anything but the cadence keys, and the per-rank batch when the number of
    ranks changes with the global batch kept)."""
    saved = saved_recipe(ckpt)
    saved_flat = flatten(saved.model_dump(mode="json"))
    new_flat = flatten(recipe.model_dump(mode="json"))
    saved_flat["training.output_dir"] = new_flat["training.output_dir"]  # the run may have moved
    changed = [k for k in sorted(set(saved_flat) | set(new_flat)) if saved_flat.get(k) != new_flat.get(k)]
    saved_world = saved_world_size(ckpt)
    allowed = CADENCE_KEYS + DATA_PATHS + (BATCH_KEYS if saved_world != dist.world_size() else ())
    refused = [k for k in changed if k not in allowed]
    if refused:
        k = refused[0]
        hint = (" (it may change when the number of ranks does, with the global batch kept)"
                if k in BATCH_KEYS else "")
        raise LisaftError(f"{k}: cannot change on resume (it alters the training path{hint}): checkpoint "
                          f"has {saved_flat.get(k)!r}, now {new_flat.get(k)!r}")
    if saved_world != dist.world_size():
        _check_global_batch(saved.training, recipe.training, saved_world)
    return [(k, saved_flat.get(k), new_flat.get(k)) for k in changed]


def _check_global_batch(saved, now, saved_world: int) -> None:
    """Another number of ranks continues the same run only with the same examples per optimizer
    step; say which per-rank batch keeps it."""
    world = dist.world_size()
    before = saved.batch_size * saved.grad_accum_steps * saved_world
    after = now.batch_size * now.grad_accum_steps * world
    if before == after:
        return
    fix = ""
    if before % (now.grad_accum_steps * world) == 0:
        fix = f"; pass --set training.batch_size={before // (now.grad_accum_steps * world)}"
    elif before % (now.batch_size * world) == 0:
        fix = f"; pass --set training.grad_accum_steps={before // (now.batch_size * world)}"
    raise LisaftError(
        f"the checkpoint was written by {saved_world} ranks at a global batch of {before} (batch_size "
        f"{saved.batch_size} x grad_accum_steps {saved.grad_accum_steps} x {saved_world}); on {world} ranks "
        f"that is {now.batch_size} x {now.grad_accum_steps} x {world} = {after}, another training path{fix}")


def check_resumable(run_dir: Path, ckpt: Path, recipe: Recipe, max_steps_given: int | None = None) -> None:
    """Refuse before any set-up a run already at the step it would stop at, unless it lacks
    final/ (its export failed, or final/ was removed): the resume then writes final/ from the
    newest checkpoint that loads."""
    progress = read_components(ckpt).get("progress", {})
    done = nothing_left(run_dir, progress.get("step", 0), recipe.training.max_steps, max_steps_given)
    if done is not None and (max_steps_given is not None or (run_dir / "final").exists()):
        raise done


def check_extension(run_dir: Path, ckpt: Path, recipe: Recipe, recipe_file: Path, reschedule: bool) -> None:
    """Refuse, before any set-up, new steps that would all train at a learning rate of 0: past the
    end of a saved curve whose floor is 0, or re-planned from a run that already reached it."""
    components = read_components(ckpt)
    max_steps = recipe.training.max_steps
    if max_steps is None or "schedule" not in components or recipe.scheduler.name == "constant":
        return  # a run's length in epochs is known only after set-up
    schedule = Schedule(recipe.optimizer.lr, recipe.scheduler, horizon=max_steps)
    schedule.load_state_dict(components["schedule"])
    horizon, step = schedule.plan.horizon, int(components.get("progress", {}).get("step", 0))
    if schedule.floor_lr > 0 or (max_steps <= horizon and not reschedule):
        return
    if reschedule and schedule.lr(step) > 0:
        return
    if step < horizon:
        raise LisaftError(f"training.max_steps {max_steps}: the saved learning-rate curve reaches its floor of 0 "
                          f"(scheduler.min_lr_ratio 0) at step {horizon}, so every step after it would change "
                          f"nothing; pass --reschedule to re-plan the decay from step {step} to step {max_steps}")
    raise LisaftError(
        f"training.max_steps {max_steps}: this run ended its learning-rate curve at step {step} at its floor of 0 "
        f"(scheduler.min_lr_ratio 0), so every new step would train at LR 0, re-planned with --reschedule too; "
        f"to train further, start a new run from its weights: `lisaft train {recipe_file} --set "
        f"model.name_or_path={run_dir / 'final'} --set training.output_dir=NEW_RUN`")


def load_newest(session: Session, candidates: list[Path], recipe_file: Path) -> Path:
    """Load the newest of `candidates` that loads; a checkpoint that passed the size check but
    does not load is skipped. A failed write while loading (optimizer state offloaded to disk)
    says nothing against the checkpoint: it ends the resume with the one write-failure message."""
    checkpointer = session.checkpointer()
    for i, ckpt in enumerate(candidates):
        try:
            checkpointer.load(ckpt)
            return ckpt
        except Exception as e:
            if is_write_failure(e) and not _names_a_file_in(e, ckpt):
                raise write_failed(session.run_dir, e) from None
            if isinstance(e, (DataChanged, OtherBase)):
                raise  # an older checkpoint of this run saw the same data, or the same other base
            if isinstance(e, OlderCheckpoint):
                raise LisaftError(f"{_older(e, ckpt)}; start over with "
                                  f"{runfiles.start_over(session.run_dir, recipe_file)}") from None
            if i + 1 == len(candidates):
                raise LisaftError(f"{ckpt}: cannot be loaded ({first_line(e)}); no older complete checkpoint; "
                                  f"start over with {runfiles.start_over(session.run_dir, recipe_file)}") from None
            warn(f"skipping checkpoint {ckpt.name}: cannot be loaded ({first_line(e)})")
    raise AssertionError("unreachable: candidates is never empty")


def _older(e: OlderCheckpoint, ckpt: Path) -> str:
    # Before per-unit optimizers a checkpoint held one optimizer for the whole model and no LISA
    # position or LR plan.
    what = "one optimizer for the whole model, " if e.component in ("lisa", "schedule") else ""
    return (f"{ckpt.name} was written by an older lisaft ({what}no {e.component} state); it cannot be resumed "
            "by this version (docs/resume.md)")


def _names_a_file_in(e: BaseException, folder: Path) -> bool:
    # Reading a checkpoint can fail with an errno that also fails writes (EACCES, EIO); that
    # error names the checkpoint's file, and the checkpoint is the one to skip.
    filename = getattr(e, "filename", None)
    if not filename:
        return False
    return Path(folder) in Path(filename).parents


def continue_schedule(session: Session, reschedule: bool) -> str:
    """Set the LR curve of a resumed run (the loaded plan); say what happens to it when
    max_steps changed."""
    schedule = session.schedule
    saved = schedule.plan
    step = session.progress.step
    max_steps = session.recipe.training.max_steps
    assert max_steps is not None  # build_session resolves training.epochs into it
    if reschedule:
        lr_now = schedule.lr(step, saved)
        schedule.plan = Plan(horizon=max_steps, start_step=step, start_lr=lr_now)
        return (f"learning rate re-planned: from {lr_now:.3g} at step {step} to "
                f"{schedule.floor_lr:.3g} at step {max_steps}")
    if max_steps == saved.horizon:
        return ""
    if max_steps > saved.horizon:
        return (f"learning rate continues on the saved curve, which ends at step {saved.horizon}; past it "
                f"it stays at its floor (pass --reschedule to re-plan the decay to step {max_steps})")
    return (f"learning rate continues on the saved curve planned for {saved.horizon} steps and stops at "
            f"step {max_steps} without reaching its end (pass --reschedule to re-plan the decay)")
