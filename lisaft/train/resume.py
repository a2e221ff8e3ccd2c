"""Resume policy: which checkpoint to continue from, what a resume may change, and which LR
curve the continued run follows."""

from __future__ import annotations

import json
from pathlib import Path

from lisaft import dist
from lisaft.checkpoint import complete_checkpoints, read_components
from lisaft.console import first_line, warn
from lisaft.errors import LisaftError
from lisaft.recipe import CADENCE_KEYS, Recipe, flatten, recipe_from_dict
from lisaft.resume_checks import nothing_left
from lisaft.runfiles import is_write_failure, write_failed
from lisaft.schedules import Plan
from lisaft.train.session import Session


def checkpoints_to_try(run_dir: Path, recipe_file: Path) -> list[Path]:
    """Complete checkpoints, newest first; refuses when there is none."""
    candidates = complete_checkpoints(run_dir, warn=warn)
    if not candidates:
        raise LisaftError(f"{run_dir}: no complete checkpoint to resume from; start over with "
                          f"`lisaft train {recipe_file} --overwrite`")
    return candidates


def recipe_changes(ckpt: Path, recipe: Recipe) -> list[tuple[str, object, object]]:
    """(key, saved, now) for each key the resume changes; refuses a change that alters the
    training path (anything but the cadence keys)."""
    saved = recipe_from_dict(json.loads((ckpt / "recipe.json").read_text()), f"{ckpt}/recipe.json")
    saved_flat = flatten(saved.model_dump(mode="json"))
    new_flat = flatten(recipe.model_dump(mode="json"))
    saved_flat["training.output_dir"] = new_flat["training.output_dir"]  # the run may have moved
    changed = [k for k in sorted(set(saved_flat) | set(new_flat)) if saved_flat.get(k) != new_flat.get(k)]
    refused = [k for k in changed if k not in CADENCE_KEYS]
    if refused:
        k = refused[0]
        raise LisaftError(f"{k}: cannot change on resume (it alters the training path): checkpoint "
                          f"has {saved_flat.get(k)!r}, now {new_flat.get(k)!r}")
    return [(k, saved_flat.get(k), new_flat.get(k)) for k in changed]


def check_resumable(run_dir: Path, ckpt: Path, recipe: Recipe, max_steps_given: int | None = None) -> None:
    """Refuse before any set-up: another world size, or a run already at the step it would stop at."""
    progress = read_components(ckpt).get("progress", {})
    world = progress.get("world_size", 1)
    if world != dist.world_size():
        raise LisaftError(f"{ckpt.name} was written by {world} processes; resume with the same number "
                          f"(now {dist.world_size()})")
    done = nothing_left(run_dir, progress.get("step", 0), recipe.training.max_steps, max_steps_given)
    if done is not None:
        raise done


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
            if isinstance(e, LisaftError) and "older lisaft" in str(e):
                raise LisaftError(f"{e}; start over with `lisaft train {recipe_file} --overwrite`") from None
            if i + 1 == len(candidates):
                raise LisaftError(f"{ckpt}: cannot be loaded ({first_line(e)}); no older complete checkpoint; "
                                  f"start over with `lisaft train {recipe_file} --overwrite`") from None
            warn(f"skipping checkpoint {ckpt.name}: cannot be loaded ({first_line(e)})")
    raise AssertionError("unreachable: candidates is never empty")


def _names_a_file_in(e: BaseException, folder: Path) -> bool:
    # Reading a checkpoint can fail with an errno that also fails writes (EACCES, EIO); that
    # error names the checkpoint's file, and the checkpoint is the one to skip.
    filename = getattr(e, "filename", None)
    return bool(filename) and Path(folder) in Path(filename).parents


def continue_schedule(session: Session, reschedule: bool) -> str:
    """Set the LR curve of a resumed run (the loaded plan); say what happens to it when
    max_steps changed."""
    schedule = session.schedule
    saved = schedule.plan
    step = session.progress.step
    max_steps = session.recipe.training.max_steps
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
