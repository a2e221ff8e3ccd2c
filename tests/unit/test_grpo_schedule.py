"""GRPO's generation schedule, TRL's: a generation every steps_per_generation x num_iterations
micro-batches, each micro-batch its slice, the prompts those the data order hands the micro-batch
that starts it; the rollout kept in a checkpoint only where it outlives its step."""

from types import SimpleNamespace

import pytest
import torch

import lisaft.train.objectives.grpo as objective
from lisaft.config.schema import recipe_from_dict
from lisaft.grpo.rollout import Rollout

BASE = {"model": {"config": "c", "tokenizer": "t"}, "data": {"train": "p.jsonl", "format": "prompts"},
        "grpo": {"reward_funcs": ["exact_match"], "num_generations": 2}}


def _grpo(monkeypatch, accum, **grpo):
    calls = []

    def fake_generate(model, policy, prompts, batch_size, seeds, step, keep, sharded, reference=None):
        n = len(calls)
        calls.append((step, [p["id"] for p in prompts], keep, seeds))
        spg = len(prompts) * 2 // batch_size
        return Rollout([{"slice": (n, j), "attention_mask": torch.ones(1)} for j in range(spg)],
                       {"reward_sum": float(n + 1), "generation_s": 0.5})

    monkeypatch.setattr(objective, "generate", fake_generate)
    recipe = recipe_from_dict({**BASE, "grpo": {**BASE["grpo"], **grpo},
                               "training": {"max_steps": 9, "output_dir": "r", "batch_size": 2,
                                            "grad_accum_steps": accum}})
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    return objective.Grpo(recipe, SimpleNamespace(sharded_forward=False), tok, torch.device("cpu")), calls


def _step(grpo, step, accum):
    examples = [[{"id": (step, i, j)} for j in range(2)] for i in range(accum)]
    return [b["slice"] for b in grpo.step_batches(None, step, examples).batches]


def test_one_generation_per_step_feeds_its_micro_batches_in_order(monkeypatch):
    grpo, calls = _grpo(monkeypatch, accum=2)
    assert _step(grpo, 0, 2) == [(0, 0), (0, 1)] and _step(grpo, 1, 2) == [(1, 0), (1, 1)]
    # 2 x 2 completions a generation: 2 prompts, the first micro-batch's.
    assert calls[0][:3] == (0, [(0, 0, 0), (0, 0, 1)], (False, False))
    assert grpo.checkpoint_components([], None) == {}  # nothing outlives a step


def test_num_iterations_trains_twice_on_a_generation_with_its_old_log_probs_kept(monkeypatch):
    grpo, calls = _grpo(monkeypatch, accum=2, num_iterations=2)
    assert [_step(grpo, s, 2) for s in range(3)] == [[(0, 0), (0, 1)], [(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert [c[0] for c in calls] == [0, 2] and calls[0][2] == (True, False)
    assert set(grpo.checkpoint_components([], None)) == {"grpo_rollout"}


@pytest.mark.parametrize("spg, expect", [(1, [[(0, 0), (1, 0)], [(2, 0), (3, 0)]]),
                                         (4, [[(0, 0), (0, 1)], [(0, 2), (0, 3)]])])
def test_steps_per_generation_apart_from_the_accumulation(monkeypatch, spg, expect):
    grpo, calls = _grpo(monkeypatch, accum=2, steps_per_generation=spg)
    assert [_step(grpo, s, 2) for s in range(2)] == expect
    if spg == 1:  # each micro-batch samples its own prompt
        assert [c[1] for c in calls[:2]] == [[(0, 0, 0)], [(0, 1, 0)]]
    assert grpo.outlives_step == (spg == 4)


def test_each_rank_samples_its_share_of_the_global_batch_from_its_groups_seeds(monkeypatch):
    """Two ranks of batch 2 are handed the global micro-batches (4 examples each) and take what one
    process at batch 4 gives each half: its prompts and its groups' seeds."""
    one, one_calls = _grpo(monkeypatch, accum=2)
    examples = [[{"id": (0, i, j)} for j in range(4)] for i in range(2)]
    one.step_batches(None, 0, examples)
    for rank in (0, 1):
        monkeypatch.setattr(objective.dist, "rank", lambda r=rank: r)
        monkeypatch.setattr(objective.dist, "world_size", lambda: 2)
        two, calls = _grpo(monkeypatch, accum=2)
        two.step_batches(None, 0, examples)
        assert calls[0][1] == one_calls[0][1][2 * rank:2 * rank + 2]  # its half of the prompts...
        assert calls[0][3] == one_calls[0][3][2 * rank:2 * rank + 2]  # ...drawn from the same seeds


def test_a_step_that_trains_on_an_earlier_generation_spent_no_time_sampling(monkeypatch):
    grpo, _ = _grpo(monkeypatch, accum=2, num_iterations=2)
    shares = []
    for s in range(2):
        _step(grpo, s, 2)
        sums = {k: v.item() for k, v in grpo.step_sums().items()}
        shares.append(sums["generation_s"])
    assert shares == [0.5, 0.0]


def test_a_step_of_two_generations_logs_the_figures_of_both(monkeypatch):
    grpo, calls = _grpo(monkeypatch, accum=2, steps_per_generation=1)
    _step(grpo, 0, 2)
    sums = {k: v.item() for k, v in grpo.step_sums().items()}
    assert len(calls) == 2 and sums["reward_sum"] == 1.0 + 2.0 and sums["generation_s"] == 0.5 + 0.5
