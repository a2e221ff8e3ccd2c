"""Data parallel over torch.distributed: two gloo processes on CPU."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from lisaft.metrics.log import read_metrics
from lisaft.train import train


def torchrun(*args: str, cwd, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "lisaft", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def train_losses(run):
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def grad_norms(run):
    return [r["grad_norm"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def assert_same_grad_norms(run, single, rtol=1e-5):
    """AdamW and clipping hide a constant scale of the gradient from the losses and weights; the
    logged norm before clipping does not, so a rank that divides by its own token count fails here."""
    a, b = grad_norms(run), grad_norms(single)
    assert len(a) == len(b) == 4 and torch.allclose(torch.tensor(a), torch.tensor(b), rtol=rtol, atol=0), (a, b)


def weights(run):
    out = {}
    for f in (run / "final").glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


COMMON = dict(scheduler={"name": "constant"}, lisa={"interval_steps": 2},
              training={"max_steps": 4, "eval_every": 2, "eval_batches": 4})


def recipe(tiny_run, name: str, **training):
    return tiny_run(f"{name}.yaml", **{**COMMON, "training": {**COMMON["training"], "output_dir": name, **training}})


@pytest.fixture(scope="module")
def dp(shared_tiny_run):
    """The reference: two ranks of batch 2 trained to step 4 without a stop."""
    result = torchrun("train", str(recipe(shared_tiny_run, "dp", batch_size=2)), cwd=shared_tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    run = shared_tiny_run.dir / "dp"
    return SimpleNamespace(tiny_run=shared_tiny_run, run=run, losses=train_losses(run), weights=weights(run))


@pytest.mark.slow
def test_two_ranks_match_one_process_at_twice_the_batch(dp):
    single = recipe(dp.tiny_run, "single", batch_size=4)
    assert train(single, show=False) == 0
    # Float tolerance, not bit equality: the two-rank gradient is a sum of two partial sums
    # (all-reduce) and each rank pads its own micro-batch, so float32 additions happen in
    # another order; everything else (data, LISA layers, learning rate) is identical.
    a = train_losses(dp.tiny_run.dir / "single")
    assert len(a) == len(dp.losses) == 4
    assert torch.allclose(torch.tensor(a), torch.tensor(dp.losses), rtol=1e-4, atol=1e-5), (a, dp.losses)
    wa = weights(dp.tiny_run.dir / "single")
    for k in wa:
        assert torch.allclose(wa[k], dp.weights[k], rtol=1e-3, atol=1e-4), k
    assert_same_grad_norms(dp.run, dp.tiny_run.dir / "single")
    evals = [r for r in read_metrics(dp.run / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]


@pytest.fixture(scope="module")
def cut(dp):
    """Two ranks stopped after 2 steps and resumed to 4."""
    assert torchrun("train", str(recipe(dp.tiny_run, "cut", batch_size=2, max_steps=2)), cwd=dp.tiny_run.dir) \
        .returncode == 0
    result = torchrun("resume", str(dp.tiny_run.dir / "cut"), "--max-steps", "4", cwd=dp.tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    return dp.tiny_run.dir / "cut"


@pytest.mark.slow
def test_two_ranks_resume_bit_identically(dp, cut):
    assert train_losses(cut) == dp.losses
    wc = weights(cut)
    assert all(wc[k].equal(dp.weights[k]) for k in dp.weights)
    ckpt = cut / "checkpoints" / "step-000004"
    assert (ckpt / "rng-rank0.pt").is_file() and (ckpt / "rng-rank1.pt").is_file()


@pytest.mark.slow
def test_sharded_state_trains_bit_identically_with_less_state_per_rank(dp):
    # Each rank keeps the moments of its share of the units and broadcasts their updates. The
    # arithmetic per parameter is unchanged, so the run is bit-identical to the replicated one.
    sh = recipe(dp.tiny_run, "sh", batch_size=2, shard_optimizer_state=True)
    result = torchrun("train", str(sh), cwd=dp.tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert train_losses(dp.tiny_run.dir / "sh") == dp.losses
    ws = weights(dp.tiny_run.dir / "sh")
    assert all(ws[k].equal(dp.weights[k]) for k in dp.weights)
    state = [r["optimizer_state_bytes"] for r in read_metrics(dp.tiny_run.dir / "sh" / "metrics.jsonl") if "loss" in r]
    full = [r["optimizer_state_bytes"] for r in read_metrics(dp.run / "metrics.jsonl") if "loss" in r]
    assert state[-1] < 0.75 * full[-1], (state, full)


@pytest.mark.slow
def test_sharded_state_resumes_bit_identically(dp):
    shcut = recipe(dp.tiny_run, "shcut", batch_size=2, shard_optimizer_state=True, max_steps=2)
    assert torchrun("train", str(shcut), cwd=dp.tiny_run.dir).returncode == 0
    # Embeddings (unit 0) are owned by rank 0 and the head (unit 5 of 6) by rank 1: each owner
    # wrote its unit's file.
    opt_dir = dp.tiny_run.dir / "shcut" / "checkpoints" / "step-000002" / "optimizer"
    assert (opt_dir / "embeddings.pt").is_file() and (opt_dir / "head.pt").is_file()
    result = torchrun("resume", str(dp.tiny_run.dir / "shcut"), "--max-steps", "4", cwd=dp.tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert train_losses(dp.tiny_run.dir / "shcut") == dp.losses
    assert all(weights(dp.tiny_run.dir / "shcut")[k].equal(dp.weights[k]) for k in dp.weights)


@pytest.mark.slow
def test_a_resume_on_another_number_of_ranks_keeps_the_global_batch(dp, cut):
    import shutil

    from typer.testing import CliRunner

    from lisaft.cli import app
    from lisaft.train.commands import resume

    out = CliRunner().invoke(app, ["resume", str(cut), "--max-steps", "6"])
    assert out.exit_code == 2 and "written by 2 ranks at a global batch of 4" in out.output
    assert "--set training.batch_size=4" in out.output and len(out.output.strip().splitlines()) == 1
    # The step-2 checkpoint continued in one process at batch 4: the two-rank run, up to the
    # order of float32 additions.
    one = cut.parent / "cut-one"
    shutil.copytree(cut, one)
    shutil.rmtree(one / "final")
    shutil.rmtree(one / "checkpoints" / "step-000004")
    assert resume(one, overrides=["training.batch_size=4"], show=False) == 0
    losses = train_losses(one)
    assert losses[:2] == dp.losses[:2]
    assert torch.allclose(torch.tensor(losses), torch.tensor(dp.losses), rtol=1e-4, atol=1e-5), (losses, dp.losses)


@pytest.mark.slow
def test_two_ranks_sample_the_same_cyclic_layers(tiny_run):
    # Each rank computes its layers from (seed, interval) alone; if the ranks disagreed, the
    # all-reduced gradients would land on different layers and the run would leave the
    # single-process one.
    common = dict(scheduler={"name": "constant"},
                  lisa={"active_layers": 1, "interval_steps": 1, "sampling": "cyclic"},
                  training={"max_steps": 4, "eval_every": 0})
    single = tiny_run("single.yaml", **{**common, "training": {**common["training"], "batch_size": 4,
                                                              "output_dir": "single"}})
    assert train(single, show=False) == 0
    dp = tiny_run("dp.yaml", **{**common, "training": {**common["training"], "batch_size": 2, "output_dir": "dp"}})
    result = torchrun("train", str(dp), cwd=tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    layers = [r["active_layers"] for r in read_metrics(tiny_run.dir / "dp" / "metrics.jsonl") if "loss" in r]
    assert sorted(i for a in layers for i in a) == [0, 1, 2, 3]  # one cycle: every layer once
    a, b = train_losses(tiny_run.dir / "single"), train_losses(tiny_run.dir / "dp")
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5), (a, b)
    wa, wb = weights(tiny_run.dir / "single"), weights(tiny_run.dir / "dp")
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-4), k
