"""The chunked per-position loss (head_nll, token_nll) equals cross entropy over the whole logits,
and with a frozen head (LoRA) its backward recomputes nothing."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lisaft.model import loss as loss_mod
from lisaft.model.loss import head_nll, token_nll

VOCAB, HIDDEN, POSITIONS = 64, 16, 37
CAP = 5.0


def _inputs(dtype, weight_trains: bool):
    g = torch.Generator().manual_seed(3)
    hidden = (torch.randn(POSITIONS, HIDDEN, generator=g) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype).requires_grad_(weight_trains)
    targets = torch.randint(0, VOCAB, (POSITIONS,), generator=g)
    targets[::5] = -100
    # One output gradient per position, of both signs, as a pair's weight or a GRPO advantage gives.
    grad_out = torch.randn(POSITIONS, generator=g)
    return hidden, weight, targets, grad_out


def _reference(hidden, weight, targets, grad_out, softcap):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_(weight.requires_grad)
    logits = h @ w.t()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    rows = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="none")
    (rows * grad_out).sum().backward()
    return rows.detach(), h.grad, w.grad


def _close(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """The largest error within `tol` of the largest entry."""
    return bool((ours.float() - ref.float()).abs().max() <= tol * ref.float().abs().max())


@pytest.mark.parametrize("softcap", [None, CAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("weight_trains", [False, True], ids=["frozen-head", "trained-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_position_loss_and_gradients_equal_cross_entropy_over_full_logits(dtype, weight_trains, softcap,
                                                                               monkeypatch):
    """8 chunks of 5 positions (the last one of 2), every fifth target -100, a random output
    gradient per position: the losses and the hidden states' gradient (formed in the forward with a
    frozen head, recomputed with a trained one) and the trained head's gradient are autograd's."""
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", VOCAB * 5)
    hidden, weight, targets, grad_out = _inputs(dtype, weight_trains)
    rows = head_nll(hidden, targets, weight, softcap)
    (rows * grad_out).sum().backward()
    ref_rows, ref_h, ref_w = _reference(hidden, weight, targets, grad_out, softcap)
    assert rows.dtype == torch.float32 and not rows[::5].any()
    assert hidden.grad.dtype == dtype and not hidden.grad[::5].any()  # ignored rows get no gradient
    if dtype == torch.float32:
        assert torch.allclose(rows, ref_rows, rtol=1e-6, atol=1e-6)
        assert _close(hidden.grad, ref_h, 1e-6)
        assert not weight_trains or _close(weight.grad, ref_w, 1e-6)
        return
    # bfloat16 keeps 8 significant bits (a relative rounding of up to 2^-9 = 0.2%). The logits are
    # the same bf16 matmul's on both sides (a chunk's rows, so possibly another kernel blocking:
    # one ulp apart at most), the losses float32 from there: 1e-2 of the largest covers a few ulps
    # of a logit of magnitude ~4. The gradient's chain rounds to bf16 at the logits' gradient, the
    # matmul's output and (here) the product with the output gradient, where autograd rounds after
    # the output gradient's product: three roundings of up to 2^-9 each and a matmul over 64
    # entries of mixed signs, so 2e-2 of the largest entry (measured: 3.4e-3 at most).
    assert _close(rows, ref_rows, 1e-2)
    assert _close(hidden.grad, ref_h, 2e-2)
    assert not weight_trains or _close(weight.grad, ref_w, 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_nll_with_a_frozen_head_and_a_temperature_equals_the_plain_loss(dtype, monkeypatch):
    """GRPO's log-probs at a sampling temperature (token_nll divides the hidden states by it) with
    the head frozen, as under LoRA: the chunked losses and every trainable parameter's gradient
    under a per-position output gradient are those of cross entropy over the whole logits / T."""
    from tests.unit.test_loss import _batch, _model

    model, batch = _model("llama").to(dtype), _batch()
    model.get_output_embeddings().weight.requires_grad_(False)
    weights = torch.randn(2, 23, generator=torch.Generator().manual_seed(2))
    temperature = 0.7
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1] / temperature
    expected = F.cross_entropy(logits.float().reshape(-1, 512), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=-100, reduction="none").view(2, 23)
    (expected * weights).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)  # 10 chunks of 5 positions
    assert loss_mod.chunked(model, batch["input_ids"].numel())
    nll = token_nll(model, batch, temperature=temperature)
    (nll * weights).sum().backward()
    # As test_loss.py's fused loss: float32 rounding, or bfloat16's through the whole model.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert _close(nll.detach(), expected.detach(), tol)
    for n, g in plain.items():
        assert _close(model.get_parameter(n).grad, g, tol), n


class _Matmuls(TorchDispatchMode):
    """Counts the matmuls (aten mm, addmm and addmm_) run while it is on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("weight_trains", [False, True], ids=["frozen-head", "trained-head"])
def test_a_frozen_head_runs_no_head_matmul_in_backward(weight_trains, monkeypatch):
    """8 chunks. A frozen head: two matmuls a chunk in the forward (the logits and the hidden
    states' gradient), none in backward, a broadcast multiply. A trained head: the logits in the
    forward, and backward's recompute, the hidden states' and the weight's gradient. Without
    gradients (a reference's no_grad): the logits only."""
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", VOCAB * 5)
    hidden, weight, targets, grad_out = _inputs(torch.float32, weight_trains)
    chunks = -(-POSITIONS // 5)
    forward, backward = _Matmuls(), _Matmuls()
    with forward:
        rows = head_nll(hidden, targets, weight)
    with backward:
        (rows * grad_out).sum().backward()
    assert (forward.count, backward.count) == ((chunks, 3 * chunks) if weight_trains else (2 * chunks, 0))
    with torch.no_grad(), _Matmuls() as reference:
        head_nll(hidden, targets, weight)
    assert reference.count == chunks


def test_a_frozen_head_saves_one_hidden_sized_gradient_and_refuses_a_second_backward(monkeypatch):
    """The gradient formed in the forward is what the loss saves (what the activation meter and
    the estimator's head-input term count, memory/activations.py), and backward scales it in
    place, once."""
    from lisaft.metrics.measure import saved_activations

    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", VOCAB * 5)
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight, targets, grad_out = _inputs(dtype, False)
        with saved_activations() as meter:
            rows = head_nll(hidden, targets, weight)
        assert meter.bytes == hidden.numel() * hidden.element_size()
    loss = (rows * grad_out).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()
