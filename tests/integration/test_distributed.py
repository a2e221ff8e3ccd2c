"""Data parallel over torch.distributed: two gloo processes on CPU."""

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from lisaft.metrics import read_metrics
from lisaft.trainer import train


def torchrun(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lisaft", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def train_losses(run):
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def weights(run):
    out = {}
    for f in (run / "final").glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def test_two_ranks_match_one_process_at_twice_the_batch_and_resume_exactly(tiny_run):
    common = dict(scheduler={"name": "constant"}, lisa={"interval_steps": 2},
                  training={"max_steps": 4, "eval_every": 2, "eval_batches": 4})
    single = tiny_run("single.yaml", **{**common, "training": {**common["training"], "batch_size": 4,
                                                              "output_dir": "single"}})
    assert train(single, show=False) == 0
    dp = tiny_run("dp.yaml", **{**common, "training": {**common["training"], "batch_size": 2,
                                                      "output_dir": "dp"}})
    result = torchrun("train", str(dp), cwd=tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    # Float tolerance, not bit equality: the two-rank gradient is a sum of two partial sums
    # (all-reduce) and each rank pads its own micro-batch, so float32 additions happen in
    # another order; everything else (data, LISA layers, learning rate) is identical.
    a, b = train_losses(tiny_run.dir / "single"), train_losses(tiny_run.dir / "dp")
    assert len(a) == len(b) == 4
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5), (a, b)
    wa, wb = weights(tiny_run.dir / "single"), weights(tiny_run.dir / "dp")
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-4), k
    evals = [r for r in read_metrics(tiny_run.dir / "dp" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]

    # Stopped after 2 steps and resumed with two ranks: bit-identical to the uninterrupted run.
    cut = tiny_run("cut.yaml", **{**common, "training": {**common["training"], "batch_size": 2,
                                                        "max_steps": 2, "output_dir": "cut"}})
    assert torchrun("train", str(cut), cwd=tiny_run.dir).returncode == 0
    result = torchrun("resume", str(tiny_run.dir / "cut"), "--max-steps", "4", cwd=tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert train_losses(tiny_run.dir / "cut") == b
    wc = weights(tiny_run.dir / "cut")
    assert all(wc[k].equal(wb[k]) for k in wb)
    ckpt = tiny_run.dir / "cut" / "checkpoints" / "step-000004"
    assert (ckpt / "rng-rank0.pt").is_file() and (ckpt / "rng-rank1.pt").is_file()

    # Sharded optimizer state: each rank keeps the moments of its share of the units and
    # broadcasts their updates. The arithmetic per parameter is unchanged, so the run is
    # bit-identical to the replicated one, and a sharded run resumes exactly.
    sharded = {**common["training"], "batch_size": 2, "shard_optimizer_state": True}
    sh = tiny_run("sh.yaml", **{**common, "training": {**sharded, "output_dir": "sh"}})
    result = torchrun("train", str(sh), cwd=tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert train_losses(tiny_run.dir / "sh") == b
    ws = weights(tiny_run.dir / "sh")
    assert all(ws[k].equal(wb[k]) for k in wb)
    state = [r["optimizer_state_bytes"] for r in read_metrics(tiny_run.dir / "sh" / "metrics.jsonl") if "loss" in r]
    full = [r["optimizer_state_bytes"] for r in read_metrics(tiny_run.dir / "dp" / "metrics.jsonl") if "loss" in r]
    assert state[-1] < 0.75 * full[-1], (state, full)
    shcut = tiny_run("shcut.yaml", **{**common, "training": {**sharded, "max_steps": 2, "output_dir": "shcut"}})
    assert torchrun("train", str(shcut), cwd=tiny_run.dir).returncode == 0
    # Embeddings (unit 0) are owned by rank 0 and the head (unit 5 of 6) by rank 1: each owner
    # wrote its unit's file.
    opt_dir = tiny_run.dir / "shcut" / "checkpoints" / "step-000002" / "optimizer"
    assert (opt_dir / "embeddings.pt").is_file() and (opt_dir / "head.pt").is_file()
    result = torchrun("resume", str(tiny_run.dir / "shcut"), "--max-steps", "4", cwd=tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert train_losses(tiny_run.dir / "shcut") == b
    assert all(weights(tiny_run.dir / "shcut")[k].equal(wb[k]) for k in wb)

    # A different world size is refused with a clear message.
    from typer.testing import CliRunner

    from lisaft.cli import app

    out = CliRunner().invoke(app, ["resume", str(tiny_run.dir / "cut"), "--max-steps", "6"])
    assert out.exit_code == 2 and "2 processes" in out.output
