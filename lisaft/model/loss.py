"""Next-token loss without vocab x tokens float32 buffers for the whole sequence.

The usual causal-LM loss materialises the logits of every position, upcasts them to float32 and
keeps the log-softmax for backward: 12 bytes x tokens x vocabulary at the loss's backward, which
for Llama-3's 128,256-entry vocabulary is 1.5 GiB per 1,024 tokens — at 2,048 tokens more than
LISA's whole optimizer state. When that product exceeds LOSS_CHUNK_ELEMENTS, the head and the
loss run over chunks of positions, only one chunk's logits existing at a time. The summed loss
forms each chunk's gradients in its forward (_FusedHeadLoss), so backward has nothing to
recompute; the per-position loss recomputes each chunk's logits there where the head trains
(_ChunkedHeadLoss), and forms the hidden states' gradient in the forward where it is frozen
(_FrozenHeadRows).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lisaft.data.collate import IGNORE_INDEX as IGNORE
from lisaft.model.attention import model_inputs

# Logits per chunk: 16.8M entries, 64 MiB in float32 (131 positions of a 128k vocabulary).
LOSS_CHUNK_ELEMENTS = 1 << 24
# Architectures whose logits are exactly head(final hidden state), possibly soft-capped.
PLAIN_HEAD_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "gemma", "gemma2",
                     "gpt2", "gpt_neox"}


def _vocab(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def chunked(model, tokens: int) -> bool:
    """Whether the loss for `tokens` positions runs in chunks on this model."""
    cfg = model.config
    return (tokens * _vocab(model) > LOSS_CHUNK_ELEMENTS
            and getattr(cfg, "model_type", None) in PLAIN_HEAD_TYPES
            and isinstance(model.get_output_embeddings(), torch.nn.Linear)
            and model.base_model is not model)


def _softcap(model) -> float | None:
    return getattr(model.config, "final_logit_softcapping", None)


def _head_logits(hidden: torch.Tensor, head: torch.nn.Module, softcap: float | None) -> torch.Tensor:
    logits = head(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class _CrossEntropySum(torch.autograd.Function):
    """Sum of the cross entropy of logits [N, V] (any float dtype, computed in float32) over the
    rows whose target is not -100: F.cross_entropy(logits.float(), reduction="sum") with less
    memory traffic. Backward turns the saved float32 log-probs into the gradient in place
    (exp, times the row's output gradient, minus it at the target) instead of zero-filling a
    vocab x tokens NLL gradient and reading it back in log-softmax's backward: one buffer of that
    size instead of three. On a CPU each fresh buffer of that size also costs its page faults."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        valid = targets != IGNORE
        safe = targets.masked_fill(~valid, 0)
        picked = logp.gather(1, safe[:, None]).squeeze(1)
        ctx.save_for_backward(logp, safe, valid)
        ctx.logits_dtype, ctx.spent = logits.dtype, False
        return -torch.where(valid, picked, 0.0).sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.spent:
            # The saved log-probs became the first backward's gradient.
            raise RuntimeError("lisaft's loss supports one backward pass (no retain_graph)")
        ctx.spent = True
        logp, safe, valid = ctx.saved_tensors
        scale = torch.where(valid, grad_out.float(), 0.0)[:, None]
        grad = logp.exp_().mul_(scale)
        grad.scatter_add_(1, safe[:, None], -scale)
        return grad.to(ctx.logits_dtype), None


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Float32 sum of the cross entropy of logits [N, V] over targets [N] that are not -100."""
    return _CrossEntropySum.apply(logits, targets)


def _chunk_loss(hidden, targets, head, softcap):
    return cross_entropy_sum(_head_logits(hidden, head, softcap), targets)


class _FusedHeadLoss(torch.autograd.Function):
    """Sum of the cross entropy of head(hidden) [N, V] over chunks of `step` positions, with each
    chunk's gradients formed in the forward, as a fused linear cross entropy does: the chunk's
    logits exist once, and only the gradients with respect to the hidden states ([N, H], the size
    of the input a recompute would keep) and the head's weight (one head-sized buffer, the one
    the loss's backward would form) outlive it. Backward scales them by the loss's output
    gradient, a scalar, and returns them: no logits recomputed, one head matmul per token fewer.
    The weight's gradient is added into one buffer in place, and a post-accumulate-grad hook (the
    optimizer in backward, cpu_offload's copy) fires once, as with a single head call."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, step: int, softcap: float | None, want_h: bool, want_w: bool):
        rows, grad_h, grad_w = _chunks_forward(hidden, targets, weight, step, softcap, want_h, want_w)
        total = hidden.new_zeros((), dtype=torch.float32)
        for i in range(0, hidden.size(0), step):
            total += rows[i:i + step].sum()  # chunk by chunk: the order of addition a chunk's loss has
        ctx.grads = (grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            # The gradients formed in the forward were handed out and scaled by the first backward.
            raise RuntimeError("lisaft's loss supports one backward pass (no retain_graph)")
        # Dropping ctx's references lets autograd take the buffers as the gradients, not copy them.
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        for g in (grad_h, grad_w):
            if g is not None:
                g.mul_(grad_out)
        return grad_h, None, grad_w, None, None, None, None


def _chunks_forward(hidden, targets, weight, step: int, softcap: float | None, want_h: bool, want_w: bool):
    """Each row's float32 cross entropy [N] of hidden @ weight.T, chunk by chunk in one logits and
    one log-probs buffer, and where wanted the gradients at an output gradient of 1 for every row:
    the hidden states' [N, H], and the weight's summed over the rows into one head-sized buffer."""
    rows = hidden.new_empty(hidden.size(0), dtype=torch.float32)
    grad_h = torch.empty_like(hidden) if want_h else None
    grad_w = torch.empty_like(weight) if want_w else None
    logits_buf, logp_buf = _chunk_buffers(hidden, weight, step)
    for i in range(0, hidden.size(0), step):
        h = hidden[i:i + step]
        n = h.size(0)
        logits = torch.mm(h, weight.t(), out=logits_buf[:n])
        rows[i:i + step], g = _ce_rows_and_logit_grad(logits, targets[i:i + step], softcap, want_h or want_w,
                                                      logp_buf[:n])
        if grad_h is not None:
            torch.mm(g, weight, out=grad_h[i:i + step])
        if grad_w is not None:
            if i == 0:
                torch.mm(g.t(), h, out=grad_w)
            else:
                grad_w.addmm_(g.t(), h)
    return rows, grad_h, grad_w


def _ce_rows_and_logit_grad(logits: torch.Tensor, targets: torch.Tensor, softcap: float | None, want_grad: bool,
                            logp: torch.Tensor):
    """One chunk's float32 cross entropy per row (0 where the target is -100) and, if wanted, its
    gradient with respect to the raw logits at an output gradient of 1 for every row, in the
    logits' dtype: the float32 log-probs, written into `logp`, turned into it in place, as
    _CrossEntropySum's backward does, cast back into the logits' buffer when that is not float32,
    and times the soft-cap's slope in place. The logits are this function's to overwrite: at most
    the float32 log-probs and two buffers of the logits' dtype (one without a soft-cap) at once,
    memory/activations.py loss_buffers_peak."""
    tanh, capped = None, logits
    if softcap:  # the soft-cap's slope is 1 - tanh^2
        tanh = logits.div_(softcap).tanh_()
        capped = tanh * softcap
    torch.log_softmax(capped, dim=-1, dtype=torch.float32, out=logp)
    valid = targets != IGNORE
    safe = targets.masked_fill(~valid, 0)
    rows = -torch.where(valid, logp.gather(1, safe[:, None]).squeeze(1), 0.0)
    if not want_grad:
        return rows, None
    scale = valid.float()[:, None]
    grad = logp.exp_().mul_(scale)
    grad.scatter_add_(1, safe[:, None], -scale)
    if grad.dtype != capped.dtype:
        grad = capped.copy_(grad)  # the logits (or the capped ones) are spent: their buffer takes it
    if tanh is not None:
        torch.ops.aten.tanh_backward(grad, tanh, grad_input=grad)
    return rows, grad


class _ChunkedHeadLoss(torch.autograd.Function):
    """Each position's cross entropy [N] (0 where the target is -100) of head(hidden) [N, V], over
    chunks of `step` positions. Its backward takes one output gradient per position (preference
    and GRPO log-probs), unknown in the forward, which the head weight's gradient sums over, so it
    recomputes each chunk's logits there, and adds the chunk's weight gradient into one head-sized
    buffer in place (addmm_): checkpointed chunks would each form a head-sized gradient for
    autograd to add into the one it holds, and fire a post-accumulate-grad hook once per chunk."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, step: int, softcap: float | None):
        rows, _, _ = _chunks_forward(hidden, targets, weight, step, softcap, False, False)
        ctx.save_for_backward(hidden, targets, weight)
        ctx.step, ctx.softcap = step, softcap
        return rows

    @staticmethod
    def backward(ctx, grad_out):
        hidden, targets, weight = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        logits_buf, logp_buf = _chunk_buffers(hidden, weight, ctx.step)
        for i in range(0, hidden.size(0), ctx.step):
            h = hidden[i:i + ctx.step]
            raw = torch.mm(h, weight.t(), out=logits_buf[:h.size(0)])
            g = _ce_grad(_capped(raw, ctx.softcap), targets[i:i + ctx.step], grad_out[i:i + ctx.step],
                         logp_buf[:h.size(0)])
            if ctx.softcap:  # d/dz c*tanh(z/c) = 1 - tanh(z/c)^2
                g = (g.float() * (1 - torch.tanh(raw.float() / ctx.softcap).pow(2))).to(raw.dtype)
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[i:i + ctx.step])
            if grad_w is not None:
                grad_w.addmm_(g.t(), h)
        return grad_h, None, grad_w, None, None


class _FrozenHeadRows(torch.autograd.Function):
    """_ChunkedHeadLoss's per-position cross entropy where the head's weight is frozen (LoRA, DoRA,
    QLoRA). The rows are independent: row i's gradient is grad_out[i] * u_i, u_i its gradient at
    an output gradient of 1, formed in the forward from the chunk's logits (the soft-cap's slope
    in it, 0 where the target is -100) and saved in place of the hidden states (the same bytes);
    backward scales it in place: no logits recomputed, one head matmul per token fewer."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, step: int, softcap: float | None):
        total, unit, _ = _chunks_forward(hidden, targets, weight, step, softcap, True, False)
        # Saved, not kept on ctx: saved-tensor hooks (the activation meter) see it, as the hidden
        # states a recompute saves.
        ctx.save_for_backward(unit)
        ctx.spent = False
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.spent:
            # The saved gradient was scaled in place and handed out by the first backward.
            raise RuntimeError("lisaft's loss supports one backward pass (no retain_graph)")
        ctx.spent = True
        (unit,) = ctx.saved_tensors
        return unit.mul_(grad_out[:, None]), None, None, None, None


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def _ce_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's float32 cross entropy, 0 where the target is -100."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    valid = targets != IGNORE
    return -torch.where(valid, logp.gather(1, targets.masked_fill(~valid, 0)[:, None]).squeeze(1), 0.0)


def _ce_grad(logits: torch.Tensor, targets: torch.Tensor, grad_out: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """The gradient of the rows' cross entropy with respect to the logits, given one output
    gradient per row, in the logits' dtype: the float32 log-probs, written into `logp`, turned into
    it in place, and cast back into the logits' buffer (spent) when that is not float32."""
    torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=logp)
    valid = targets != IGNORE
    scale = torch.where(valid, grad_out.float(), 0.0)[:, None]
    grad = logp.exp_().mul_(scale)
    grad.scatter_add_(1, targets.masked_fill(~valid, 0)[:, None], -scale)
    return grad if grad.dtype == logits.dtype else logits.copy_(grad)


def _chunk_buffers(hidden: torch.Tensor, weight: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's logits (the model's dtype) and float32 log-probs, for every chunk in turn. On a
    CPU a fresh buffer above glibc's mmap threshold (32 MiB at most; a chunk's logits are up to 64
    MiB) is mapped anew and page-faults on first touch, so a buffer per chunk cost a fault per 4 KiB
    of logits, chunk after chunk (docs/lisa.md, benchmarks/step_probe.py)."""
    shape = (min(step, hidden.size(0)), weight.size(0))
    return hidden.new_empty(shape), hidden.new_empty(shape, dtype=torch.float32)


def _positions(model, batch: dict, sharded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states of every position that predicts a token, flattened, and the targets."""
    last = _sharded_last_hidden(model, batch) if sharded else model.base_model(**model_inputs(batch)).last_hidden_state
    hidden = last[:, :-1]
    return hidden.reshape(-1, hidden.size(-1)), batch["labels"][:, 1:].reshape(-1)


