"""`lisaft estimate-memory` end to end, and the accuracy benchmark's quick mode."""

import json
import math
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
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory_accuracy", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quick"] and len(result["results"]) == 1
    figures = result["results"][0]["figures"]
    for key in ("weights", "gradients", "optimizer_states", "activations"):
        assert figures[key]["met"], (key, figures[key])
    assert figures["peak"]["measured"] > 0


def _one_line_exit_2(result) -> str:
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    return text


def test_budget_needs_a_unit_and_both_units_are_explained():
    text = _one_line_exit_2(_invoke("--model", "llama-3.2-1b", "--budget", "24"))
    assert "24GB" in text and "24GiB" in text and "--gpu" in text
    for budget, explained in (("24GB", "24GB = 24.00 GB = 22.35 GiB"), ("24GiB", "24GiB = 25.77 GB = 24.00 GiB")):
        result = _invoke("--model", "llama-3.2-1b", "--budget", budget)
        assert result.exit_code == 0 and explained in " ".join(result.stdout.split()), result.stdout


def test_gpu_picks_a_catalogued_budget_with_its_source():
    out = json.loads(_invoke("--model", "llama-3.2-1b", "--gpu", "rtx-4090", "--json").stdout)
    assert out["budget_bytes"] == (24564 - 616) * 2**20 and out["budget"]["given"] == "--gpu rtx-4090"
    assert "nvidia-smi" in out["budget"]["source"]
    assert "a100-80gb" in _one_line_exit_2(_invoke("--model", "llama-3.2-1b", "--gpu", "rtx-9090"))
    assert "give one" in _one_line_exit_2(_invoke("--model", "llama-3.2-1b", "--gpu", "l4", "--budget", "24GB"))


def test_json_uses_null_stable_keys_and_set_overrides(tmp_path):
    out = json.loads(_invoke("--model", "llama-3.1-70b", "--budget", "24GB", "--json").stdout)
    assert out["largest_seq_len"] is None and out["largest_batch_size"] is None
    assert out["weights_fit"] is False and out["smallest_gpu"] is None
    # Only sharding helps: the weights, read shard by shard, over enough 24 GB cards.
    assert [a["ranks"] for a in out["advice"]] == [out["fewest_ranks"]] and out["fewest_ranks"] > 8
    assert out["smallest_budget_bytes"] > out["sizes"]["weights"]
    assert set(out["optimizers"]["adamw_32bit"]) == {"full", "lisa_2"}

    out = json.loads(_invoke("--model", "llama-3.1-8b", "--lisa-layers", "2", "--budget", "24GiB",
                             "--seq-len", "8192", "--json").stdout)
    assert out["advice"] and all(isinstance(a["set"], dict) for a in out["advice"])
    # Every piece of advice is a --set that a recipe accepts.
    recipe = REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"
    from lisaft.config.schema import load_recipe

    for a in out["advice"]:
        load_recipe(recipe, [f"{k}={json.dumps(v)}" for k, v in a["set"].items()], resolve_paths=False)


def test_weights_that_do_not_fit_are_said_so_with_the_smallest_gpu():
    text = " ".join(_invoke("--model", "llama-3.1-8b", "--budget", "12GB").stdout.split())
    assert "Even the weights (14.96 GiB) do not fit in 11.18 GiB" in text
    assert "the smallest GPU that could: --gpu" in text


def test_largest_sequence_stops_at_the_context_length():
    out = json.loads(_invoke("--model", "phi-3-mini", "--lisa-layers", "1", "--gradient-checkpointing",
                             "--gpu", "h100-80gb", "--json").stdout)
    assert out["context_length"] == 4096 and out["largest_seq_len"] == 4096


