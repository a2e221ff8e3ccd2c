"""Joining torchrun's process group: the backend follows training.device (gloo for the CPU even
where CUDA is visible), NCCL is bound to the GPU this process sees (device_id), and the group's
timeout covers rank 0's work alone (the export's join)."""

import os
import sys
from datetime import timedelta

import pytest
import torch

from lisaft.distributed import dist
from lisaft.errors import LisaftError


@pytest.fixture
def launched(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.torch_dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append({"set_device": d}))
    return calls


def test_a_cpu_run_uses_gloo_even_where_cuda_is_visible(launched):
    assert dist.init_from_env(torch.device("cpu"))
    assert launched == [{"backend": "gloo", "timeout": dist.TIMEOUT}]
    assert dist.TIMEOUT >= timedelta(minutes=30)  # NCCL's default 10 minutes would not cover the join


def test_a_cuda_run_binds_nccl_to_its_device(launched):
    gpu = torch.device("cuda", 1)
    assert dist.init_from_env(gpu)
    assert launched == [{"set_device": gpu}, {"backend": "nccl", "timeout": dist.TIMEOUT, "device_id": gpu}]


def test_not_launched_joins_nothing(launched, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not dist.init_from_env(torch.device("cpu")) and launched == []


@pytest.mark.parametrize("count, local, index", [(8, 3, 3), (1, 3, 0), (2, 1, 1)])
def test_the_local_index_is_the_one_cuda_sees(monkeypatch, count, local, index):
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert dist.local_cuda_index() == index


def test_a_rank_without_its_gpu_is_one_line(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(LisaftError, match="LOCAL_RANK 3") as e:
        dist.local_cuda_index()
    assert "\n" not in str(e.value)


LEAVE = """
import os, sys
from lisaft.distributed import dist
assert dist.init_from_env()
import torch.distributed.nn  # as transformers does, lazily, when it loads a model config
dist.shutdown()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sorted(n for n in names if "gloo" in n))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_leaving_the_group_ends_its_threads(tmp_path):
    """torch.distributed.nn's functions default to `group=group.WORLD`: imported once the group
    exists, they hold it, and its gloo threads outlive destroy_process_group into interpreter exit,
    where one sometimes aborts the finished run (benchmarks/exit_abort.py measures how often)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "test"}
    out = subprocess.run([sys.executable, "-c", LEAVE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "[]"


class _Left(Exception):
    pass


LEAVE_LATE = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from lisaft.distributed import dist
out = Path(sys.argv[1])
pool = ThreadPoolExecutor(1)  # idle, never shut down: exit must still end it
pool.submit(lambda: None).result()
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
atexit.register(lambda: (out / "atexit").write_text((out / "thread").read_text()))
print("flushed at exit", end="")
dist.leave_process(5)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="os._exit semantics as on the ranks")
def test_a_finished_rank_leaves_after_what_exit_would_do_first(tmp_path):
    """dist.leave_process: executors stopped, threads waited for and atexit functions run (after
    the threads, as Python orders them), streams flushed, then the command's code, without the
    interpreter's teardown."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", LEAVE_LATE, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 5, out.stderr
    assert out.stdout == "flushed at exit"
    assert (tmp_path / "atexit").read_text() == "done"


@pytest.mark.parametrize("launched", [True, False], ids=["torchrun", "plain"])
def test_the_cli_leaves_a_torchrun_rank_through_leave_process(monkeypatch, launched):
    from lisaft import cli

    codes = []

    def leave(code):
        codes.append(code)
        raise _Left

    monkeypatch.setattr(dist, "leave_process", leave)
    if launched:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(sys, "argv", ["lisaft", "--help"])
    with pytest.raises(_Left if launched else SystemExit):
        cli.main()
    assert codes == ([0] if launched else [])
