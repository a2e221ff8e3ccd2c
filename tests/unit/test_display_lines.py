"""Progress lines fit 80 columns whatever the run's size."""

import pytest

from lisaft.metrics.display import eval_line, train_line

RECORD = {"step": 7, "loss": 1.23456, "lr": 1e-5, "tokens_per_s": 12345.6, "peak_memory_bytes": 21.5 * 2**30,
          "active_layers": [3, 17], "grad_norm": 0.5}


@pytest.mark.parametrize("total, layers", [(400, [0, 1]), (100000, [3, 17]), (1000, list(range(0, 32, 3))),
                                           (1000, None)])
def test_train_line_fits_80_columns(total, layers):
    line = train_line({**RECORD, "active_layers": layers}, total)
    assert len(line) <= 80, line
    assert line.startswith(f"step 7/{total}") and "loss 1.2346" in line and "tok/s" in line
    assert "gn 0.5 " in line
    assert "layers " + ("all" if layers is None else "3" if layers[0] == 3 else "0") in line


def test_a_long_layer_list_is_cut_not_wrapped():
    line = train_line({**RECORD, "active_layers": list(range(32))}, 1000)
    assert len(line) == 80 and line.endswith("…")


def test_eval_line():
    assert eval_line({"step": 50, "eval_loss": 0.97, "eval_token_accuracy": 0.654}) == \
        "eval step 50  loss 0.9700  token accuracy 65.4%"


def test_a_preference_run_shows_its_reward_accuracy_and_margin_within_80_columns():
    rec = {**RECORD, "reward_accuracy": 0.75, "reward_margin": 0.01642}
    line = train_line(rec, 400, width=120)
    assert "lr 1.0e-05  acc 75%  margin 0.0164  gn 0.5" in line and line.endswith("layers 3,17"), line
    assert "  acc 75%  gn 0.5" in train_line(rec, 400, width=95)  # the margin gives way first
    for total in (400, 100000):  # then the accuracy: a line still fits 80 columns
        assert len(train_line(rec, total)) <= 80
    assert eval_line({"step": 6, "eval_loss": 0.6826, "eval_reward_accuracy": 0.375, "eval_reward_margin": 0.0232}) \
        == "eval step 6  loss 0.6826  reward accuracy 37.5%  margin 0.0232"


def test_reward_accuracy_when_pairs_tie():
    """All tied (DPO before its first update) is no preference, not 0%; some ties are said beside it."""
    tied = {"step": 0, "eval_loss": 0.6931, "eval_reward_accuracy": 0.0, "eval_reward_ties": 1.0,
            "eval_reward_margin": 0.0}
    assert eval_line(tied) == "eval step 0  loss 0.6931  reward accuracy — (all tied)  margin 0"
    assert "reward accuracy 37.5% (25.0% tied)" in eval_line({**tied, "eval_reward_accuracy": 0.375,
                                                              "eval_reward_ties": 0.25})
    rec = {**RECORD, "reward_accuracy": 0.0, "reward_ties": 1.0, "reward_margin": 0.0}
    assert "acc — (all tied)" in train_line(rec, 400, width=120) and "acc 0%" not in train_line(rec, 400, width=120)
    assert len(train_line(rec, 400)) <= 80


def test_the_example_lines_in_docs_logging_are_what_the_code_prints():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "logging.md").read_text()
    pattern = (r"^    (step (\d+)/(\d+) +loss ([\d.]+) +lr ([\d.e-]+) +gn ([\d.]+) +([\d.]+)(k?) tok/s +"
               r"mem (\d+)MiB +layers ([\d,]+))$")
    lines = re.findall(pattern, text, re.MULTILINE)
    assert len(lines) >= 2, "docs/logging.md has no progress-line example"
    for line, step, total, loss, lr, gn, rate, k, mem, layers in lines:
        rec = {"step": int(step), "loss": float(loss), "lr": float(lr), "grad_norm": float(gn),
               "tokens_per_s": float(rate) * (1000 if k else 1), "peak_memory_bytes": int(mem) * 2**20,
               "active_layers": [int(x) for x in layers.split(",")]}
        assert train_line(rec, int(total)) == line
    evals = re.findall(r"^    (eval step .*)$", text, re.MULTILINE)
    assert evals and all(eval_line({"step": int(e.split()[2]), "eval_loss": float(e.split()[4]),
                                    "eval_token_accuracy": float(e.split()[-1].rstrip("%")) / 100}) == e
                         for e in evals)


def test_a_grpo_run_shows_its_reward_and_spread_within_80_columns():
    rec = {**RECORD, "loss": 0.0, "reward": 0.4375, "reward_std": 0.31, "generation_share": 0.623}
    assert "lr 1.0e-05  reward 0.438  ±0.31  gen 62%  gn 0.5" in train_line(rec, 400, width=120)
    assert all(len(train_line(rec, total)) <= 80 for total in (400, 100000))
    assert eval_line({"step": 6, "eval_reward": 0.5, "eval_reward_std": 0.25}) == "eval step 6  reward 0.5  ±0.25"
