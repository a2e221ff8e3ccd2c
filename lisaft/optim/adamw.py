"""AdamW for one training unit, with float32 or 8-bit moments, paged state, and bf16 updates that land.

lisaft builds one optimizer per training unit (embeddings, head, each decoder layer; see
lisaft/optim/unit_optimizers.py), so LISA, offload, checkpoints and sharded state move whole optimizers through
the public `step` / `zero_grad` / `state_dict` / `load_state_dict`.

The four recipe optimizers are one class with two choices:
- moments: `adamw_32bit` and `paged_adamw_32bit` keep float32 moments whatever the weight dtype;
  `adamw_8bit` and `paged_adamw_8bit` keep bitsandbytes' blockwise 8-bit moments (tensors under
  4096 elements keep float32 ones, as bitsandbytes does).
- paged: on CUDA, moment buffers of tensors with at least 1e5 elements live in CUDA unified
  memory (bitsandbytes' paged allocation) and are recycled through a PagedPool.

The update is computed in float32 over chunks of at most CHUNK elements. A float32 weight is
updated in place. A bfloat16 weight is copied chunk by chunk to float32, updated, and written back
with stochastic rounding (the default) or round-to-nearest (`optimizer.bf16_update`): at
fine-tuning learning rates most AdamW steps are smaller than half a bf16 ulp and round-to-nearest
drops them, while stochastic rounding keeps their expected value. No float32 copy of a weight
outlives its chunk, so the extra memory is bounded (ROUNDING_BUFFER_BYTES).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from lisaft import internals
from lisaft.optim import host_step
from lisaft.optim.rounding import Rounding

# Elements updated at a time: a multiple of bitsandbytes' 256-element quantization block, so
# chunks of 8-bit state line up with whole blocks.
CHUNK = 1 << 22
# Transients of one chunk in the bf16 path: float32 weight, float32 gradient, and the int32
# rounding noise (or a bitsandbytes kernel's own float32 buffer), never more than three at once.
CHUNK_BYTES_PER_ELEMENT = 3 * 4
ROUNDING_BUFFER_BYTES = CHUNK_BYTES_PER_ELEMENT * CHUNK
# bitsandbytes' rules (bitsandbytes/optim/optimizer.py): 8-bit moments from this many elements,
# paged buffers from PAGED_MIN_NUMEL, quantization blocks of BLOCKSIZE.
MIN_8BIT_NUMEL = 4096
PAGED_MIN_NUMEL = 100_000
BLOCKSIZE = 256
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")

QUANTIZATION_MAP_BYTES = 2 * 256 * 4  # the signed and unsigned code books of 8-bit Adam



def holds_chunk_buffers(weight_bytes: int, sparse_grad: bool = False) -> bool:
    """Whether stepping a tensor holds float32 chunk buffers (at most CHUNK_BYTES_PER_ELEMENT x
    CHUNK bytes): a weight that is not float32 is updated through a float32 copy of each chunk and
    a sparse gradient is made dense a chunk at a time, while a float32 weight with a dense gradient
    is updated in place, by torch's fused kernel or bitsandbytes' on its own buffers. The memory
    estimator reads this rule."""
    return weight_bytes != 4 or sparse_grad


# ---------------------------------------------------------------------------------------------
# The bitsandbytes adapter: paged buffers, code books, fused update kernels


class PagedPool:
    """Paged buffers released by units that left the active set, handed to the next unit that
    needs one. bitsandbytes allocates paged state with cudaMallocManaged and never frees it, so
    without reuse every re-sampled layer would strand its old moments in unified memory."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, device.index)
        buf = self._free[key].pop() if self._free[key] else internals.get_paged(numel, dtype=dtype, device=device)
        internals.mark_paged(buf, device.index)
        internals.fill_paged(buf, 0)
        return buf

    def give(self, t: torch.Tensor) -> None:
        self._free[(t.numel(), t.dtype, internals.page_device(t))].append(t)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


def is_paged(t: torch.Tensor) -> bool:
    return bool(getattr(t, "is_paged", False))


_code_books: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _quantization_maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The signed and unsigned dynamic maps of bitsandbytes' 8-bit Adam, shared by every tensor."""
    if device not in _code_books:
        _code_books[device] = internals.dynamic_maps(device)
    return _code_books[device]


