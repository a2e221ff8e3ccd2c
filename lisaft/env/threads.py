"""CPU threads: how many, and how idle ones wait.

torch runs its CPU kernels on an OpenMP pool. Between two parallel regions OpenMP's own default
keeps the idle threads spinning (GNU OpenMP: 300,000 rounds, milliseconds) before they sleep.
On a machine where another process wants a core, a spinning thread holds the core that the
thread it waits for needs, and a small model's step (thousands of short regions) stalls: the
quickstart fell from 10-14k to about 150 tokens/s next to one busy process (issue 23; docs/threads.md;
benchmarks/threads_bench.py). A passive wait gives the core back at
once; what it costs is a wake-up per region: on a quiet machine the quickstart ran at 10k tokens/s
with two sleeping threads against 20k spinning, and at 11.6k on one thread, which it ships with.
lisaft chooses never stalling; a user alone on a machine can set OMP_WAIT_POLICY=ACTIVE.

The wait policy is read once, when torch loads OpenMP, so `configure_openmp` runs before torch is
imported (the command line's entry point). The thread count can change at any time:
`apply_threads` sets it from `training.threads` when a run starts.

A thread that runs CPU work beside others (the CPU step's workers) opens its own team: torch's
OpenMP and numba's threads are per calling thread, each as large as the process's count. N such
threads would run N x N threads on N CPUs; `team_pool` gives them one team's worth between them.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Any of these in the environment means the user chose how OpenMP waits: lisaft leaves it alone.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def configure_openmp(environ: dict | None = None) -> None:
    """Idle OpenMP threads sleep instead of spinning, unless the environment says otherwise.
    Must run before torch is imported."""
    env = os.environ if environ is None else environ
    if not any(name in env for name in WAIT_VARIABLES):
        env["OMP_WAIT_POLICY"] = "PASSIVE"


def _cgroup_cpu_limit(root: Path) -> float | None:
    """CPUs' worth of time the container's quota allows (docker --cpus), or None when unlimited.
    cgroup v2 writes "quota period" in cpu.max, v1 two files."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        per = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return us / per if us > 0 and per > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on (taskset, cpusets) and, under a CPU quota, no more than the
    quota pays for. os.cpu_count() counts the whole machine, which a container may not have."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    limit = _cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def thread_count(setting: int | str, local_processes: int = 1, environ: dict | None = None) -> int | None:
    """Intra-op threads for `training.threads`: a number is taken as it is; `auto` shares the
    usable CPUs among the processes of this machine (data parallel on CPU), unless OMP_NUM_THREADS
    is set (torchrun sets it too), which then counts. None: leave torch's count alone."""
    env = os.environ if environ is None else environ
    if setting != "auto":
        return int(setting)
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, usable_cpus() // max(1, local_processes))


def apply_threads(setting: int | str, local_processes: int = 1) -> int:
    """Set torch's intra-op thread count from `training.threads`; returns the count in force."""
    import torch

    n = thread_count(setting, local_processes)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()


def worker_team(workers: int, threads: int) -> int:
    """Threads each of `workers` side-by-side workers may use: `threads` (torch's count) capped by
    the usable CPUs, shared out, at least one each."""
    return max(1, min(threads, usable_cpus()) // max(1, workers))


def team_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """`workers` threads whose OpenMP (and numba, lisaft/optim/host_step.py follows torch's count)
    teams together fill the usable CPUs once. Every worker is started and sized before this returns."""
    import torch

    own = torch.get_num_threads()
    team = worker_team(workers, own)
    pool = ThreadPoolExecutor(workers, thread_name_prefix=prefix)
    started = threading.Barrier(workers + 1, timeout=60)

    def size() -> None:
        if torch.get_num_threads() != team:
            torch.set_num_threads(team)  # per calling thread, and the count new threads start with
        started.wait()  # held until all are up: a busy worker is never handed a second start

    for _ in range(workers):
        pool.submit(size)
    started.wait()
    if team != own:
        torch.set_num_threads(own)  # threads started later (autograd's, the copy worker) get the process's
    return pool