def test_recipe_device_and_set_are_honoured(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=4, vocab_size=500, max_position_embeddings=256).save_pretrained(tmp_path / "model")
    recipe = {"model": {"config": "model", "tokenizer": "model", "dtype": "float32"},
              "data": {"train": "train.jsonl", "max_seq_len": 64},
              "training": {"max_steps": 1, "output_dir": "run", "device": "cpu"}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = json.loads(_invoke(str(path), "--set", "data.max_seq_len=128", "--budget", "8GiB", "--json").stdout)
    assert out["settings"]["device"] == "cpu" and out["settings"]["seq_len"] == 128
    assert out["largest_seq_len"] == 256
    assert "training.batch_sise" in _one_line_exit_2(_invoke(str(path), "--set", "training.batch_sise=2"))


def test_model_flags_and_set_combine_as_recipe_keys():
    """--model is a recipe of defaults: --set reaches every key (LoRA, DoRA, QLoRA, no clipping), and a
    flag is the key it names, applied after --set."""
    out = json.loads(_invoke("--model", "llama-3.1-8b", "--set", "lora.enabled=true", "--set", "model.quantize=nf4",
                             "--set", "lora.dora=true", "--set", "training.max_grad_norm=null", "--seq-len", "512",
                             "--json").stdout)
    s = out["settings"]
    assert s["lora"]["quantize"] == "nf4" and s["lora"]["dora"] and not s["clipping"] and s["seq_len"] == 512
    assert out["trainable_params"] < out["total_params"] / 100  # only the adapters train
    assert out["sizes"]["weights"] < 8_030_261_248  # a 4-bit base: under a byte a parameter
    flag_wins = json.loads(_invoke("--model", "llama-3.2-1b", "--set", "data.max_seq_len=8", "--seq-len", "64",
                                   "--json").stdout)
    assert flag_wins["settings"]["seq_len"] == 64
    # A recipe refusal, as lisaft train words it, names the flag.
    text = _one_line_exit_2(_invoke("--model", "llama-3.2-1b", "--dtype", "float16"))
    assert text.startswith("error: --dtype float16: model.dtype: float16 weights would need loss scaling")


def test_offline_hub_id_answers_at_once(monkeypatch):
    """Without HF_HUB_OFFLINE, an unreachable hub is found by one short probe, not by retries."""
    import time

    from huggingface_hub import constants

    from lisaft.config.hub import hub_offline

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub_offline.cache_clear()
    try:
        t0 = time.perf_counter()
        text = _one_line_exit_2(_invoke("--model", "no-such-org/no-such-model"))
        assert time.perf_counter() - t0 < 15, "an unreachable hub must be answered in seconds"
        assert "no-such-org/no-such-model" in text
    finally:
        hub_offline.cache_clear()


def _advice(*args) -> dict:
    result = _invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_advice_proposes_the_smallest_combination_that_fits_and_lists_all_of_it():
    """Llama-3.1-8B full fine-tuning in 24 GiB: no single change fits; LISA γ=2 with paged 8-bit
    and checkpointing does (21.45 GiB), without giving up clipping or going down to γ=1; and every
    weight still trains with APOLLO-Mini and the step in backward (its own row)."""
    out = _advice("--model", "llama-3.1-8b")
    every_weight = [a for a in out["advice"] if a["set"].get("optimizer.name") == "apollo_mini"]
    assert len(every_weight) == 1 and every_weight[0]["fits"]
    fitting = [a for a in out["advice"] if a["fits"] and a not in every_weight]
    assert len(fitting) == 1
    assert fitting[0]["set"] == {"model.gradient_checkpointing": True, "optimizer.name": "paged_adamw_8bit",
                                 "lisa.enabled": True, "lisa.active_layers": 2}
    # the row says what it combines, each part named by its own row's words
    assert fitting[0]["why"].startswith("together: ") and fitting[0]["why"].count(";") == 2
    assert "above" not in " ".join(a["why"] for a in out["advice"])


def test_long_context_advice_knows_offloading_before_cutting_the_context():
    recipe = REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"
    out = _advice(str(recipe), "--gpu", "rtx-4090", "--seq-len", "8192", "--set", "model.offload_activations=false")
    keys = [set(a["set"]) for a in out["advice"]]
    first_fit = next(i for i, a in enumerate(out["advice"]) if a["fits"])
    assert "model.offload_activations" in keys[first_fit] and "data.max_seq_len" not in keys[first_fit]
    assert out["smallest_gpu_as_is"] == "a100-40gb"  # the card for the recipe exactly as given


def test_when_nothing_fits_the_leanest_setup_is_the_least_memory_and_several_gpus_are_named():
    out = _advice("--model", "llama-3.1-70b", "--gpu", "h200")
    lean = out["smallest_budget_bytes"]
    one_card = [a for a in out["advice"] if a["ranks"] is None]
    assert lean is not None and all(lean <= a["total_bytes"] for a in one_card)
    assert out["smallest_gpu"] is None and out["smallest_gpu_as_is"] is None
    # ... and the last row shards it: the fewest ranks that hold it, per rank.
    sharded = out["advice"][-1]
    assert sharded["ranks"] == out["fewest_ranks"] and sharded["fits"] and sharded["set"]["training.fsdp"] is True
    text = " ".join(_invoke("--model", "llama-3.1-70b", "--gpu", "h200").stdout.split())
    assert "No change lisaft offers fits it" in text and "several GPUs" in text and "FSDP" in text
    assert f"torchrun --nproc-per-node {sharded['ranks']}" in text


def test_explain_without_a_paged_optimizer_says_nothing_is_paged():
    text = " ".join(_invoke("--model", "llama-3.2-1b", "--explain").stdout.split())
    assert "Nothing is paged with adamw_32bit" in text
    text = " ".join(_invoke("--model", "llama-3.2-1b", "--device", "cpu", "--explain").stdout.split())
    assert "Nothing is paged on CPU" in text


def test_settings_that_are_already_the_leanest_still_get_an_answer():
    """Every change lisaft has is made already, and it still does not fit: say so, no empty list."""
    recipe = REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"
    # On CPU neither offloading applies: nothing is left to change.
    result = _invoke(str(recipe), "--device", "cpu", "--budget", "16GiB", "--lisa-layers", "1", "--in-backward",
                     "--seq-len", "512", "--set", "training.grad_accum_steps=1")
    assert result.exit_code == 0, result.output
    assert "These settings are the leanest lisaft has: needs" in " ".join(result.stdout.split())


def test_per_rank_slices_match_a_two_rank_fsdp_run(tiny_run):
    """What rank 0 of a 2-process gloo FSDP run holds: its weight slices (the rows the checkpoint's
    torch.distributed.checkpoint metadata gives rank 0, which starts every tensor), gradient slices
    and moments (metrics.jsonl)."""
    import torch.distributed.checkpoint as dcp
    from test_distributed import torchrun

    from lisaft.memory.command import EstimateFlags, build_settings
    from lisaft.memory.counts import param_counts
    from lisaft.memory.estimate import compute
    from lisaft.metrics.log import read_metrics

    path = tiny_run("fsdp.yaml", lisa={"enabled": False}, training={
        "fsdp": True, "batch_size": 2, "max_steps": 2, "save_every": 2, "eval_every": 0, "output_dir": "fsdp"})
    # An odd vocabulary: embedding and head rows do not split evenly, and rank 0 holds the larger half.
    config = tiny_run.dir / "model" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": 111}))
    result = torchrun("train", str(path), cwd=tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    meta = dcp.FileSystemReader(tiny_run.dir / "fsdp" / "checkpoints" / "step-000002" / "shards").read_metadata()
    first = {name: next(c.sizes for c in m.chunks if not any(c.offsets))
             for name, m in meta.state_dict_metadata.items() if hasattr(m, "chunks")}
    assert first["model.embed_tokens.weight"][0] == 56  # ceil(111 / 2) rows
    record = [r for r in read_metrics(tiny_run.dir / "fsdp" / "metrics.jsonl") if "loss" in r][-1]
    est = compute(build_settings(EstimateFlags(recipe=path, device="cpu", ranks=2), 2**34))
    assert est.settings.fsdp and est.settings.ranks == 2
    counts = param_counts(est.settings.config)
    buffers = counts.buffer_bytes_fp32  # rotary inv_freq: float32, not in the state dict
    assert est.weights_bytes - buffers == sum(4 * math.prod(size) for size in first.values())
    assert est.grad_bytes == record["grad_bytes"]
    assert est.optimizer_state_bytes == record["optimizer_state_bytes"]
    # The end-of-run table measures rank 0's slices too (not the whole DTensors' sizes): only the
    # rotary buffers, which the estimate counts and the parameters do not, separate the two.
    row = next(line for line in result.stdout.splitlines() if line.strip("│ ").startswith("weights"))
    error = float(row.split("│")[-2].strip().rstrip("%"))
    assert abs(error) < 1.0, row


def test_the_fsdp_table_in_the_docs_is_what_the_estimator_says_now(tmp_path):
    """docs/distributed.md quotes benchmarks/fsdp_fit.py: rerun it and compare."""
    from benchmarks import fsdp_fit

    sys.argv, argv = ["fsdp_fit.py", "--out", str(tmp_path)], sys.argv
    try:
        fsdp_fit.main()
    finally:
        sys.argv = argv
    table = (tmp_path / "fsdp_fit.md").read_text()
    assert table in (REPO / "docs" / "distributed.md").read_text()
    rows = json.loads((tmp_path / "fsdp_fit.json").read_text())["rows"]
    committed = json.loads((REPO / "benchmarks" / "results" / "fsdp_fit" / "fsdp_fit.json").read_text())["rows"]
    assert [r["total_bytes"] for r in rows] == [r["total_bytes"] for r in committed]
