"""apollo under data parallel: two gloo processes on CPU take the update one process takes at
twice the batch (the replicas draw the same projection), with sharded state too."""

from types import SimpleNamespace

import pytest
import torch
from test_distributed import COMMON, torchrun, train_losses, weights

from lisaft.train import train

APOLLO = {"name": "apollo", "lr": 3e-3, "rank": 2, "update_proj_gap": 3}


def recipe(tiny_run, name: str, **training):
    return tiny_run(f"{name}.yaml", **{**COMMON, "optimizer": APOLLO, "lisa": {"enabled": False},
                                       "training": {**COMMON["training"], "output_dir": name, **training}})


@pytest.fixture(scope="module")
def single(shared_tiny_run):
    """The reference both two-rank runs are held to: one process at batch 4, trained once."""
    assert train(recipe(shared_tiny_run, "single", batch_size=4), show=False) == 0
    run = shared_tiny_run.dir / "single"
    return SimpleNamespace(tiny_run=shared_tiny_run, losses=train_losses(run), weights=weights(run))


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True])
def test_two_ranks_match_one_process_at_twice_the_batch(single, shard):
    name = f"dp-shard-{shard}"
    two = recipe(single.tiny_run, name, batch_size=2, shard_optimizer_state=shard)
    result = torchrun("train", str(two), cwd=single.tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    # Float tolerance: the all-reduced gradient sums in another order (test_distributed.py).
    a, b = single.losses, train_losses(single.tiny_run.dir / name)
    assert len(a) == len(b) == 4
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5), (a, b)
    wa, wb = single.weights, weights(single.tiny_run.dir / name)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-4), k
