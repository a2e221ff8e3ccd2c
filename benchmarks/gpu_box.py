"""A time box for a GPU-suite process and everything it starts.

A step or run that outlives its box must take its whole process tree with it: an 8B run left
behind holds ~20 GiB of the card, and the next run's allocator cap, which subtracts what NVML sees
in use on the whole device, drops near zero. So each boxed command runs in a session (and process
group) of its own, and the group is killed when the box expires, and again once the command has
ended, for anything it left running (inductor's compile workers, a child of a child)."""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
import traceback


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def run_boxed(argv: list[str], timeout: float | None, **popen) -> tuple[int, str | None, str | None]:
    """Run argv in a process group of its own for at most `timeout` seconds (None: no limit).
    Returns (exit code, or 124 when the box expired; stdout; stderr) as Popen's keywords route them."""
    proc = subprocess.Popen(argv, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=None if timeout is None else max(timeout, 0.0))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        rc = 124
    kill_group(proc.pid)
    return rc, out, err


def remaining(started: float, budget_s: float | None) -> float | None:
    """Seconds left of a box of `budget_s` opened at `started` (time.time(); the plan passes the
    moment it opened the step's box, before this process paid its imports). None: no box."""
    return None if budget_s is None else budget_s - (time.time() - started)


def preload() -> None:
    """What every dry-run step imports first (torch, transformers' Llama, peft, lisaft's trainer),
    imported once in the process that forks the steps: on the CI machine the dry run's steps are
    seconds of work each behind seconds of imports. Nothing here runs a torch op, so no OpenMP team
    exists yet to be forked half-alive."""
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import lisaft.cli  # noqa: F401
    import lisaft.train  # noqa: F401


def run_forked(argv: list[str], timeout: float | None, log, cwd) -> int:
    """`python -m MODULE ARGS` (argv as run_boxed takes it) in a forked child of this process, in a
    process group of its own, its output to `log`, under the same box as run_boxed. The dry run's
    way to skip each step's imports; the GPU run starts each step afresh (its own CUDA context)."""
    assert argv[1] == "-m", argv
    pid = os.fork()
    if pid == 0:  # the step
        code = 1
        try:
            os.setsid()
            os.chdir(cwd)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            # Python's streams anew on those descriptors: the parent's may be anything (pytest's capture).
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # Not sys.exit: the parent's exit handlers (its temporary folders' cleanup) are not the step's.
            os._exit(code)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            kill_group(pid)
            return os.waitstatus_to_exitcode(status)
        if deadline is not None and time.monotonic() > deadline:
            kill_group(pid)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.05)
