"""KTO (Ethayarajh et al. 2024) held to its formula written out directly, on a tiny model: each
row's loss from the unpadded sequence's own logits, the KL estimate from the mismatched
sequences (detached, clamped at 0), the desirable and undesirable weights; the loss and the
gradient it gives every weight, in float32 and bfloat16, through the plain and the chunked head.
And the KL sequences: a row's prompt with the previous row's completion."""

import pytest
import torch
from _tiny import tiny
from test_preference_loss import _direct_logp, _grads

import lisaft.model.loss as loss_mod
from lisaft.config.schema import PreferenceSection
from lisaft.data.collate import IGNORE_INDEX, collate
from lisaft.model.feedback import SUMS, kl_estimate, kto_losses
from lisaft.model.preference import sequence_logps
from lisaft.train.objectives.feedback import attach_kl


def _rows(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        prompt = [1] + torch.randint(3, 128, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        answer = torch.randint(3, 128, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() + [2]
        rows.append({"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + answer,
                     "desirable": i % 3 != 1})
    attach_kl(rows, max_seq_len=64)
    for r in rows:
        r["ref"] = [-float(torch.rand(1, generator=g)) * 30, -float(torch.rand(1, generator=g)) * 30]
    return rows


def _direct_kto(model, rows, s):
    """The mean over rows of the paper's loss, z from the KL sequences' own logits."""
    with torch.no_grad():
        z = max(sum(_direct_logp(model, r["kl"])[0] - r["ref"][1] for r in rows) / len(rows), 0.0)
    total = 0.0
    for r in rows:
        ratio = _direct_logp(model, r)[0] - r["ref"][0]
        if r["desirable"]:
            total = total + s.desirable_weight * (1 - torch.sigmoid(s.beta * (ratio - z)))
        else:
            total = total + s.undesirable_weight * (1 - torch.sigmoid(s.beta * (z - ratio)))
    return total / len(rows), float(z)


def _mine(model, rows, s):
    with torch.no_grad():
        kl_logps = sequence_logps(model, collate([r["kl"] for r in rows], 0))[0].double()
    z = kl_estimate(torch.stack([(kl_logps - torch.tensor([r["ref"][1] for r in rows])).sum(),
                                 torch.tensor(float(len(rows)), dtype=torch.float64)]))
    logps = sequence_logps(model, collate(rows, 0))[0]
    ref = torch.tensor([r["ref"][0] for r in rows], dtype=logps.dtype)
    losses, sums = kto_losses(s, logps, ref, z.to(logps.dtype), torch.tensor([r["desirable"] for r in rows]))
    return losses.sum() / len(rows), z.item(), sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [False, True])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.5)])
def test_kto_is_its_formula(monkeypatch, dtype, chunk, weights):
    if chunk:  # 3 positions a chunk: the chunked head's per-token path
        monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 128 * 3)
    model = tiny().to(dtype)
    rows = _rows()
    # A reference far below the policy on the KL sequences: z is positive, so it shifts every loss.
    for r in rows:
        r["ref"][1] -= 40
    s = PreferenceSection(loss="kto", beta=0.1, desirable_weight=weights[0], undesirable_weight=weights[1])
    mine, z, sums = _mine(model, rows, s)
    direct, direct_z = _direct_kto(model, rows, s)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert z > 0 and z == pytest.approx(direct_z, rel=tol)
    assert mine.item() == pytest.approx(direct.item(), rel=tol, abs=tol)
    got, want = _grads(model, mine), _grads(model, direct)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=tol, atol=tol * want[name].abs().max().item()), name
    named = dict(zip(SUMS, sums.tolist()))
    assert named["desirable"] == sum(r["desirable"] for r in rows) and named["undesirable"] == 1


def test_the_kl_estimate_is_clamped_at_zero_and_carries_no_gradient():
    model = tiny()
    rows = _rows()
    for r in rows:
        r["ref"][1] += 1000  # the reference far above the policy: the mean log-ratio is negative
    s = PreferenceSection(loss="kto")
    mine, z, _ = _mine(model, rows, s)
    assert z == 0.0
    # With z = 0 and the reference at the policy, every row's loss is 1 − σ(0) = 1/2.
    with torch.no_grad():
        own = sequence_logps(model, collate(rows, 0))[0]
    for r, logp in zip(rows, own.tolist()):
        r["ref"][0] = logp
    assert _mine(model, rows, s)[0].item() == pytest.approx(0.5, abs=1e-6)


def test_a_rows_kl_sequence_is_its_prompt_with_the_previous_rows_completion():
    rows = [{"input_ids": [1, 5, 6, 7, 2], "labels": [IGNORE_INDEX] * 3 + [7, 2]},
            {"input_ids": [1, 8, 9, 2], "labels": [IGNORE_INDEX] * 2 + [9, 2]},
            {"input_ids": [1, 4, 3, 3, 3, 2], "labels": [IGNORE_INDEX] * 2 + [3, 3, 3, 2]}]
    attach_kl(rows, max_seq_len=5)
    assert rows[0]["kl"] == {"input_ids": [1, 5, 6, 3, 3], "labels": [IGNORE_INDEX] * 3 + [3, 3]}  # cut at 5
    assert rows[1]["kl"] == {"input_ids": [1, 8, 7, 2], "labels": [IGNORE_INDEX] * 2 + [7, 2]}
    assert rows[2]["kl"] == {"input_ids": [1, 4, 9, 2], "labels": [IGNORE_INDEX] * 2 + [9, 2]}
