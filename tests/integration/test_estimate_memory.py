"""`lisaft estimate-memory` end to end, and the accuracy benchmark's quick mode."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lisaft.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _invoke(*args):
    return runner.invoke(app, ["estimate-memory", *args])


def test_json_output_parses_and_adds_up():
    result = _invoke("--model", "llama-3.2-1b", "--lisa-layers", "2", "--optimizer", "paged_adamw_8bit",
                     "--seq-len", "1024", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("total_bytes", "budget_bytes", "fits", "components", "paged_host_bytes",
                "largest_seq_len", "largest_batch_size", "optimizers", "advice"):
        assert key in out
    assert sum(out["components"].values()) == out["total_bytes"]
    assert out["budget_bytes"] == 24 * 2**30
    assert set(out["components"]) >= {"weights", "gradients", "optimizer_states", "activations",
                                      "logits_loss", "transient", "allocator_overhead", "cuda_context"}
    assert set(out["optimizers"]) == {"adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit"}
    assert out["settings"]["active_layers"] == 2


def test_rich_output_has_verdict_advice_and_side_by_side():
    result = _invoke("--model", "llama-3.1-8b", "--no-lisa", "--budget", "24GiB")
    assert result.exit_code == 0, result.output
    assert "Does not fit" in result.stdout
    assert "What brings it under" in result.stdout
    assert "Optimizers side by side" in result.stdout and "paged_adamw_8bit" in result.stdout


@pytest.mark.parametrize("name", ["./no-such-model-folder", "llama-9b"])
def test_bad_model_name_is_one_line_exit_2(name):
    result = _invoke("--model", name)  # hub lookups are offline in the tests (conftest)
    assert result.exit_code == 2
    text = result.output.strip()
    assert "Traceback" not in text and name.lstrip("./") in text
    assert len(text.splitlines()) == 1


def test_bad_flag_values_exit_2():
    assert _invoke("--model", "llama-3.2-1b", "--optimizer", "sgd").exit_code == 2
    assert _invoke("--model", "llama-3.2-1b", "--budget", "lots").exit_code == 2
    assert _invoke("--model", "llama-3.2-1b", "--lisa-layers", "99").exit_code == 2
    assert _invoke().exit_code == 2


def test_recipe_with_local_config_and_flag_overrides(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=4, vocab_size=500).save_pretrained(tmp_path / "model")
    recipe = {
        "model": {"config": "model", "tokenizer": "model", "dtype": "float32"},
        "data": {"train": "train.jsonl", "max_seq_len": 64},
        "training": {"max_steps": 1, "output_dir": "run", "batch_size": 2},
        "lisa": {"enabled": True, "active_layers": 1},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = _invoke(str(path), "--device", "cpu", "--seq-len", "128", "--budget", "1GiB", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["settings"]["seq_len"] == 128 and out["settings"]["batch_size"] == 2
    assert out["settings"]["active_layers"] == 1 and out["settings"]["device"] == "cpu"
    assert "process_baseline" in out["components"] and out["paged_host_bytes"] == 0


def test_benchmark_quick_mode(tmp_path):
    out = tmp_path / "accuracy.json"
    proc = subprocess.run([sys.executable, "benchmarks/memory_accuracy.py", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quick"] and len(result["results"]) == 1
    figures = result["results"][0]["figures"]
    for key in ("weights", "gradients", "optimizer_states", "activations"):
        assert figures[key]["met"], (key, figures[key])
    assert figures["peak"]["measured"] > 0
