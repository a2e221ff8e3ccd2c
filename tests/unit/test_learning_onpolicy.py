"""The on-policy preference protocol's report (benchmarks/learning/onpolicy.py): the lr each
(loss, method) reports is the one validation picks, and the gain is the test half's over the
pre-trained model's, from the runs given; `greedy` answers as exact_match scores."""

import pytest
import torch
from _tiny import tiny

from benchmarks.learning import onpolicy


def _run(loss, arm, lr, seed, val, test):
    return {"loss": loss, "arm": arm, "lr": lr, "lr_factor": lr, "seed": seed, "peak_optimizer_state_bytes": 2 ** 20,
            "wall_s": 1.0, "after": {"validation": val, "test": test}}


def test_validation_picks_the_lr_and_the_test_half_reports_it():
    before = {"validation": 0.2, "test": 0.25, "train_prompts": 10, "train_prompts_answered_wrong": 6, "pairs": 6,
              "prefers_own_mistake": 0.5}
    runs = [_run("dpo", "full", 1e-4, 0, 0.3, 0.5), _run("dpo", "full", 1e-4, 1, 0.5, 0.3),   # best on validation
            _run("dpo", "full", 1e-3, 0, 0.2, 0.9), _run("dpo", "full", 1e-3, 1, 0.2, 0.9),   # best on test: not picked
            _run("kto", "full", 1e-4, 0, 0.1, 0.2)]
    s = {"lr_factors": (0.1, 0.3), "seeds": [0, 1]}
    summary = onpolicy.summarise("run", s, before, runs, {})
    cell = summary["results"]["dpo"]["full"]
    assert cell["picked_lr"] == 1e-4 and cell["test"]["mean"] == pytest.approx(0.4)
    assert cell["test_gain"]["mean"] == pytest.approx(0.15) and cell["raised_in_every_seed"]  # +25 and +5 points
    assert summary["results"]["kto"]["full"]["test_gain"]["mean"] == pytest.approx(-0.05)
    assert summary["runs_planned"] == 2 * 4 * 2 * 2 and summary["runs_done"] == 5
    assert "| dpo | full | 0.0001 | 40.0 ± 14.1 | +15.0 ± 14.1 |" in onpolicy.render(summary)


def test_greedy_stops_at_eos_and_batches_as_one_by_one():
    model = tiny()
    prompts = [[1, 5, 6], [1, 7, 8], [1, 9]]
    together = onpolicy.greedy(model, prompts, 5, pad_id=0, eos_id=2)
    alone = [onpolicy.greedy(model, [p], 5, pad_id=0, eos_id=2)[0] for p in prompts]
    assert together == alone and all(2 not in a and len(a) <= 5 for a in together)
    assert torch.is_grad_enabled()  # no_grad stays inside
