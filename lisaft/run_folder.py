"""The run folder: what lisaft writes there, what --overwrite may remove, and what a user is told
when a write fails (disk full, quota, read-only disk).

A write can fail in many layers, and each raises its own type: Python's OSError, torch.save's
RuntimeError from its zip writer ("unexpected pos"), safetensors' SafetensorError ("os error
28"). `is_write_failure` recognises all of them so that a full disk ends in one message, never in
a traceback.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

from lisaft.checkpoint.checkpointer import CHECKPOINTS, complete_checkpoints
from lisaft.console import first_line, warn
from lisaft.errors import LisaftError, RunFailed

# Everything lisaft may write into a run folder, and nothing else: --overwrite removes these.
# A new kind of output (a logging backend's folder) must be added here.
RUN_ENTRIES = ("recipe.yaml", "metrics.jsonl", CHECKPOINTS, "final", "lisa_offload", "logs", "plot.png",
               ".final.tmp", ".recipe.yaml.tmp", "metrics.jsonl.tmp")
# The entries that show a folder holds a lisaft run.
RUN_MARKERS = ("recipe.yaml", "metrics.jsonl", CHECKPOINTS, "final")
# Held by the process that trains the run (`live`); never removed by --overwrite.
LOCK = ".lock"

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


def _once_fixed(e: BaseException) -> str:
    """When the user can go on: a refused permission is no full disk."""
    code = getattr(e, "errno", None)
    if code in (errno.EACCES, errno.EPERM):
        return "once you may write there again,"
    if code == errno.EROFS:
        return "once the disk is writable again,"
    if code == errno.EIO:
        return "once the disk reads and writes again,"
    return "once the disk has room,"


def write_failed(run_dir: Path, e: BaseException, recipe_file: Path | None = None) -> RunFailed:
    """The one message for a write that failed mid-run, after removing what it left half done.
    `recipe_file` is the recipe that starts the run over (default: the run's own copy)."""
    run_dir = Path(run_dir)
    partial = remove_temporaries(run_dir)
    what = " and ".join(partial) if partial else f"to {run_dir}"
    complete = complete_checkpoints(run_dir, warn=lambda m: None)
    once = _once_fixed(e)
    if complete:
        where = (f"the newest complete checkpoint, {complete[0].name}, is intact; {once} "
                 f"continue with `lisaft resume {run_dir}`")
    else:
        where = f"no checkpoint was completed; {once} start over with {start_over(run_dir, recipe_file)}"
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
    """Decorates the loop `fn(session, ..., recipe_file=None)` with `writes_end_cleanly`."""

    @functools.wraps(run_loop)
    def wrapper(session, *args, **kwargs):
        with writes_end_cleanly(session.run_dir, kwargs.get("recipe_file")):
            return run_loop(session, *args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------------------------
# before a run: the output folder


def _trains_into(recipe_file: Path) -> Path | None:
    """The folder a recipe file trains into, or None when the file does not read as a recipe."""
    from lisaft.config.schema import load_recipe

    try:
        return Path(load_recipe(recipe_file).training.output_dir)
    except LisaftError:
        return None


def _same_folder(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def start_over(run_dir: Path, recipe_file: Path | None = None) -> str:
    """The command (in backticks) that starts the run in `run_dir` over, and no other run. A run
    folder copied with `cp -a` keeps a recipe.yaml whose training.output_dir names the original
    folder: `lisaft train COPY/recipe.yaml --overwrite` alone would replace the original run, so
    the command names the folder whenever the recipe trains elsewhere."""
    run_dir = Path(run_dir)
    recipe_file = Path(recipe_file) if recipe_file is not None else run_dir / "recipe.yaml"
    command = f"lisaft train {recipe_file} --overwrite"
    target = _trains_into(recipe_file)
    if target is None or not _same_folder(target, run_dir):
        command += f" --set training.output_dir={run_dir}"
    return f"`{command}`"


def is_run_recipe(recipe_file: Path) -> bool:
    """A run folder's own recipe.yaml (the resolved copy lisaft writes), not a recipe a user wrote:
    the folder also holds what only a run leaves (metrics, checkpoints, the export, the lock)."""
    recipe_file = Path(recipe_file)
    folder = recipe_file.parent
    return recipe_file.name == "recipe.yaml" and any(
        (folder / name).exists() for name in ("metrics.jsonl", CHECKPOINTS, "final", LOCK))


def check_copied_recipe(recipe_file: Path, run_dir: Path, overwrite: bool, output_dir_given: bool) -> None:
    """Refuse --overwrite of a run other than the one whose recipe.yaml the user gave: a copied run
    folder's recipe still names the original folder, and overwriting it there loses that run.
    Naming the folder on the command line (--set training.output_dir=...) says it is meant."""
    recipe_file = Path(recipe_file)
    home = recipe_file.parent
    if (not overwrite or output_dir_given or not is_run_recipe(recipe_file) or _same_folder(home, run_dir)
            or not run_dir.is_dir() or not looks_like_run(run_dir)):
        return
    raise LisaftError(
        f"{recipe_file} is the recipe of the run in {home}, but its training.output_dir is {run_dir}, another "
        f"run that --overwrite would replace; to start over in {home}: `lisaft train {recipe_file} --overwrite "
        f"--set training.output_dir={home}`; to replace {run_dir}, name it: "
        f"`--set training.output_dir={run_dir}`")


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
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK)
    if not entries:
        return
    others = [n for n in entries if n not in RUN_ENTRIES]
    if not looks_like_run(run_dir):
        raise LisaftError(f"{key}: {run_dir} is not empty and holds no lisaft run; choose another folder")
    if not overwrite:
        if not complete_checkpoints(run_dir, warn=lambda m: None) and not (run_dir / "final").exists():
            raise LisaftError(f"{key}: {run_dir} holds a run that stopped before its first checkpoint, "
                              "so there is nothing to resume; pass --overwrite to start over")
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


# ---------------------------------------------------------------------------------------------
# one process at a time


def _holder(lock: Path) -> str:
    try:
        pid, _, host = lock.read_text().strip().partition(" ")
    except OSError:
        pid, host = "", ""
    if not pid:
        return "another lisaft process"
    return f"lisaft process {pid}" + (f" on {host}" if host else "")


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _acquire(run_dir: Path) -> int | None:
    """The locked lock file (its descriptor). flock, not a file's mere presence: the kernel drops
    the lock when the process dies however it dies (SIGKILL, the OOM killer), so a crashed run's
    lock file never blocks its resume. On NFS, Linux carries flock to the server as a byte-range
    lock; a mount without locking (nolock) gets a warning and no lock."""
    path = run_dir / LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LisaftError(f"training.output_dir: {run_dir}: cannot write in it ({e.strerror}); "
                              "choose a folder you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LisaftError(
                f"{run_dir} is live: {_holder(path)} is training it; wait for it to end, or stop it (Ctrl-C or "
                f"kill: it checkpoints) and then `lisaft resume {run_dir}`") from None
        except OSError as e:
            os.close(fd)
            warn(f"{run_dir}: cannot lock the run folder ({e.strerror}); nothing keeps a second process "
                 "from training into it at the same time")
            return None
        # The holder removes the file as it leaves: a lock taken on the file it removed holds nothing.
        if _same_file(fd, path):
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
            except OSError:
                pass  # a full disk: the lock holds without its holder's name; the run's writes report it
            return fd
        os.close(fd)


def check_writable(run_dir: Path) -> None:
    """Refuse at start what the run would fail to write only at its end (the final export
    replaces final/, pruning removes checkpoints): lisaft's entries must be writable too."""
    for name in ("final", CHECKPOINTS, "recipe.yaml", "metrics.jsonl"):
        p = run_dir / name
        if p.exists() and not os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0)):
            raise LisaftError(f"training.output_dir: {p}: no permission to write it, which the run needs; "
                              "give yourself write permission on it")


@contextmanager
def live(run_dir: Path):
    """Hold `run_dir` for this process: a second `lisaft train` or `lisaft resume` on it is refused
    with who holds it. Under torchrun rank 0 holds it for every rank (the ranks of one run may be
    on several machines of one shared folder). Creates the folder when absent and removes it again
    when the command left nothing else in it (a start that failed)."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    if created:
        make_run_dir(run_dir)
    fd = _acquire(run_dir)
    try:
        check_writable(run_dir)
        yield
    finally:
        if fd is not None:
            try:
                (run_dir / LOCK).unlink(missing_ok=True)
            except OSError:
                pass  # a folder turned read-only: the lock goes with the descriptor all the same
            os.close(fd)
        if created:
            try:
                run_dir.rmdir()  # only when empty
            except OSError:
                pass
