"""The GPU suite's time boxes (benchmarks/gpu_box.py, gpu_plan.py): a box that expires takes the
step's whole process tree with it, and the plan's expected times hold every part the steps pay."""

import subprocess
import sys
import textwrap
import time

import pytest

from benchmarks import gpu_box, gpu_plan
from benchmarks.gpu_times import HOST_KERNEL_COMPILE_S, IMPORT_S


def _gone(pid: int) -> bool:
    """Dead, or a zombie nobody reaped yet (its parent was killed with it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_expired_box_kills_the_children_of_the_step_too(tmp_path):
    """The 8B runs are a step's grandchildren: killing the step's own process left them holding the
    card for the next run. The box kills the step's process group."""
    pidfile = tmp_path / "grandchild.pid"
    step = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)
    t0 = time.monotonic()
    rc, _, _ = gpu_box.run_boxed([sys.executable, "-c", step], timeout=4, stdout=subprocess.DEVNULL)
    assert rc == 124 and time.monotonic() - t0 < 30
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)


def test_a_step_that_ends_in_time_keeps_its_exit_and_output():
    rc, out, _ = gpu_box.run_boxed([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], timeout=60,
                                   stdout=subprocess.PIPE, text=True)
    assert (rc, out) == (3, "hi\n")


def test_the_runs_budget_counts_from_when_the_box_opened():
    """A step's runs are told when its box opened: their imports come out of the budget too."""
    started = time.time() - 7
    assert 2.9 < gpu_box.remaining(started, 10) <= 3.0
    assert gpu_box.remaining(started, None) is None
    steps = {s.name: s for s in gpu_plan.STEPS}
    argv = steps["offload"].argv(gpu_plan.REPO, dry=False, started=started)
    assert argv[argv.index("--started") + 1] == repr(started)
    assert float(argv[argv.index("--budget-s") + 1]) == steps["offload"].budget_s - 2


def test_the_plan_counts_the_peer_parent_and_the_host_kernels():
    """The peer step's own process starts before either side; the equality step's cpu_offload checks
    compile numba's host kernel for float32 and for bf16 weights; a step's second cpu_offload run
    finds it cached: all inside the step's expected time."""
    from benchmarks.gpu_8b_24gb import BY_NAME

    peer = gpu_plan._small("peer")
    lisaft = BY_NAME["peer-lisaft"].expected["seconds"]
    assert peer["parts"]["parent_start_s"] == IMPORT_S and peer["seconds"] == IMPORT_S + 2 * lisaft
    assert gpu_plan._small("equality")["parts"]["host_kernel_s"] == 2 * HOST_KERNEL_COMPILE_S
    offload = next(s for s in gpu_plan.STEPS if s.name == "offload").expected()
    device, host = (BY_NAME[f"offload-{arm}-ga4"].expected["seconds"] for arm in ("full", "host"))
    assert offload["runs"] == {"offload-full-ga4": device, "offload-host-ga4": host - HOST_KERNEL_COMPILE_S}
    assert offload["seconds"] == pytest.approx(sum(offload["runs"].values()) + gpu_plan.SUITE_MARGIN_S)
    assert gpu_plan.check(gpu_plan.plan()) == []


def test_a_forked_step_runs_as_python_m_would_and_its_box_holds(tmp_path, monkeypatch):
    """The dry run's steps, forked from one process: the module runs as __main__ with its argv,
    its exit code and output come back, and an expired box kills what it started too."""
    (tmp_path / "step_mod.py").write_text(textwrap.dedent("""
        import subprocess, sys, time
        print("argv", sys.argv[1:], flush=True)
        if sys.argv[1] == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            open(sys.argv[2], "w").write(str(child.pid))
            time.sleep(60)
        if __name__ == "__main__":
            sys.exit(5)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with (tmp_path / "log").open("w") as log:
        assert gpu_box.run_forked([sys.executable, "-m", "step_mod", "quick"], 60, log, tmp_path) == 5
    assert (tmp_path / "log").read_text() == "argv ['quick']\n"
    pidfile = tmp_path / "pid"
    with (tmp_path / "log2").open("w") as log:
        assert gpu_box.run_forked([sys.executable, "-m", "step_mod", "hang", str(pidfile)], 4, log, tmp_path) == 124
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)
