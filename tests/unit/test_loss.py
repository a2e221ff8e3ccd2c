"""The chunked loss equals the plain one, and keeps far less for backward."""

import pytest
import torch

from lisaft.model import loss as loss_mod
from lisaft.model.loss import eval_sums, logits_loss_sum, token_loss_sum


def _model(kind: str, tied: bool = False):
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    common = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg = Gemma2Config(**common, head_dim=8, final_logit_softcapping=5.0) if kind == "gemma2" \
        else LlamaConfig(**common, tie_word_embeddings=tied)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :7] = -100
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    labels[1, 20:] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_chunked_loss_and_gradients_match_the_plain_loss(kind, monkeypatch):
    model, batch = _model(kind), _batch()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    plain = logits_loss_sum(logits, batch["labels"])
    plain.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)  # 5 positions a chunk
    assert loss_mod.chunked(model, batch["input_ids"].numel())
    chunked = token_loss_sum(model, batch)
    chunked.backward()
    assert torch.allclose(chunked, plain, rtol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, plain_grads[n], rtol=1e-4, atol=1e-6), n

    loss_c, n_c, correct_c = eval_sums(model, batch)
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 1 << 40)
    loss_p, n_p, correct_p = eval_sums(model, batch)
    assert n_c == n_p == int((batch["labels"][:, 1:] != -100).sum())
    assert correct_c == correct_p and loss_c == pytest.approx(loss_p, rel=1e-5)


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("llama", True), ("gemma2", True)],
                         ids=["untied", "tied", "tied-softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_chunked_loss_equals_cross_entropy_over_full_logits(dtype, kind, tied, monkeypatch):
    """The chunked loss forms its gradients in the forward and scales them in backward: the loss
    and every gradient (a tied embedding's two parts summed; through Gemma 2's soft-cap) are
    torch's over the whole logits."""
    model, batch = _model(kind, tied).to(dtype), _batch()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 512), batch["labels"][:, 1:].reshape(-1),
                                                 ignore_index=-100, reduction="sum")
    (expected * 0.37).backward()  # a non-unit output gradient, as the trainer's 1 / tokens
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)  # 10 chunks of 5 positions
    loss = token_loss_sum(model, batch)
    (loss * 0.37).backward()
    assert torch.allclose(loss, expected, rtol=1e-6 if dtype == torch.float32 else 1e-3)
    # Each gradient's largest error against its largest entry: float32 rounding, or bfloat16's.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for n, p in model.named_parameters():
        ref = plain[n].float()
        assert (p.grad.float() - ref).abs().max() <= tol * ref.abs().max(), n
    with pytest.raises(RuntimeError, match="one backward"):
        again = token_loss_sum(model, batch)
        again.backward(retain_graph=True)
        again.backward()


def test_chunking_drops_the_float32_log_probs(monkeypatch):
    from lisaft.metrics.measure import saved_activations

    model, batch = _model("llama"), _batch()
    # Each result is held past the meter's close, as the step holds its loss until backward: the
    # meter counts only what a live graph still holds.
    with saved_activations(model) as plain:
        held = token_loss_sum(model, batch)
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)
    with saved_activations(model) as meter:
        held = token_loss_sum(model, batch)  # noqa: F841 - held for the meter, see above
    tokens = batch["input_ids"].numel()
    # The plain path keeps float32 log-probs of every position: 4 B x tokens x vocabulary.
    assert plain.bytes - meter.bytes >= 0.9 * 4 * tokens * 512


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_sum_matches_torch_in_value_and_gradient(dtype):
    from lisaft.model.loss import cross_entropy_sum

    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(37, 300, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 300, (37,), generator=g)
    targets[::5] = -100
    ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = cross_entropy_sum(ours, targets)
    expected = torch.nn.functional.cross_entropy(ref.float(), targets, ignore_index=-100, reduction="sum")
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, expected, rtol=1e-6)
    # A non-unit output gradient, as the trainer's 1 / (tokens in the step) gives.
    (loss * 0.37).backward()
    (expected * 0.37).backward()
    assert ours.grad.dtype == dtype
    assert torch.allclose(ours.grad.float(), ref.grad.float(), rtol=1e-5, atol=1e-7)
    assert not ours.grad[::5].any()  # ignored rows get no gradient
    # Each valid row's gradient sums to zero (softmax minus one-hot), as cross entropy's does.
    atol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(ours.grad[1:5].float().sum(-1), torch.zeros(4), atol=atol)


