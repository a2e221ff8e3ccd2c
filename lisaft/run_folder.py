"""The run folder: what lisaft writes there, what --overwrite may remove, and what a user is told
when a write fails (disk full, quota, read-only disk).

A write can fail in many layers, and each raises its own type: Python's OSError, torch.save's
RuntimeError from its zip writer ("unexpected pos"), safetensors' SafetensorError ("os error
28"). `is_write_failure` recognises all of them so that a full disk ends in one message, never in
a traceback.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from lisaft.checkpoint.checkpointer import CHECKPOINTS, complete_checkpoints
from lisaft.console import first_line
from lisaft.errors import LisaftError, RunFailed

# Everything lisaft may write into a run folder, and nothing else: --overwrite removes these.
# A new kind of output (a logging backend's folder) must be added here.
RUN_ENTRIES = ("recipe.yaml", "metrics.jsonl", CHECKPOINTS, "final", "lisa_offload", "logs", "plot.png",
               ".final.tmp", ".recipe.yaml.tmp", "metrics.jsonl.tmp")
# The entries that show a folder holds a lisaft run.
RUN_MARKERS = ("recipe.yaml", "metrics.jsonl", CHECKPOINTS, "final")

_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM,
                 errno.EIO}
# How torch's zip writer and safetensors word a failed write; neither keeps the errno.
_WRITE_WORDS = ("inline_container", "PytorchStreamWriter", "file write failed", "os error",
                "No space left", "File too large", "Read-only file system", "Disk quota")


def is_write_failure(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno in _WRITE_ERRNOS
    if isinstance(e, (OSError, RuntimeError)) or type(e).__name__ == "SafetensorError":
        return any(w in str(e) for w in _WRITE_WORDS)
    return False


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f" ({e.filename})" if e.filename else "")
    return first_line(e)


@contextmanager
def naming(path: Path):
    """A write that fails part way raises an OSError without a file name; the one-line message
    (`write_failed`) should say which file it was."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def write_atomic(path: Path, text: str, tmp: Path | None = None) -> None:
    """Replace `path` by `text` all at once: a reader, or a run killed part way, sees the old file
    or the new one. The temporary (default `.NAME.tmp` beside it) is removed when the write fails."""
    tmp = tmp or path.with_name(f".{path.name}.tmp")
    try:
        with naming(path):
            tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_temporaries(run_dir: Path) -> list[str]:
    """Remove half-written checkpoints and final exports; returns what was being written."""
    run_dir = Path(run_dir)
    partial = []
    root = run_dir / CHECKPOINTS
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.startswith(".tmp-"):
                partial.append(f"checkpoint {p.name.removeprefix('.tmp-')}")
                shutil.rmtree(p, ignore_errors=True)
    tmp = run_dir / ".final.tmp"
    if tmp.exists():
        partial.append("the final model")
        shutil.rmtree(tmp, ignore_errors=True)
    for name in (".recipe.yaml.tmp", "metrics.jsonl.tmp", "logs/.wandb-run.json.tmp"):
        (run_dir / name).unlink(missing_ok=True)
    return partial


def write_failed(run_dir: Path, e: BaseException, recipe_file: Path | None = None) -> RunFailed:
    """The one message for a write that failed mid-run, after removing what it left half done.
    `recipe_file` is the recipe that starts the run over (default: the run's own copy)."""
    run_dir = Path(run_dir)
    partial = remove_temporaries(run_dir)
    what = " and ".join(partial) if partial else f"to {run_dir}"
    complete = complete_checkpoints(run_dir, warn=lambda m: None)
    if complete:
        where = (f"the newest complete checkpoint, {complete[0].name}, is intact; once the disk has "
                 f"room continue with `lisaft resume {run_dir}`")
    else:
        recipe_file = recipe_file or run_dir / "recipe.yaml"
        where = (f"no checkpoint was completed; once the disk has room start over with "
                 f"`lisaft train {recipe_file} --overwrite`")
    return RunFailed(f"could not write {what}: {_reason(e)}; {where}")


@contextmanager
def writes_end_cleanly(run_dir: Path, recipe_file: Path | None = None):
    """A write failure inside the block (the run's start-up files, the loop's checkpoints,
    metrics, offloaded optimizer state, logs) becomes one RunFailed message."""
    try:
        yield
    except LisaftError:
        raise
    except Exception as e:
        if not is_write_failure(e):
            raise
        raise write_failed(run_dir, e, recipe_file) from None


def clean_write_failures(run_loop):
    """Decorates the loop `fn(session, ...)` with `writes_end_cleanly`."""

    @functools.wraps(run_loop)
    def wrapper(session, *args, **kwargs):
        with writes_end_cleanly(session.run_dir):
            return run_loop(session, *args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------------------------
# before a run: the output folder


def looks_like_run(path: Path) -> bool:
    return any((path / m).exists() for m in RUN_MARKERS)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(run_dir: Path, overwrite: bool, force: bool) -> None:
    """Refuse, before anything is loaded or written, an output_dir the run cannot use."""
    key = "training.output_dir"
    if force and not overwrite:
        raise LisaftError("--force only goes with --overwrite (start over although other files are there)")
    if run_dir.exists() and not run_dir.is_dir():
        raise LisaftError(f"{key}: {run_dir} is a file; choose a folder")
    if not run_dir.exists():
        base = _nearest_existing(run_dir.absolute().parent)
        if not base.is_dir():
            raise LisaftError(f"{key}: {run_dir} cannot be created: {base} is a file, not a folder")
        if not os.access(base, os.W_OK | os.X_OK):
            raise LisaftError(f"{key}: {run_dir} cannot be created: no permission to write in {base}; "
                              "choose a folder you can write to")
        return
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise LisaftError(f"{key}: {run_dir}: no permission to write in it; choose another folder")
    entries = sorted(p.name for p in run_dir.iterdir())
    if not entries:
        return
    others = [n for n in entries if n not in RUN_ENTRIES]
    if not looks_like_run(run_dir):
        raise LisaftError(f"{key}: {run_dir} is not empty and holds no lisaft run; choose another folder")
    if not overwrite:
        raise LisaftError(f"{key}: {run_dir} already holds a run; continue it with "
                          f"`lisaft resume {run_dir}`, or pass --overwrite to start over")
    if others and not force:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise LisaftError(f"{key}: {run_dir} also holds files lisaft did not write ({shown}); "
                          "--overwrite removes only lisaft's files: move the others away, or add "
                          "--force to start over and leave them where they are")


def clear_run(run_dir: Path, keep: tuple[str, ...] = ()) -> None:
    """--overwrite: remove what lisaft wrote in run_dir, nothing else, except the entries in `keep`."""
    for name in RUN_ENTRIES:
        if name in keep:
            continue
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def make_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LisaftError(f"training.output_dir: {run_dir} cannot be created: {e.strerror or e}") from None


def give_files_the_usual_mode(folder: Path) -> None:
    """safetensors creates its files 0600 whatever the umask; the files beside them (config,
    tokenizer) get 0644 under the usual umask. Give every file in `folder` the mode a new file
    gets, so a model folder can be shared or served like any other."""
    umask = os.umask(0)
    os.umask(umask)
    for f in Path(folder).iterdir():
        if f.is_file() and not f.is_symlink():
            f.chmod(0o666 & ~umask)
