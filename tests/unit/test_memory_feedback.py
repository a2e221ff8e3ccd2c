"""The estimator's KTO terms: a row is one sequence with gradients (SFT's), the reference pass
scores twice a micro-batch's sequences (each row's answer and its KL sequence), and each step's
forward over the KL sequences is a moment of its own (no gradient, no saved activation)."""

import pytest
from test_memory_preference import _8b
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.memory.estimate import compute
from lisaft.memory.preference import preference_lines, preference_summary

KTO = {"data.format": "feedback", "preference": {"loss": "kto"}}


@pytest.mark.parametrize("rows", [1, 2])
def test_a_row_is_one_sequence_and_the_reference_pass_twice_a_micro_batch(rows):
    kto = compute(_8b({**KTO, "training.batch_size": rows}))
    sft = compute(_8b({"training.batch_size": rows}))
    dpo = compute(_8b({"data.format": "preference", "preference": {"loss": "dpo"}, "training.batch_size": rows}))
    assert kto.settings.sequences == rows
    for key in ("activations", "logits_loss", "gradients", "optimizer_states", "weights"):
        assert kto.sizes[key] == sft.sizes[key], key
    assert {k: v for k, v in kto.phases.items() if k not in ("reference_pass", "kl_pass")} == sft.phases
    # The pass scores answers and KL sequences together: the rows of DPO's pass over as many pairs.
    assert kto.phase_components["reference_pass"] == dpo.phase_components["reference_pass"]


def test_the_kl_pass_holds_the_optimizer_state_but_no_gradient_or_activation():
    est = compute(_8b(KTO))
    kl = est.phase_components["kl_pass"]
    assert kl["gradients"] == kl["activations"] == 0 and kl["optimizer_states"] == est.sizes["optimizer_states"]
    assert est.phases["kl_pass"] < est.phases["loss_backward"]
    summary = preference_summary(est)
    assert summary["kl_pass_bytes"] == est.phases["kl_pass"] and summary["reference_cache_bytes_per_pair"] > 0
    text = " ".join(preference_lines(est))
    assert "Unpaired feedback (preference.loss kto)" in text
    assert "KTO's reference log-probs of every row and its KL sequence" in text
    assert preference_summary(compute(_8b({"data.format": "preference", "preference": {"loss": "dpo"}})))[
        "kl_pass_bytes"] is None


def test_estimate_memory_says_the_kto_terms(tmp_path):
    out = CliRunner().invoke(app, ["estimate-memory", "--model", "llama-3.1-8b", "--set", "data.format=feedback",
                                   "--set", "preference.loss=kto", "--set", "model.gradient_checkpointing=true"])
    assert out.exit_code == 0, out.output
    assert "kl_pass" in out.output and "Unpaired feedback" in out.output