def _sharded_last_hidden(model, batch: dict) -> torch.Tensor:
    """training.fsdp: the model's own forward must run, since its hooks gather the root unit's
    weights (the embeddings) and arm its backward; calling the base model directly would skip
    them. The head then runs on no position (logits_to_keep: an empty index) and the base
    model's output is taken on its way out."""
    seen = []
    hook = model.base_model.register_forward_hook(lambda _m, _a, out: seen.append(out.last_hidden_state))
    try:
        model(**model_inputs(batch), logits_to_keep=torch.empty(0, dtype=torch.long, device=batch["input_ids"].device))
    finally:
        hook.remove()
    return seen[-1]


def head_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                  softcap: float | None = None) -> torch.Tensor:
    """Float32 sum of the cross entropy of hidden [N, H] @ weight.T over targets [N] that are not
    -100, in chunks of positions, its gradients formed in the forward (_FusedHeadLoss)."""
    grad = torch.is_grad_enabled()
    step = max(1, LOSS_CHUNK_ELEMENTS // weight.shape[0])
    return _FusedHeadLoss.apply(hidden, targets, weight, step, softcap,
                                grad and hidden.requires_grad, grad and weight.requires_grad)


def head_nll(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
             softcap: float | None = None) -> torch.Tensor:
    """Each position's float32 cross entropy [N] of hidden [N, H] @ weight.T (0 where the target
    is -100), in chunks of positions: recomputed in backward where the weight trains
    (_ChunkedHeadLoss), the hidden states' gradient formed in the forward where only they want one
    (_FrozenHeadRows), and no more than the losses without gradients (a reference's no_grad)."""
    step = max(1, LOSS_CHUNK_ELEMENTS // weight.shape[0])
    if torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad:
        return _FrozenHeadRows.apply(hidden, targets, weight, step, softcap)
    return _ChunkedHeadLoss.apply(hidden, targets, weight, step, softcap)


def token_loss_sum(model, batch: dict, sharded: bool = False) -> torch.Tensor:
    """Sum of next-token cross entropy (float32) over the positions whose label is not -100.
    `sharded`: training.fsdp's model (the parallel strategy says so), whose forward hooks gather
    the weights, so its own forward and the head as a module run."""
    input_ids = batch["input_ids"]
    if not chunked(model, input_ids.numel()):
        logits = model(**model_inputs(batch)).logits
        return logits_loss_sum(logits, batch["labels"])
    hidden, targets = _positions(model, batch, sharded)
    head, cap = model.get_output_embeddings(), _softcap(model)
    step = max(1, LOSS_CHUNK_ELEMENTS // _vocab(model))
    if head.bias is None and not sharded:  # FSDP's head must run as a module (its hooks)
        return head_loss_sum(hidden, targets, head.weight, cap)
    fn = functools.partial(_chunk_loss, head=head, softcap=cap)
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.size(0), step):
        total = total + checkpoint(fn, hidden[i:i + step], targets[i:i + step], use_reentrant=False)
    return total


def token_nll(model, batch: dict, sharded: bool = False, temperature: float = 1.0) -> torch.Tensor:
    """Next-token cross entropy (float32) of every predicting position, [rows, width - 1], 0 where
    the label is -100: the per-token form of token_loss_sum, chunked over the vocabulary the same
    way, so preference and GRPO log-probs never hold [sequences x positions x vocab] float32 logits
    (`sharded`: as token_loss_sum's). `temperature`: of the logits divided by it (GRPO scores
    completions at the temperature they were sampled at)."""
    input_ids = batch["input_ids"]
    rows, width = input_ids.shape
    if not chunked(model, input_ids.numel()):
        logits = model(**model_inputs(batch)).logits[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        return _ce_rows(logits.reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1)).view(rows, -1)
    hidden, targets = _positions(model, batch, sharded)
    head, cap = model.get_output_embeddings(), _softcap(model)
    step = max(1, LOSS_CHUNK_ELEMENTS // _vocab(model))
    if head.bias is None and not sharded and (cap is None or temperature == 1.0):
        # Without a bias or a cap the logits are linear in the hidden state: divide it instead.
        scaled = hidden / temperature if temperature != 1.0 else hidden
        return head_nll(scaled, targets, head.weight, cap).view(rows, -1)
    fn = functools.partial(_chunk_rows, head=head, softcap=cap, temperature=temperature)
    parts = [checkpoint(fn, hidden[i:i + step], targets[i:i + step], use_reentrant=False)
             for i in range(0, hidden.size(0), step)]
    return torch.cat(parts).view(rows, width - 1)


def _chunk_rows(hidden, targets, head, softcap, temperature: float = 1.0):
    logits = _head_logits(hidden, head, softcap)
    return _ce_rows(logits / temperature if temperature != 1.0 else logits, targets)


def logits_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Shift the labels, not the logits: a sliced logits tensor is copied to be flattened, and its
    # backward zero-fills and copies a logits-sized gradient once more. The last position gets
    # label -100 and counts for nothing.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return cross_entropy_sum(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def eval_sums(model, batch: dict, sharded: bool = False) -> tuple[float, int, int]:
    """(loss sum, response tokens, argmax-correct response tokens) of one batch (`sharded`: as
    token_loss_sum's)."""
    if chunked(model, batch["input_ids"].numel()):
        hidden, targets = _positions(model, batch, sharded)
        head, cap = model.get_output_embeddings(), _softcap(model)
        step = max(1, LOSS_CHUNK_ELEMENTS // _vocab(model))
        # One chunk's logits at a time: each is reduced before the next is computed.
        loss = correct = 0.0
        for i in range(0, hidden.size(0), step):
            logits = _head_logits(hidden[i:i + step], head, cap)
            t = targets[i:i + step]
            loss += cross_entropy_sum(logits, t).item()
            correct += ((logits.argmax(-1) == t) & (t != IGNORE)).sum().item()
        return loss, int((targets != IGNORE).sum()), int(correct)
    logits = model(**model_inputs(batch)).logits
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE
    correct = ((logits[:, :-1].argmax(-1) == targets) & mask).sum().item()
    return logits_loss_sum(logits, batch["labels"]).item(), int(mask.sum()), int(correct)
