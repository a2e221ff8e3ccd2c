"""CPU threads: the OpenMP wait policy set before torch loads, the thread count from the CPUs
this process may use (benchmarks/threads_bench.py measures why)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lisaft.env import threads
from lisaft.env.threads import apply_threads, configure_openmp, thread_count, usable_cpus


def test_idle_threads_sleep_unless_the_user_chose_a_wait_policy():
    env = {}
    configure_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for name, value in [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "0")]:
        env = {name: value}
        configure_openmp(env)
        assert env == {name: value}


def test_the_command_line_sets_the_policy_before_torch_is_imported():
    """OpenMP reads the policy once, when torch loads it: set later, it does nothing."""
    code = ("import os, sys\nfrom lisaft import cli\n"
            "cli.app = lambda: print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
            "cli.main()\n")
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "False"]


def _cgroup(tmp_path, text):
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def test_usable_cpus_follow_affinity_and_a_container_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no cgroup files: affinity alone
    assert usable_cpus(_cgroup(tmp_path, "max 100000\n")) == affinity
    assert usable_cpus(_cgroup(tmp_path, "50000 100000\n")) == 1  # half a CPU still needs a thread
    assert usable_cpus(_cgroup(tmp_path, f"{100000 * affinity + 1} 100000\n")) == affinity
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(v1) == 1


def test_usable_cpus_are_shared_among_processes_and_omp_num_threads_counts(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    assert thread_count("auto", environ={}) == 8
    assert thread_count("auto", local_processes=2, environ={}) == 4
    assert thread_count("auto", local_processes=16, environ={}) == 1
    assert thread_count("auto", environ={"OMP_NUM_THREADS": "3"}) is None
    assert thread_count(2, environ={"OMP_NUM_THREADS": "3"}) == 2


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_apply_threads_sets_torchs_count(restore_threads, monkeypatch):
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert apply_threads("auto") == usable_cpus()


def _teams(pool, jobs: int) -> list[tuple[str, int]]:
    """(worker, torch's thread count there) for `jobs` jobs held until all have started."""
    import threading

    together = threading.Barrier(jobs, timeout=30)

    def job() -> tuple[str, int]:
        together.wait()
        return threading.current_thread().name, torch.get_num_threads()

    return [f.result() for f in [pool.submit(job) for _ in range(jobs)]]


@pytest.mark.parametrize(("workers", "cpus", "team"), [(4, 4, 1), (2, 8, 4), (1, 2, 2), (3, 4, 1)])
def test_side_by_side_workers_share_one_team(restore_threads, monkeypatch, workers, cpus, team):
    """N workers each opening a team of the process's size would run N x N threads on N CPUs:
    together they get the usable CPUs once, and threads started later keep the process's count."""
    import threading

    monkeypatch.setattr(threads, "usable_cpus", lambda: cpus)
    torch.set_num_threads(8)
    pool = threads.team_pool(workers, "test-team")
    try:
        seen = _teams(pool, workers)
    finally:
        pool.shutdown()
    assert len({name for name, _ in seen}) == workers
    assert [n for _, n in seen] == [team] * workers
    assert workers * team <= cpus
    assert torch.get_num_threads() == 8
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [8]
