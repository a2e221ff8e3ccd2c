"""The optimizer registry, step-in-backward, and moving a parameter's optimizer state in and out.

One optimizer is built over every parameter of the model, frozen ones included. PyTorch's AdamW
and bitsandbytes both skip a parameter whose .grad is None and create its state on its first
update, so LISA only has to flip requires_grad: a layer frozen at the start trains as soon as it
is sampled, and a frozen layer costs no optimizer memory until then.

The LISA controller moves the state of layers that leave or re-enter the active set through
`export_state` / `import_state` / `drop_state`, which hide the two state layouts:
- torch AdamW: step (a float32 scalar tensor, on the device when fused, on the host otherwise),
  exp_avg, exp_avg_sq.
- bitsandbytes AdamW: step (a Python int), state1, state2 (the two moments: float32, or uint8
  codes with per-block absmax1/absmax2 for 8-bit), qmap1/qmap2 (the quantization code books,
  shared by every 8-bit parameter of the optimizer, so never copied per parameter).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch import nn

from lisaft.recipe import OptimizerSection

# bitsandbytes pages state only for tensors at least this large; smaller ones are plain device
# tensors (Optimizer8bit.get_state_buffer).
_PAGED_MIN_NUMEL = 100_000
# Code books every 8-bit parameter points at; re-attached on import instead of copied.
_SHARED_KEYS = ("qmap1", "qmap2")
_warned_cpu_paging: set[str] = set()


# ---------------------------------------------------------------------------------------------
# Paged state that is recycled instead of leaked


class PagedPool:
    """Paged buffers released by layers that left the active set, handed to the next layer that
    needs one. bitsandbytes allocates paged state with cudaMallocManaged and never frees it, so
    without reuse every re-sampled layer would strand its old moments in unified memory. Decoder
    layers all have the same shapes, so the pool stays at most one switch's worth of buffers."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)

    def take(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as F

        key = (p.numel(), dtype, p.device.index)
        if self._free[key]:
            base = self._free[key].pop()
        else:
            base = F.get_paged(p.numel(), dtype=dtype, device=p.device)
        buf = base.view(p.shape)
        # bitsandbytes recognises paged tensors by these attributes, which a view does not inherit.
        buf.is_paged = True
        buf.page_deviceid = p.device.index
        F.fill(buf, 0)
        return buf

    def give(self, t: torch.Tensor) -> None:
        flat = t.view(-1)
        flat.is_paged = True
        flat.page_deviceid = getattr(t, "page_deviceid", None)
        self._free[(t.numel(), t.dtype, flat.page_deviceid)].append(flat)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


_paged_classes: dict[str, type] = {}


def _paged_class(name: str) -> type:
    """bitsandbytes' paged AdamW with its state buffers drawn from a shared PagedPool."""
    if name not in _paged_classes:
        import bitsandbytes as bnb

        base = bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.PagedAdamW

        def get_state_buffer(self, p, dtype=torch.float32):
            # On CPU there is no unified memory: ordinary host tensors, same updates (one warning
            # was given when the optimizer was built, not one per parameter).
            if p.device.type != "cuda" or p.numel() < _PAGED_MIN_NUMEL:
                return torch.zeros_like(p, dtype=dtype, device=p.device)
            return self.paged_pool.take(p, dtype)

        _paged_classes[name] = type(f"Pooled{base.__name__}", (base,), {"get_state_buffer": get_state_buffer})
    return _paged_classes[name]


def is_paged(t: torch.Tensor) -> bool:
    return bool(getattr(t, "is_paged", False))


# ---------------------------------------------------------------------------------------------
# Building


def _fused_devices() -> set[str]:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # the helper is private; these two have had fused AdamW since torch 2.4
        return {"cuda", "cpu"}


MakeOptimizer = Callable[[list[dict]], torch.optim.Optimizer]


def _factory(section: OptimizerSection, device: torch.device) -> MakeOptimizer:
    kw = dict(lr=section.lr, betas=tuple(section.betas), eps=section.eps, weight_decay=section.weight_decay)
    if section.name == "adamw_32bit":
        impl = {"fused": True} if device.type in _fused_devices() else {"foreach": True}
        return lambda groups: torch.optim.AdamW(groups, **kw, **impl)

    import bitsandbytes as bnb

    if section.name == "adamw_8bit":
        return lambda groups: bnb.optim.AdamW8bit(groups, **kw)
    cls = _paged_class(section.name)
    if device.type != "cuda" and section.name not in _warned_cpu_paging:
        _warned_cpu_paging.add(section.name)
        warnings.warn(
            f"optimizer.name {section.name}: paged state needs CUDA unified memory; on {device.type} "
            "the optimizer runs unpaged (same updates, ordinary memory)",
            UserWarning,
            stacklevel=3,
        )
    pool = PagedPool()

    def make(groups):
        opt = cls(groups, **kw)
        opt.paged_pool = pool
        return opt

    return make


def build_optimizer(model: nn.Module, section: OptimizerSection, device: torch.device):
    """One optimizer over all parameters of `model`; weight decay on matrices and embeddings
    (>= 2-D) only, never on norms and biases. With section.in_backward an InBackwardOptimizer."""
    params = list(model.parameters())
    make = _factory(section, device)
    if section.in_backward:
        return InBackwardOptimizer(params, make, section.weight_decay)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": section.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return make(groups)


def set_lr(optimizer, lr: float) -> None:
    """In in_backward mode the update happens during backward, so call this before backward."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class InBackwardOptimizer:
    """Each parameter has its own optimizer, stepped by a post-accumulate-grad hook as soon as
    its gradient is complete; the gradient is freed right after. So the gradients of a large
    embedding and head never coexist, and no full set of gradients is ever held. Frozen
    parameters never accumulate a gradient, so their hooks never fire: LISA needs nothing more.

    step() and zero_grad() are no-ops so the loop reads the same in both modes."""

    def __init__(self, params: list[nn.Parameter], make, weight_decay: float) -> None:
        self.optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self._handles = []
        for p in params:
            wd = weight_decay if p.ndim >= 2 else 0.0
            self.optimizers[p] = make([{"params": [p], "weight_decay": wd}])
            # torch refuses hooks on a tensor that does not require grad, but the hook stays with
            # the tensor: a layer frozen now gets its updates once LISA samples it.
            trains = p.requires_grad
            p.requires_grad_(True)
            self._handles.append(p.register_post_accumulate_grad_hook(self._step_param))
            p.requires_grad_(trains)

    def _step_param(self, p: torch.Tensor) -> None:
        self.optimizers[p].step()
        p.grad = None

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        """A read-only snapshot {param: state} across the per-parameter optimizers."""
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ---------------------------------------------------------------------------------------------
# Moving one parameter's state


def optimizers_of(optimizer) -> list[torch.optim.Optimizer]:
    if isinstance(optimizer, InBackwardOptimizer):
        return list(optimizer.optimizers.values())
    return [optimizer]


def holder(optimizer, p: nn.Parameter) -> torch.optim.Optimizer:
    """The torch Optimizer whose .state holds p's moments."""
    if isinstance(optimizer, InBackwardOptimizer):
        return optimizer.optimizers[p]
    return optimizer


def has_state(optimizer, p: nn.Parameter) -> bool:
    return bool(holder(optimizer, p).state.get(p))


def _is_bnb(opt: torch.optim.Optimizer) -> bool:
    return hasattr(opt, "name2qmap")


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    # A paged tensor is host-addressable unified memory: a plain CPU copy reads it.
    out.copy_(t, non_blocking=pin and t.is_cuda)
    return out


def export_state(optimizer, p: nn.Parameter, *, remove: bool, pin: bool = False) -> dict | None:
    """p's state as host tensors and numbers (code books left out), or None if it has none.
    remove=True takes the state out of the optimizer; a host tensor is then handed over without
    a copy, and paged buffers go back to the pool. pin: page-locked host memory (CUDA only); the
    caller synchronizes before reading the copies."""
    opt = holder(optimizer, p)
    st = opt.state.get(p)
    if not st:
        if remove and p in opt.state:
            del opt.state[p]
        return None
    out = {}
    for k, v in st.items():
        if k in _SHARED_KEYS:
            continue
        if torch.is_tensor(v):
            handover = remove and v.device.type == "cpu" and not is_paged(v) and not pin
            out[k] = v if handover else _host_copy(v, pin)
        else:
            out[k] = v
    if remove:
        _release(opt, st)
        del opt.state[p]
    return out


def drop_state(optimizer, p: nn.Parameter) -> None:
    """Forget p's moments: its next update starts from fresh state, as LISA's paper does."""
    opt = holder(optimizer, p)
    st = opt.state.pop(p, None)
    if st:
        _release(opt, st)


def _release(opt: torch.optim.Optimizer, st: dict) -> None:
    pool = getattr(opt, "paged_pool", None)
    if pool is None:
        return
    for k, v in st.items():
        if k not in _SHARED_KEYS and torch.is_tensor(v) and is_paged(v):
            pool.give(v)


def _group_of(opt: torch.optim.Optimizer, p: nn.Parameter) -> dict:
    for g in opt.param_groups:
        if any(q is p for q in g["params"]):
            return g
    raise KeyError("parameter is not in this optimizer")


def import_state(optimizer, p: nn.Parameter, state: dict, *, copy: bool = False) -> None:
    """Install `state` (as from export_state or a checkpoint) as p's state, each tensor where the
    optimizer would have created it: on p's device, paged again for a paged optimizer on CUDA,
    torch's step on the host unless the group is fused or capturable. copy=True never aliases the
    given tensors (a checkpoint dict may be reused by the caller)."""
    opt = holder(optimizer, p)
    bnb = _is_bnb(opt)
    group = None if bnb else _group_of(opt, p)
    st = {}
    for k, v in state.items():
        if k in _SHARED_KEYS:
            continue
        if not torch.is_tensor(v):
            st[k] = v
            continue
        if bnb and k in ("state1", "state2") and getattr(opt, "is_paged", False) \
                and p.device.type == "cuda" and p.numel() >= _PAGED_MIN_NUMEL:
            buf = opt.get_state_buffer(p, dtype=v.dtype)
            buf.copy_(v.reshape(buf.shape))
            st[k] = buf
            continue
        if not bnb and k == "step" and not (group.get("fused") or group.get("capturable")):
            dev = torch.device("cpu")
        else:
            dev = p.device
        out = v.to(dev, non_blocking=v.is_pinned())
        st[k] = out.clone() if copy and out is v else out
    if bnb and "state1" in st and st["state1"].dtype == torch.uint8:
        if "dynamic" not in opt.name2qmap:
            opt.fill_qmap()
        # Point at the optimizer's own code books, on the device, as init_state does.
        opt.name2qmap["dynamic"] = opt.name2qmap["dynamic"].to(p.device)
        opt.name2qmap["udynamic"] = opt.name2qmap["udynamic"].to(p.device)
        st["qmap1"] = opt.name2qmap["dynamic"]
        st["qmap2"] = opt.name2qmap["udynamic"]
    opt.state[p] = st


# ---------------------------------------------------------------------------------------------
# Accounting


def state_nbytes(state: dict | None) -> int:
    if not state:
        return 0
    return sum(v.numel() * v.element_size() for k, v in state.items()
               if torch.is_tensor(v) and k not in _SHARED_KEYS)


def _resident_tensors(optimizer, device: torch.device) -> Iterator[torch.Tensor]:
    for opt in optimizers_of(optimizer):
        for st in opt.state.values():
            for v in st.values():
                # Paged state is a host-addressable view of unified memory that belongs to the GPU.
                if torch.is_tensor(v) and (v.device.type == device.type or is_paged(v)):
                    yield v


def resident_state_bytes(optimizer, device: torch.device) -> int:
    """Bytes of optimizer state held for the training device, from the tensors themselves;
    shared code books counted once; recycled paged buffers waiting in the pool included."""
    seen: set[tuple] = set()
    total = 0
    for v in _resident_tensors(optimizer, device):
        key = (v.device, v.data_ptr(), v.numel(), v.dtype)
        if v.numel() and key in seen:
            continue
        seen.add(key)
        total += v.numel() * v.element_size()
    pools = {id(pool): pool for opt in optimizers_of(optimizer)
             if (pool := getattr(opt, "paged_pool", None)) is not None}
    return total + sum(pool.nbytes() for pool in pools.values())
