"""The preference protocol's pairs and report (benchmarks/learning/preference.py, report_pref.py):
every pair's rejected answer is a plausible wrong one, chosen is the instruction example's
answer, and the report's means, gains, winners and missing runs come from the runs given."""

import random

import pytest

from benchmarks.learning import preference, report_pref
from lisaft.data.formats.instruction import render_instruction_prompt
from scripts import make_quickstart_assets as gen


def test_pairs_prefer_the_right_answer_over_a_plausible_wrong_one():
    rows, _ = gen.make_rows(random.Random(gen.SEED))
    pairs = preference.pair_rows(rows[:300], 7)
    assert {p["wrong_kind"] for p in pairs} == {"other_task", "neighbour", "one_letter"}
    for row, p in zip(rows, pairs):
        assert p["prompt"] == render_instruction_prompt(row["instruction"], row["input"])
        assert p["chosen"] == row["output"] != p["rejected"]
        if p["wrong_kind"] == "one_letter":  # the same length, one letter off, the same case
            assert len(p["rejected"]) == len(p["chosen"])
            assert sum(a != b for a, b in zip(p["rejected"], p["chosen"])) == 1
            assert p["rejected"].isupper() == p["chosen"].isupper()
        elif p["wrong_kind"] == "other_task":  # what another family-A task answers to this input
            assert p["rejected"] in {fn(row["input"]) for fn in gen.TASKS.values()}
        else:  # this task's answer to another item's input
            assert p["rejected"] in {gen.TASKS[row["instruction"]](r["input"]) for r in rows[:300] if r is not row}
    assert pairs == preference.pair_rows(rows[:300], 7)  # the same pairs every run


def _run(loss, arm, seed, reward, logp, em):
    return {"loss": loss, "arm": arm, "seed": seed, "lr": 0.003, "lora_rank": None, "trainable_params_last": 10,
            "peak_optimizer_state_bytes": 2 ** 20 * (seed + 1), "wall_s": 10.0 * (seed + 1),
            "after": {"reward_accuracy": reward, "logp_accuracy": logp, "exact_match": em}}


def test_report_means_gains_winners_and_what_did_not_run():
    runs = [_run("dpo", "full", 0, 0.8, 0.9, 0.5), _run("dpo", "full", 1, 0.6, 0.7, 0.3),
            _run("dpo", "lora_eq_g2", 0, 0.4, 0.95, 0.2)]
    s = {"grid": [("dpo", "full"), ("dpo", "lora_eq_g2")], "seeds": [0, 1], "layers": 6, "train_pairs": 8,
         "eval_pairs": 4, "steps": 2, "batch_size": 2}
    pre = {"steps": 10, "before": {"exact_match": 0.25, "logp_accuracy": 0.5, "simpo_reward_accuracy": 0.5,
                                   "orpo_reward_accuracy": 0.5}}
    out = report_pref.summarise("run", s, pre, runs, {"full": 0.003}, {})
    full = out["results"]["dpo"]["full"]
    assert full["reward_accuracy"]["mean"] == pytest.approx(0.7)
    assert full["reward_accuracy"]["sd"] == pytest.approx(0.1414213, abs=1e-6)
    assert full["exact_match_gain"]["values"] == pytest.approx([0.25, 0.05])
    assert full["peak_optimizer_state_bytes"] == 2 * 2 ** 20 and full["wall_s_median"] == 15.0
    assert full["learned_preference"] and not out["results"]["dpo"]["lora_eq_g2"]["learned_preference"]
    assert out["winners"]["dpo"] == {"reward_accuracy": "full", "logp_accuracy": "lora_eq_g2",
                                     "exact_match": "full"}
    assert out["not_run"] == [("dpo", "lora_eq_g2", 1)]
    table = report_pref.markdown(out)
    assert "| dpo | full | 0.003 | 2 | 70.0 ± 14.1 | 80.0 ± 14.1 | 40.0 ± 14.1 | +15.0 |" in table
    assert "dpo/lora_eq_g2/1" in table
    assert report_pref.before_reward_accuracy(pre["before"], "dpo") is None
