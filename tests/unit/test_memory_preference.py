"""The estimator's preference terms: a pair is two sequences in one forward, DPO's reference pass
is a moment of the estimate (no gradients, no optimizer state), the log-probs are chunked, and the
shipped DPO recipes fit 24 GiB as their headers say."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.config.schema import load_recipe
from lisaft.memory.catalogue import resolve_model
from lisaft.memory.command import settings_from_recipe
from lisaft.memory.estimate import GiB, compute
from lisaft.memory.preference import CACHE_BYTES_PER_PAIR, preference_summary
from lisaft.memory.settings import settings_for_config

REPO = Path(__file__).resolve().parents[2]
DPO = REPO / "recipes" / "llama3.1-8b-dpo-24gb.yaml"
LORA_DPO = REPO / "recipes" / "llama3.1-8b-lora-dpo-24gb.yaml"
PAIRS = {"data.format": "preference", "preference": {"loss": "dpo"}}


def _8b(keys: dict | None = None):
    base = {"model.gradient_checkpointing": True, "model.attention": "sdpa", "data.max_seq_len": 1024,
            "optimizer.name": "adamw_8bit"}
    return settings_for_config(resolve_model("llama-3.1-8b")[0], {**base, **(keys or {})}, "llama-3.1-8b")


@pytest.mark.parametrize("pairs", [1, 2])
def test_a_pair_is_two_sequences_in_one_forward(pairs):
    """B pairs hold what 2B unpacked sequences of SFT hold: activations, the loss's buffers and the
    transients are the same; only the reference pass is added."""
    dpo = compute(_8b({**PAIRS, "training.batch_size": pairs}))
    sft = compute(_8b({"training.batch_size": 2 * pairs}))
    assert dpo.settings.sequences == 2 * pairs
    for key in ("activations", "logits_loss", "transient", "gradients", "optimizer_states", "weights"):
        assert dpo.sizes[key] == sft.sizes[key], key
    assert dpo.saved_activation_bytes == sft.saved_activation_bytes
    assert set(dpo.phases) == set(sft.phases) | {"reference_pass"}
    assert {k: v for k, v in dpo.phases.items() if k != "reference_pass"} == sft.phases


def test_the_reference_pass_holds_no_gradient_and_no_optimizer_state():
    est = compute(_8b(PAIRS))
    ref = est.phase_components["reference_pass"]
    assert ref["gradients"] == ref["optimizer_states"] == ref["activations"] == 0
    assert ref["weights"] == est.sizes["weights"] and ref["logits_loss"] == est.sizes["logits_loss"]
    assert est.total_bytes == max(est.phases.values())  # it counts in the peak like every moment
    assert est.phases["reference_pass"] < est.total_bytes  # ... and is not this run's
    # SimPO and ORPO have no reference: no pass, nothing cached.
    for loss in ("simpo", "orpo"):
        other = compute(_8b({**PAIRS, "preference": {"loss": loss}}))
        assert "reference_pass" not in other.phases
        summary = preference_summary(other)
        assert summary["reference_pass_bytes"] is None and summary["reference_cache_bytes_per_pair"] == 0


def test_log_probs_are_chunked_over_the_vocabulary():
    summary = preference_summary(compute(_8b(PAIRS)))
    vocab = 128_256
    assert summary["sequences_per_micro_batch"] == 2 and summary["loss_chunk_positions"] == (1 << 24) // vocab
    assert summary["unchunked_logits_bytes"] == 2 * 1024 * vocab * 4  # what chunking never holds
    assert compute(_8b(PAIRS)).sizes["logits_loss"] < summary["unchunked_logits_bytes"] / 10
    assert CACHE_BYTES_PER_PAIR == summary["reference_cache_bytes_per_pair"] < 200


@pytest.mark.parametrize("path,host", [(DPO, True), (LORA_DPO, False)])
def test_the_dpo_recipes_fit_24_gib_as_their_headers_say(path, host):
    recipe = load_recipe(path)
    assert recipe.preference is not None and recipe.preference.loss == "dpo"
    est = compute(settings_from_recipe(recipe).with_(host_budget_bytes=64 * GiB))
    assert est.fits and est.total_bytes <= 21.5 * GiB
    header = path.read_text().split("\nmodel:")[0]
    assert f"GPU {est.total_bytes / GiB:.2f} GiB of 24.00 GiB" in header
    assert f"the reference pass {est.phases['reference_pass'] / GiB:.2f} GiB" in header.replace(":", "")
    seq = recipe.data.max_seq_len
    assert re.search(rf"cut at\s+#?\s*{seq:,} tokens \(data.max_seq_len\)", header), header
    if host:  # the full-parameter recipe keeps its moments in host memory
        assert recipe.optimizer.cpu_offload and recipe.lisa.enabled is False and recipe.lora.enabled is False
        assert f"host {est.host_bytes / GiB:.2f} GiB of RAM" in header
    else:
        assert recipe.lora.enabled and f"{est.host_bytes / GiB:.2f} GiB of pinned host memory" in header


def test_estimate_memory_shows_and_explains_the_three_terms():
    runner = CliRunner()
    result = runner.invoke(app, ["estimate-memory", str(DPO), "--host-ram", "64GiB", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert "reference_pass" in out["phases"] and "reference_pass" in out["phase_components"]
    assert out["settings"]["preference"] == "dpo" and out["settings"]["sequences"] == 2
    assert out["preference"]["reference_pass_bytes"] == out["phases"]["reference_pass"]
    text = " ".join(runner.invoke(app, ["estimate-memory", str(DPO), "--host-ram", "64GiB"]).stdout.split())
    assert "a micro-batch of 1 pair is 2 sequences" in text and "[2·B·T·V] float32 logits never exist" in text
    assert "Reference pass (DPO's reference log-probs of every pair, once, before step 1)" in text
    assert "Reference cache: two float64 sums a pair" in text
