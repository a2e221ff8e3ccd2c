"""The quickstart recipe as shipped, at reduced steps: from any working directory, it learns."""

import json
from pathlib import Path

from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.metrics.log import read_metrics

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def test_quickstart_learns_at_reduced_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in the recipe resolve against its own folder
    result = CliRunner().invoke(app, [
        "train", str(QUICKSTART), "--set", "training.max_steps=120", "--set", "training.eval_every=60",
        "--set", f"training.output_dir={tmp_path / 'qs'}", "--set", "training.save_every=0",
    ])
    assert result.exit_code == 0, result.output
    records = read_metrics(tmp_path / "qs" / "metrics.jsonl")
    acc = [r["eval_token_accuracy"] for r in records if "eval_token_accuracy" in r]
    assert len(acc) == 3
    # Chance is about 1 in 100 (the tokenizer has 110 tokens); the full 800 steps reach ~99%.
    assert acc[0] < 0.1 and acc[1] > 0.2 and acc[2] > 0.4, acc
    layers = {tuple(r["active_layers"]) for r in records if "active_layers" in r}
    assert len(layers) > 1, "LISA must switch layers during the run"

    # The trained model, prompted as it was trained, answers in the task's own terms: letters of
    # the input's alphabet, upper case exactly when asked. At 120 steps a few answers are exact
    # (the committed 800-step run got 19 of the first 20 exact, docs/results.md).
    result = CliRunner().invoke(app, [
        "generate", str(tmp_path / "qs"), "--input-file", str(QUICKSTART.parent / "quickstart" / "eval.jsonl"),
        "--limit", "20", "--json", "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.output.splitlines()]
    assert len(answers) == 20
    for a in answers:
        upper = a["prompt"]["instruction"] == "Uppercase"
        assert a["output"] and set(a["output"].lower()) <= set("abcdefghij"), a
        assert a["output"].isupper() == upper, a
    assert sum(a["exact"] for a in answers) >= 1
