"""lisaft's DPO, SimPO and ORPO held to the papers' formulas written out directly, on a tiny
model: the losses and the gradients they give every weight, in float32 and bfloat16, through the
plain and the chunked head."""

import math

import pytest
import torch
from _tiny import tiny
from test_loss import _batch, _model  # a 512-token vocabulary, long enough to chunk

import lisaft.model.loss as loss_mod
from lisaft.config.schema import PreferenceSection
from lisaft.data.collate import IGNORE_INDEX
from lisaft.model.preference import METRICS, PairObjective, collate_pairs


def _pairs(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = [1] + torch.randint(3, 128, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        pair = {}
        for k in ("chosen", "rejected"):
            answer = torch.randint(3, 128, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() + [2]
            pair[k] = {"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + answer}
        pair["ref"] = [-float(torch.rand(1, generator=g)) * 30, -float(torch.rand(1, generator=g)) * 30]
        out.append(pair)
    return out


def _direct_logp(model, seq):
    """The answer's summed log-prob from the model's own logits of the unpadded sequence alone."""
    ids = torch.tensor([seq["input_ids"]])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    total, count = 0.0, 0
    for pos in range(1, len(seq["labels"])):
        if seq["labels"][pos] != IGNORE_INDEX:
            total = total + logp[pos - 1, seq["labels"][pos]]
            count += 1
    return total, count


def _direct_loss(model, pairs, loss, beta, gamma):
    """The mean over pairs of each paper's loss, from _direct_logp."""
    total = 0.0
    for p in pairs:
        (lc, nc), (lr, nr) = _direct_logp(model, p["chosen"]), _direct_logp(model, p["rejected"])
        if loss == "dpo":
            x = beta * ((lc - p["ref"][0]) - (lr - p["ref"][1]))
            total = total - torch.log(torch.sigmoid(x))
        elif loss == "simpo":
            total = total - torch.log(torch.sigmoid(beta * (lc / nc - lr / nr) - gamma))
        else:
            pc, pr = torch.exp(lc / nc), torch.exp(lr / nr)
            log_odds_ratio = torch.log(pc / (1 - pc)) - torch.log(pr / (1 - pr))
            total = total - lc / nc - beta * torch.log(torch.sigmoid(log_odds_ratio))
    return total / len(pairs)


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [False, True])
@pytest.mark.parametrize("loss, beta, gamma", [("dpo", 0.1, 0.0), ("simpo", 2.0, 0.5), ("orpo", 0.1, 0.0)])
def test_losses_and_gradients_are_the_papers_formulas(monkeypatch, loss, beta, gamma, dtype, chunk):
    if chunk:  # 3 positions a chunk: the chunked head's per-token path
        monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 128 * 3)
    model = tiny().to(dtype)
    pairs = _pairs()
    section = PreferenceSection(loss=loss, beta=beta, gamma=gamma)
    objective = PairObjective(section)
    mine = objective.loss_sum(model, collate_pairs(pairs, pad_id=0)) / len(pairs)
    got = _grads(model, mine)
    direct = _direct_loss(model, pairs, loss, beta, gamma)
    want = _grads(model, direct)
    # bf16: the padded batch and the lone sequence are different bf16 forwards; float32: rounding.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert mine.item() == pytest.approx(direct.item(), rel=tol, abs=tol)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=tol, atol=tol * want[name].abs().max().item()), name
    sums = objective.take_sums("cpu")
    assert sums.shape == (len(METRICS),) and torch.isfinite(sums).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_formulas_alone_match_to_float32_rounding(dtype):
    """Same logits on both sides (the model's batched forward), so only the objective differs."""
    from lisaft.model.preference import pair_losses, sequence_logps

    model = tiny().to(dtype)
    pairs = _pairs(4, seed=1)
    batch = collate_pairs(pairs, pad_id=0)
    logps, counts = sequence_logps(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["labels"][:, 1:].clamp(min=0)[..., None])[..., 0]
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    direct = (logp * mask).sum(1)
    assert torch.allclose(logps, direct, rtol=1e-6, atol=1e-5) and (counts == mask.sum(1)).all()
    for loss in ("dpo", "simpo", "orpo"):
        section = PreferenceSection(loss=loss)
        got = pair_losses(section, logps.view(2, -1), counts.view(2, -1), batch["ref"].t())[0]
        want = _direct_loss_from(direct.view(2, -1).double(), counts.view(2, -1).double(),
                                 batch["ref"].t().double(), section)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6), loss


def _direct_loss_from(lp, n, ref, s):
    if s.loss == "dpo":
        return -torch.log(torch.sigmoid(s.beta * ((lp[0] - ref[0]) - (lp[1] - ref[1]))))
    if s.loss == "simpo":
        return -torch.log(torch.sigmoid(s.beta * (lp[0] / n[0] - lp[1] / n[1]) - s.gamma))
    p = torch.exp(lp / n)
    log_odds = torch.log(p / (1 - p))
    return -lp[0] / n[0] - s.beta * torch.log(torch.sigmoid(log_odds[0] - log_odds[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dpo_starts_at_ln2_when_the_reference_is_the_policy(dtype):
    from lisaft.model.preference import sequence_logps

    model = tiny().to(dtype)
    pairs = _pairs()
    batch = collate_pairs(pairs, pad_id=0)
    with torch.no_grad():
        ref = sequence_logps(model, batch)[0].view(2, -1).t()
    batch["ref"] = ref
    objective = PairObjective(PreferenceSection(loss="dpo"))
    assert objective.loss_sum(model, batch).item() / len(pairs) == pytest.approx(math.log(2), abs=1e-6)
    sums = objective.take_sums("cpu")
    assert sums[METRICS.index("reward_margin")].item() == pytest.approx(0.0, abs=1e-6)
    # Every pair ties: counted apart, and as wrong by the accuracy (TRL's rewards/accuracies: chosen > rejected).
    assert (sums[METRICS.index("reward_ties")].item(), sums[METRICS.index("reward_accuracy")].item()) == (len(pairs), 0)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_per_token_loss_chunked_equals_plain_with_a_gradient_per_position(kind, monkeypatch):
    """Each position gets its own output gradient (a sequence's pair weight), as DPO's backward gives."""
    model, batch = _model(kind), _batch()
    weights = torch.randn(2, 23, generator=torch.Generator().manual_seed(2))
    out = {}
    for name, elements in (("plain", 1 << 40), ("chunked", 512 * 5)):
        monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", elements)
        model.zero_grad(set_to_none=True)
        nll = loss_mod.token_nll(model, batch)
        (nll * weights).sum().backward()
        out[name] = nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert torch.allclose(out["chunked"][0], out["plain"][0], rtol=1e-5, atol=1e-6)
    assert (out["plain"][0][batch["labels"][:, 1:] == IGNORE_INDEX] == 0).all()
    for n, g in out["plain"][1].items():
        assert torch.allclose(out["chunked"][1][n], g, rtol=1e-4, atol=1e-6), n


def test_chunked_pair_log_probs_keep_no_float32_logits_of_every_position(monkeypatch):
    from lisaft.metrics.measure import saved_activations
    from lisaft.model.preference import sequence_logps

    model, batch = _model("llama"), _batch()
    with saved_activations(model) as plain:
        held = sequence_logps(model, batch)[0]
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)
    with saved_activations(model) as meter:
        held = sequence_logps(model, batch)[0]  # noqa: F841 - held for the meter: it counts live graphs
    assert plain.bytes - meter.bytes >= 0.9 * 4 * batch["input_ids"].numel() * 512
