"""IPO (Azar et al. 2023) held to its formula written out directly: (h − 1/(2β))², h the
difference of the chosen and rejected answers' log-ratios to the reference, each averaged over
its answer's tokens as TRL's DPOTrainer does; the loss and the gradient it gives every weight,
in float32 and bfloat16, through the plain and the chunked head. Added as the table promises:
one row of config/preference_losses.py and its form in model/preference.py."""

import pytest
import torch
from _tiny import tiny
from test_preference_loss import _direct_logp, _grads, _pairs

import lisaft.model.loss as loss_mod
from lisaft.config.preference_losses import preference_loss
from lisaft.config.schema import PreferenceSection, recipe_from_dict
from lisaft.model.preference import METRICS, PairObjective, collate_pairs


def _direct_ipo(model, pairs, beta):
    total = 0.0
    for p in pairs:
        (lc, nc), (lr, nr) = _direct_logp(model, p["chosen"]), _direct_logp(model, p["rejected"])
        h = (lc - p["ref"][0]) / nc - (lr - p["ref"][1]) / nr
        total = total + (h - 1 / (2 * beta)) ** 2
    return total / len(pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [False, True])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_is_its_formula(monkeypatch, dtype, chunk, beta):
    if chunk:
        monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 128 * 3)
    model = tiny().to(dtype)
    pairs = _pairs()
    objective = PairObjective(PreferenceSection(loss="ipo", beta=beta))
    mine = objective.loss_sum(model, collate_pairs(pairs, pad_id=0)) / len(pairs)
    got = _grads(model, mine)
    direct = _direct_ipo(model, pairs, beta)
    want = _grads(model, direct)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert mine.item() == pytest.approx(direct.item(), rel=tol, abs=tol)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=tol, atol=tol * want[name].abs().max().item()), name
    sums = objective.take_sums("cpu")
    # The rewards are β times the per-token log-ratios the loss scores.
    assert sums[METRICS.index("reward_margin")].item() == pytest.approx(
        sums[METRICS.index("reward_chosen")].item() - sums[METRICS.index("reward_rejected")].item(), abs=1e-4)


def test_ipo_starts_at_its_target_margin_squared_when_the_reference_is_the_policy():
    from lisaft.model.preference import sequence_logps

    model, pairs = tiny(), _pairs()
    batch = collate_pairs(pairs, pad_id=0)
    with torch.no_grad():
        batch["ref"] = sequence_logps(model, batch)[0].view(2, -1).t()
    loss = PairObjective(PreferenceSection(loss="ipo", beta=0.1)).loss_sum(model, batch) / len(pairs)
    assert loss.item() == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-5)


def test_ipo_is_one_row_with_a_reference_and_its_default_beta():
    kind = preference_loss("ipo")
    assert kind.reference and kind.per_token and kind.form == "squared" and kind.data_format == "preference"
    r = recipe_from_dict({"model": {"config": "c", "tokenizer": "t"},
                          "data": {"train": "t.jsonl", "format": "preference"},
                          "training": {"max_steps": 1, "output_dir": "r"},
                          "preference": {"loss": "ipo", "reference": "ref"}})
    assert r.preference.beta == 0.1 and r.preference.reference == "ref"
