"""A time box for a GPU-suite process and everything it starts.

A step or run that outlives its box must take its whole process tree with it: an 8B run left
behind holds ~20 GiB of the card, and the next run's allocator cap, which subtracts what NVML sees
in use on the whole device, drops near zero. So each boxed command runs in a session (and process
group) of its own, and the group is killed when the box expires, and again once the command has
ended, for anything it left running (inductor's compile workers, a child of a child)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


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