def test_cross_entropy_sum_refuses_a_second_backward():
    from lisaft.model.loss import cross_entropy_sum

    logits = torch.randn(4, 10, requires_grad=True)
    loss = cross_entropy_sum(logits, torch.tensor([1, 2, -100, 3]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


class _LiveOfShape:
    """Counts the distinct storages of tensors of one shape that ops produce and that are alive
    at once: the head-sized gradients a backward holds, as measured, not as estimated."""

    def __init__(self, shape):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.saw(out)
                return out

        self.shape, self.live, self.peak, self.mode = tuple(shape), {}, 0, Mode()

    def saw(self, out):
        import weakref

        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape and id(t) not in self.live:
                self.live[id(t)] = t.untyped_storage().data_ptr()
                weakref.finalize(t, self.live.pop, id(t), None)
        self.peak = max(self.peak, len(set(self.live.values())))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_chunked_loss_forms_one_head_gradient_as_the_estimator_counts(dtype, monkeypatch):
    """Checkpointed chunks held two head-sized gradients in the loss's backward (each chunk's,
    and the sum autograd keeps); lisaft's chunked loss holds one from its forward to the end of
    backward (autograd takes the buffer formed in the forward as the gradient), the estimator's
    term. The gradients stay the plain loss's, in float32 and bfloat16."""
    from lisaft.memory.estimate import compute
    from lisaft.memory.settings import settings_for_config

    model, batch = _model("llama").to(dtype), _batch()
    model.model.embed_tokens.weight.requires_grad_(False)  # its gradient has the head's shape
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits_loss_sum(logits, batch["labels"]).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)  # 10 chunks of 5 positions
    head = model.get_output_embeddings().weight
    live = _LiveOfShape(head.shape)
    with live.mode:
        token_loss_sum(model, batch).backward()
    assert live.peak == 1
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=0.05, atol=2e-2)
    for n, g in plain.items():
        assert torch.allclose(model.get_parameter(n).grad.float(), g.float(), **tol), n
    est = compute(settings_for_config(model.config, {
        "model.dtype": str(dtype).split(".")[1], "optimizer.name": "adamw_32bit", "data.max_seq_len": 24,
        "training.batch_size": 2, "model.attention": "eager"}, device="cpu"))
    final_norm = model.model.norm.weight
    measured = live.peak * head.numel() * head.element_size() + final_norm.numel() * final_norm.element_size()
    assert est.phase_components["loss_backward"]["gradients"] == measured


@pytest.mark.parametrize("form", ["summed", "per-position", "per-position-frozen-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_chunked_loss_allocates_its_logits_buffers_once_for_all_chunks(dtype, form, monkeypatch):
    """Ten chunks, two logits-sized allocations per pass over them: the chunk's logits and its
    float32 log-probs, reused chunk after chunk (in bfloat16 the gradient goes back into the
    logits' buffer). The summed loss passes once (its gradients formed in the forward), and so
    does the per-position one with a frozen head (LoRA); with a trained head it passes twice
    (backward recomputes). On a CPU each fresh buffer of a real
    vocabulary's chunk is mapped anew and page-faults on first touch (benchmarks/step_probe.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from lisaft.model.loss import token_nll

    fresh = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
            fresh.extend(str(t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                         and t.shape[-1:] == (512,) and t.untyped_storage().data_ptr() not in given)
            return out

    model, batch = _model("llama").to(dtype), _batch()
    model.get_output_embeddings().weight.requires_grad_(form != "per-position-frozen-head")
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)  # 10 chunks of 5 positions
    with Allocations():
        loss = token_loss_sum(model, batch) if form == "summed" else token_nll(model, batch).sum()
        loss.backward()
    passes = 2 if form == "per-position" else 1
    assert sorted(fresh) == sorted([str(dtype), "torch.float32"] * passes), fresh