def _bnb_update(w, g, st: dict, lo: int, hi: int, step: int, group: dict) -> None:
    """bitsandbytes' fused AdamW kernel on elements lo:hi (decoupled weight decay, as AdamW)."""
    m, v = (_slice(st[k], lo, hi) for k in MOMENT_KEYS)
    b1, b2 = group["betas"]
    kw = dict(beta1=b1, beta2=b2, eps=group["eps"], step=step, lr=group["lr"], weight_decay=group["weight_decay"])
    if m.dtype == torch.uint8:
        q1, q2 = _quantization_maps(w.device)
        blo, bhi = lo // BLOCKSIZE, -(-hi // BLOCKSIZE)
        internals.adam_update_8bit_blockwise(g, w, m, v, code1=q1, code2=q2, absmax1=st["absmax1"][blo:bhi],
                                             absmax2=st["absmax2"][blo:bhi], **kw)
    else:
        internals.adam_update_32bit(g, w, m, v, **kw)


def _slice(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    view = t.view(-1)[lo:hi]
    return internals.mark_paged(view, internals.page_device(t)) if is_paged(t) else view


# ---------------------------------------------------------------------------------------------
# The update


def _fused_adamw(weights: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list[int],
                 group: dict) -> None:
    """torch's fused AdamW kernel (what torch.optim.AdamW(fused=True) runs) on float32 tensors,
    in place: one pass over weight, gradient and moments, and no temporaries."""
    b1, b2 = group["betas"]
    dev = weights[0].device
    internals.fused_adamw_(weights, grads, exp_avgs, exp_avg_sqs, [internals.step_tensor(s, dev) for s in steps],
                           lr=group["lr"], beta1=b1, beta2=b2, weight_decay=group["weight_decay"], eps=group["eps"])


def _fused_chunk(w, g, st: dict, lo: int, hi: int, step: int, group: dict) -> None:
    """The fused kernel on one chunk of a float32 weight, or of a bf16 weight's float32 copy."""
    m, v = (st[k].view(-1)[lo:hi] for k in MOMENT_KEYS)
    _fused_adamw([w], [g], [m], [v], [step], group)


class _GradChunks:
    """A gradient as float32 chunks of at most CHUNK elements. A sparse (row) gradient, as an
    embedding with sparse=True gives, becomes dense one chunk of whole rows at a time: rows
    without a gradient get zeros, so every row's moments decay and move exactly as AdamW's."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.sparse = grad.is_sparse
        if not self.sparse:
            self.flat, self.chunk = grad.reshape(-1), CHUNK
            return
        grad = grad.coalesce()
        self.rows, self.values = grad.indices()[0], grad.values()
        self.row_len = math.prod(grad.shape[1:])
        # Whole rows per chunk, and a whole number of 8-bit blocks.
        step = BLOCKSIZE // math.gcd(self.row_len, BLOCKSIZE)
        self.rows_per_chunk = max(step, CHUNK // self.row_len // step * step)
        self.chunk = self.rows_per_chunk * self.row_len
        # Where each chunk's rows start among the sorted gradient rows: one search, one sync.
        starts = torch.arange(0, grad.shape[0] + self.rows_per_chunk, self.rows_per_chunk, device=self.rows.device)
        self.bounds = torch.searchsorted(self.rows, starts).tolist()

    def slice(self, lo: int, hi: int) -> torch.Tensor:
        if not self.sparse:
            g = self.flat[lo:hi]
            return g.float() if g.dtype != torch.float32 else g
        r0, r1 = lo // self.row_len, -(-hi // self.row_len)
        a, b = self.bounds[r0 // self.rows_per_chunk], self.bounds[r0 // self.rows_per_chunk + 1]
        dense = torch.zeros(r1 - r0, self.row_len, dtype=torch.float32, device=self.values.device)
        # reshape to the row length, not -1: a chunk of rows no token touched has no values.
        dense[self.rows[a:b] - r0] = self.values[a:b].reshape(b - a, self.row_len).float()
        return dense.view(-1)


class AdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam over one unit's parameters (see the module docstring)."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, eight_bit: bool, paged: bool, bnb_32bit: bool,
                 rounding: Rounding, unit_index: int, pool: PagedPool | None = None,
                 moments_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.eight_bit, self.paged, self.bnb_32bit = eight_bit, paged, bnb_32bit
        self.moments_dtype = moments_dtype
        self.rounding, self.unit_index, self.pool = rounding, unit_index, pool
        self._index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        self._group = {p: g for g in self.param_groups for p in g["params"]}
        self._paged_cuda = paged and any(p.device.type == "cuda" for p in self._index)
        self._paged_done: torch.cuda.Event | None = None  # after the last update in backward

    # -- state layout ---------------------------------------------------------------------------

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.paged and p.device.type == "cuda" and p.numel() >= PAGED_MIN_NUMEL:
            assert self.pool is not None, "paged state on CUDA comes from the unit optimizers' pool"
            return self.pool.take(p.numel(), dtype, p.device)
        return torch.zeros(p.numel(), dtype=dtype, device=p.device)

    def _init_state(self, p: torch.Tensor) -> dict:
        quantized = self.eight_bit and p.numel() >= MIN_8BIT_NUMEL
        dtype = torch.uint8 if quantized else self.moments_dtype
        st = {"step": 0, "exp_avg": self._buffer(p, dtype), "exp_avg_sq": self._buffer(p, dtype)}
        if quantized:
            blocks = -(-p.numel() // BLOCKSIZE)
            st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return st

    # -- stepping -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        stepped = False
        # The whole unit's paged moments start towards the GPU before its first update, so the
        # later parameters' pages arrive while the earlier ones update.
        if self.paged:  # only paged moments move: no pass over every parameter otherwise
            self._prefetch([p for group in self.param_groups for p in group["params"] if p.grad is not None])
        for group in self.param_groups:
            fused: list[torch.Tensor] = []
            chunked: list[torch.Tensor] = []
            host: list[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is not None:
                    (host if self._on_host(p) else fused if self._fusable(p) else chunked).append(p)
            if fused:
                self._fused_update(fused, group)
            for p in chunked:
                self._update(p, group)
            for p in host:
                self._host_update(p, group)
            stepped |= bool(fused or chunked or host)
        if stepped:
            self._sync()
        return None

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """Update one parameter now (step-in-backward: its gradient has just been completed)."""
        if self.paged:
            self._prefetch([p])
        if self._on_host(p):
            self._host_update(p, self._group[p])
        elif self._fusable(p):
            self._fused_update([p], self._group[p])
        else:
            self._update(p, self._group[p])
        if self._paged_cuda:
            # Not a device sync per parameter in backward: an event on the kernels' stream, waited for where the
            # host touches the state next (release; unit_optimizers syncs before reading a state dict).
            self._paged_done = self._paged_done or torch.cuda.Event()
            self._paged_done.record()

    def _prefetch(self, params: list[torch.Tensor]) -> None:
        for p in params:
            st = self.state.get(p)
            for k in MOMENT_KEYS:
                if st and k in st and is_paged(st[k]):
                    internals.prefetch_paged(st[k])

    def _on_host(self, p: torch.Tensor) -> bool:
        """Whether p steps through the fused host kernel (lisaft/optim/host_step.py): on the CPU,
        whenever it loads; bfloat16 moments always, through its torch reference without it. A
        float32 weight with a dense float32 gradient and float32 moments is the exception: torch's
        fused AdamW kernel steps it in place, faster on the CPU (SmolLM2's full fine-tuning on 2
        cores: the optimizer was 2.2% of lisaft's step, 0.9% of the Trainer's with that kernel).
        The rule is the tensor's, not the run's, so resident and cpu_offload's host copies step
        by the same kernel and stay bit for bit equal."""
        if p.device.type != "cpu":
            return False
        if self.moments_dtype == torch.bfloat16:
            return True
        return not self._fusable(p) and host_step.available()

    def _host_update(self, p: torch.Tensor, group: dict) -> None:
        """One pass over weight, gradient and moments; a sparse gradient in dense chunks of rows,
        each at its own element offset, so the rounding noise is that of the dense gradient."""
        st = self._next_step(p)
        s = host_step.adam_scalars(group, st["step"])
        key = self.rounding.key(self.unit_index, self._index[p])
        stochastic = self.rounding.mode == "stochastic"
        maps = _quantization_maps(p.device) if st["exp_avg"].dtype == torch.uint8 else None
        assert p.grad is not None  # step() passes only parameters with a gradient
        flat_p, g = p.detach().view(-1), p.grad.detach()
        if not g.is_sparse:
            host_step.step_chunk(flat_p, g.reshape(-1), st, 0, flat_p.numel(), s, key, stochastic, maps)
            return
        grad = _GradChunks(g)
        for lo in range(0, flat_p.numel(), grad.chunk):
            hi = min(lo + grad.chunk, flat_p.numel())
            host_step.step_chunk(flat_p[lo:hi], grad.slice(lo, hi), st, lo, hi, s, key, stochastic, maps)

    def _fusable(self, p: torch.Tensor) -> bool:
        """Whether p steps whole, with the others of its group in one kernel call: a float32
        weight with a dense float32 gradient and float32 moments. Everything else goes by chunks."""
        g = p.grad
        return (g is not None and p.dtype == g.dtype == torch.float32 and g.layout == torch.strided
                and not (self.eight_bit or self.bnb_32bit))

    def _fused_update(self, params: list[torch.Tensor], group: dict) -> None:
        """float32 weights with float32 moments: torch's fused AdamW kernel over all of them at
        once, in place: nothing is copied or chunked."""
        states = [self._next_step(p) for p in params]
        _fused_adamw(params, [p.grad for p in params], [st["exp_avg"].view_as(p) for st, p in zip(states, params)],
                     [st["exp_avg_sq"].view_as(p) for st, p in zip(states, params)], [st["step"] for st in states],
                     group)

    def _sync(self) -> None:
        # Paged kernels run asynchronously on memory the host may touch next (offload, release).
        if self._paged_cuda:
            torch.cuda.synchronize()
            self._paged_done = None

    def _next_step(self, p: torch.Tensor) -> dict:
        """p's state, created on its first update, with the step count advanced."""
        st = self.state[p]
        if not st:
            st.update(self._init_state(p))
        st["step"] += 1
        return st

    def _update(self, p: torch.Tensor, group: dict) -> None:
        st = self._next_step(p)
        kernel = _bnb_update if (self.eight_bit or self.bnb_32bit) else _fused_chunk
        flat_p = p.detach().view(-1)
        assert p.grad is not None
        grad = _GradChunks(p.grad.detach())
        low = p.dtype != torch.float32  # holds_chunk_buffers: a float32 copy per chunk
        for c, lo in enumerate(range(0, flat_p.numel(), grad.chunk)):
            hi = min(lo + grad.chunk, flat_p.numel())
            w = flat_p[lo:hi].float() if low else flat_p[lo:hi]
            g = grad.slice(lo, hi)
            kernel(w, g, st, lo, hi, st["step"], group)
            del g
            if low:
                self.rounding.write(flat_p[lo:hi], w, self.unit_index, self._index[p], c)

    # -- moving state ---------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Install saved state as this optimizer would have created it: moments keep their dtype
        (float32 or uint8, whatever the weight dtype), on the parameter's device, paged again for
        a paged optimizer on CUDA. Hyperparameters stay those of the recipe."""
        params = [p for g in self.param_groups for p in g["params"]]
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(saved) != len(params):
            raise ValueError(f"saved state has {len(saved)} parameters, this unit has {len(params)}")
        self.release()
        for pid, p in zip(saved, params):
            st = state_dict["state"].get(pid)
            if st:
                self.state[p] = {k: self._place(p, k, v) for k, v in st.items()}

    def _place(self, p: torch.Tensor, key: str, v):
        if not torch.is_tensor(v):
            return v
        if key in MOMENT_KEYS:
            buf = self._buffer(p, v.dtype)
            if is_paged(buf):
                buf.copy_(v.reshape(-1))
                return buf
        return v.to(p.device, non_blocking=v.is_pinned())

    def release(self) -> None:
        """Forget all moments; paged buffers go back to the pool for the next unit."""
        if self._paged_done is not None:  # step() synced the device; backward's updates did not
            self._paged_done.synchronize()
            self._paged_done = None
        for st in self.state.values():
            for k in MOMENT_KEYS:
                if k in st and is_paged(st[k]) and self.pool is not None:
                    self.pool.give(st[k])
        self.state.clear()

    def resident_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for st in self.state.values() for v in st.values()
                   if torch.is_tensor(v))


def param_groups(params: list) -> list[dict]:
    """The unit's parameter groups: weight decay on matrices and embeddings (>= 2-D) only."""
    decay, no_decay = _decay_split(params)
    return [g for g in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def _decay_split(params: list) -> tuple[list, list]:
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]


def state_order(params: list) -> list:
    """The unit's parameters in the order of their indices in its optimizer's state_dict."""
    decay, no_decay = _decay_split(params)
    return decay + no_decay
