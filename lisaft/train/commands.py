"""The `lisaft train` and `lisaft resume` entry points."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from lisaft import run_folder as runfiles
from lisaft.checkpoint.missing import run_recipe_file
from lisaft.checkpoint.run_state import saved_world_size
from lisaft.config.schema import load_recipe
from lisaft.config.unused_keys import unused_keys
from lisaft.console import say, warn
from lisaft.distributed import dist
from lisaft.errors import LisaftError
from lisaft.metrics.log import MetricsLog, check_backends
from lisaft.train import resume as policy
from lisaft.train.host_memory import check_host_memory
from lisaft.train.loop import run
from lisaft.train.session import build_session


def _in_process_group(fn):
    """Run a command inside the torchrun process group when launched by torchrun: the session
    joins it once it knows the training device (build_session), this leaves it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            dist.shutdown()

    return wrapper


def _holding(run_dir: Path):
    """The run folder's lock for this command (rank 0 holds it for every rank)."""
    return runfiles.live(run_dir) if dist.is_main() else contextlib.nullcontext()


@_in_process_group
def train(recipe_path: str | Path, overrides: list[str] | None = None, overwrite: bool = False,
          show: bool = True, _stop_at: int | None = None, force: bool = False) -> int:
    """`lisaft train`: returns the process exit code. `_stop_at` (tests) stops as a signal would
    after that many optimizer steps."""
    recipe = load_recipe(recipe_path, overrides or [])
    check_backends(recipe.logging)
    if dist.is_main():
        for note in unused_keys(recipe):
            warn(note)
    run_dir = Path(recipe.training.output_dir)
    runfiles.check_copied_recipe(Path(recipe_path), run_dir, overwrite,
                                 output_dir_given=any(o.partition("=")[0].strip() == "training.output_dir"
                                                      for o in overrides or []))
    if not run_dir.exists():
        runfiles.check_output_dir(run_dir, overwrite, force)  # can it be created, before the lock creates it
    with _holding(run_dir):
        # Checked under the lock: a live run's folder is refused as live, not as a run to resume.
        runfiles.check_output_dir(run_dir, overwrite, force)
        check_host_memory(recipe, str(recipe_path))
        session = build_session(recipe, run_dir)
        if dist.is_main() and (warmup := session.schedule.warmup_note()):
            warn(warmup)
        dist.barrier()  # every rank has checked output_dir before rank 0 writes into it
        if dist.is_main():
            with runfiles.writes_end_cleanly(run_dir, recipe_file=Path(recipe_path)):
                if overwrite and run_dir.is_dir():
                    # recipe.yaml is replaced atomically below: when that write fails, the recipe the
                    # message says to start over with (often this very file) still exists.
                    runfiles.clear_run(run_dir, keep=("recipe.yaml",))
                runfiles.make_run_dir(run_dir)
                runfiles.write_atomic(run_dir / "recipe.yaml", recipe.to_yaml())
        dist.barrier()
        session.controller.activate_for_step(0)
        return run(session, base=None, show=show, stop_at=_stop_at, recipe_file=Path(recipe_path))


@_in_process_group
def resume(run_dir: str | Path, max_steps: int | None = None, overrides: list[str] | None = None,
           show: bool = True, reschedule: bool = False, _stop_at: int | None = None) -> int:
    """`lisaft resume`: continue RUN_DIR from its newest complete checkpoint. A changed
    max_steps keeps the saved LR curve unless `reschedule` re-plans it from the current step."""
    run_dir = Path(run_dir).resolve()
    with _holding(run_dir) if run_dir.is_dir() else contextlib.nullcontext():
        return _resume(run_dir, max_steps, list(overrides or []), show, reschedule, _stop_at)


def _resume(run_dir: Path, max_steps: int | None, overrides: list[str], show: bool, reschedule: bool,
            stop_at: int | None) -> int:
    recipe_file = run_recipe_file(run_dir)
    if reschedule and max_steps is None:
        raise LisaftError("--reschedule re-plans the learning-rate decay to the step --max-steps N gives; "
                          "pass --max-steps too (without it the run continues on its saved curve)")
    if max_steps is not None:
        overrides.append(f"training.max_steps={max_steps}")
    # The run lives where it is now, even if the folder was moved since.
    overrides.append(f"training.output_dir={run_dir}")
    recipe = load_recipe(recipe_file, overrides)
    check_backends(recipe.logging)
    candidates = policy.checkpoints_to_try(run_dir, recipe_file)
    changed = policy.recipe_changes(candidates[0], recipe)
    saved_world = saved_world_size(candidates[0])
    policy.check_resumable(run_dir, candidates[0], recipe, max_steps)
    policy.check_extension(run_dir, candidates[0], recipe, recipe_file, reschedule)
    check_host_memory(recipe, str(recipe_file))
    session = build_session(recipe, run_dir, resuming=True)
    ckpt = policy.load_newest(session, candidates, recipe_file)
    schedule_note = policy.continue_schedule(session, reschedule)
    with runfiles.writes_end_cleanly(run_dir):
        dropped = MetricsLog(run_dir / "metrics.jsonl").truncate_after(session.progress.step)
        if dist.is_main():
            runfiles.write_atomic(recipe_file, recipe.to_yaml())
    if dist.is_main():
        msg = f"resuming {run_dir} from {ckpt.name} (step {session.progress.step})"
        if session.progress.step >= (recipe.training.max_steps or session.progress.step + 1):
            msg = f"finishing {run_dir}: trained to step {session.progress.step}; writing final/ from {ckpt.name}"
        if saved_world != dist.world_size():
            msg += f" on {dist.world_size()} ranks (written by {saved_world})"
        if changed:
            msg += "; changed: " + ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changed)
        if schedule_note:
            msg += "; " + schedule_note
        if dropped:
            msg += f"; dropped {dropped} metrics records logged after that checkpoint"
        say(msg)
    return run(session, base=ckpt, show=show, stop_at=stop_at)
