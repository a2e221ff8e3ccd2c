"""The quickstart recipe as shipped, at reduced steps: from any working directory, it learns."""

from pathlib import Path

from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.metrics import read_metrics

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
    # Chance is about 1 in 100 (the tokenizer has 110 tokens); the full 400 steps reach ~90%.
    assert acc[0] < 0.1 and acc[1] > 0.2 and acc[2] > 0.4, acc
    layers = {tuple(r["active_layers"]) for r in records if "active_layers" in r}
    assert len(layers) > 1, "LISA must switch layers during the run"
