"""Measuring what a training step really holds: the activations autograd keeps for backward,
the tensor bytes of weights, gradients and optimizer state, and the process or allocator peak.

These are the "measured" side of the estimator's estimated-vs-measured table and of
benchmarks/memory_accuracy.py; they never change what they measure.
"""

from __future__ import annotations

import resource
import sys
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> tuple[int, int, str]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes(), str(t.device))


def _held() -> bool:
    return True


@dataclass
class SavedTensorMeter:
    """Bytes of distinct storages saved for backward while the context was open and still held
    when it closed.

    A view shares its base's storage, so storages are counted once each, whole. Parameters
    (and anything passed as `exclude`) are not activations and are skipped. A tensor saved by a
    graph branch the forward then dropped (DoRA's B A built through an identity matrix, for its
    detached weight norm) is freed before backward: `settle` forgets it, and its memory, which a
    later tensor may reuse, is counted only for what holds it at the end. (A dropped branch's saved
    output stays counted: it and its graph node hold each other until backward frees them.)"""

    exclude: set = field(default_factory=set)
    storages: dict = field(default_factory=dict)  # key: weak references to the tensors saved in it

    @property
    def bytes(self) -> int:
        return sum(nbytes for (_, nbytes, _) in self.storages)

    def add(self, t: torch.Tensor, held: bool = False) -> None:
        """`held`: kept whatever happens to `t` (a checkpoint's input, held by the checkpoint)."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            key = _storage_key(t)
        except (RuntimeError, NotImplementedError):  # sparse or wrapper subclasses: no storage
            return
        if key[0] in self.exclude or key[1] == 0:
            return
        refs = self.storages.setdefault(key, [])
        refs.append(_held if held else weakref.ref(t))

    def settle(self) -> None:
        """Forget the storages no saved tensor holds any more (called when the context closes)."""
        self.storages = {k: refs for k, refs in self.storages.items() if any(r() is not None for r in refs)}


@contextmanager
def saved_activations(model: nn.Module | None = None) -> Iterator[SavedTensorMeter]:
    """Count the activation bytes a forward pass leaves for backward.

    Use around the forward (and the loss) only:

        with saved_activations(model) as meter:
            loss = model(**batch).loss
        meter.bytes

    With non-reentrant gradient checkpointing the checkpointed layers save nothing through
    these hooks; what they keep is each layer's input, held by the checkpoint itself. When
    `model` is given and checkpointing is on, those layer inputs are counted too (through
    forward pre-hooks on modules that checkpoint), so the figure stays the true resident total.
    """
    meter = SavedTensorMeter()
    handles = []
    if model is not None:
        meter.exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
        meter.exclude |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False) and getattr(module, "training", False):
                def pre_hook(mod, args, kwargs):
                    # The checkpoint keeps the input whenever the layer is on the graph: the
                    # input needs a gradient, or the layer's own weights do.
                    hidden = args[0] if args else kwargs.get("hidden_states")
                    if isinstance(hidden, torch.Tensor) and torch.is_grad_enabled() and (
                            hidden.requires_grad or any(p.requires_grad for p in mod.parameters())):
                        meter.add(hidden, held=True)
                handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def pack(t: torch.Tensor) -> torch.Tensor:
        meter.add(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield meter
    finally:
        for h in handles:
            h.remove()
        meter.settle()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages among `tensors` (shared storage counted once)."""
    seen: dict = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen[_storage_key(t)] = True
    return sum(nbytes for (_, nbytes, _) in seen)


def weight_bytes(model: nn.Module) -> int:
    return tensor_bytes(list(model.parameters()) + list(model.buffers()))


def grad_bytes(model: nn.Module) -> int:
    return tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Tensor bytes of every optimizer state entry (moments, 8-bit state, absmax, qmaps, step).
    bitsandbytes shares its quantization maps between parameters; storages count once."""
    tensors: list[torch.Tensor] = []
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensor_bytes(tensors)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far. ru_maxrss is KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class PeakMemory:
    rss_bytes: int
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None


def peak_memory(device: torch.device | str | None = None) -> PeakMemory:
    """Process peak RSS, and the CUDA allocator's peaks when `device` is a CUDA device.

    The CUDA figures do not include the CUDA context nor bitsandbytes' paged optimizer state,
    which lives in unified memory outside PyTorch's allocator (see docs/memory.md)."""
    out = PeakMemory(rss_bytes=peak_rss_bytes())
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        out.cuda_allocated_bytes = int(torch.cuda.max_memory_allocated(dev))
        out.cuda_reserved_bytes = int(torch.cuda.max_memory_reserved(dev))
    return out


def nvml_used_bytes(device: torch.device | str) -> int | None:
    """Memory in use on the whole device as NVML (nvidia-smi) reports it: every process's, the
    CUDA context, kernel images and resident paged state included. None off CUDA or without
    nvidia-ml-py."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.device_memory_used(dev))
    except Exception:  # nvidia-ml-py missing, or NVML unusable in this container
        return None


def memory_counters(device: torch.device | str) -> dict:
    """The counters a train record carries, each named for what it counts. `peak_memory_bytes`
    is torch's peak allocated on CUDA (tensors only) and the process's peak RSS on CPU;
    `peak_memory_counter` says which."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return {
            "peak_memory_bytes": int(torch.cuda.max_memory_allocated(dev)),
            "peak_memory_counter": "torch_max_allocated",
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(dev)),
            "nvml_used_bytes": nvml_used_bytes(dev),
        }
    return {"peak_memory_bytes": peak_rss_bytes(), "peak_memory_counter": "process_peak_rss"}
