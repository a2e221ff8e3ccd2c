"""GRPO on two gloo ranks, data parallel and FSDP2, against one process at twice the batch: each
group is seeded by its index over every rank and each rank takes its share of the global batch's
prompts, so the completions, rewards, gradients, weights and eval rewards agree. A file of its
own, so the suite's workers run it beside test_grpo_train.py."""

import pytest
import torch

from lisaft.metrics.log import read_metrics
from lisaft.train import train
from tests.integration.test_grpo_train import grpo_run  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow  # four tiny runs of 2 steps, two of them under torchrun


def test_two_ranks_sample_train_and_evaluate_as_one_process_at_twice_the_batch(grpo_run):  # noqa: F811
    from test_distributed import grad_norms, torchrun, weights

    common = {"max_steps": 2, "save_every": 0, "eval_every": 2}
    data = {"eval": "prompts.jsonl"}  # each eval prompt seeded by its index, whichever rank scores it
    # Data parallel under scale_rewards batch: the batch's std is the global one, added over ranks.
    runs = {"dp": (False, "batch"), "fsdp": (True, "group")}
    for scale in ("group", "batch"):
        assert train(grpo_run(f"one-{scale}.yaml", data=data, grpo={"scale_rewards": scale},
                              training={**common, "output_dir": f"one-{scale}"}), show=False) == 0
    for name, (fsdp, scale) in runs.items():
        recipe = grpo_run(f"{name}.yaml", data=data, grpo={"scale_rewards": scale},
                          training={**common, "batch_size": 4, "fsdp": fsdp, "output_dir": name})
        result = torchrun("train", str(recipe), cwd=grpo_run.dir)
        assert result.returncode == 0, result.stdout + result.stderr
        one = read_metrics(grpo_run.dir / f"one-{scale}" / "metrics.jsonl")
        two = read_metrics(grpo_run.dir / name / "metrics.jsonl")
        # Float tolerance: the ranks' sums are added in another order.
        for key in ("reward", "reward_std", "completion_length", "loss", "eval_reward"):
            want, got = ([r[key] for r in rows if key in r] for rows in (one, two))
            assert want and got == pytest.approx(want, rel=1e-4, abs=1e-5), (name, key)
        want_norms = grad_norms(grpo_run.dir / f"one-{scale}")
        assert grad_norms(grpo_run.dir / name) == pytest.approx(want_norms, rel=1e-4), name
        want, got = weights(grpo_run.dir / f"one-{scale}"), weights(grpo_run.dir / name)
        far = {k: (got[k] - want[k]).abs().max().item() for k in want
               if not torch.allclose(got[k], want[k], rtol=1e-3, atol=1e-4)}
        assert want.keys() == got.keys() and not far, (name, far)
