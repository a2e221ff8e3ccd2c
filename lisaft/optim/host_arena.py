"""Host tensors carved from a few large slabs of (pinned) host memory.

PyTorch's pinned-memory cache rounds every allocation up to a power of two, so each 112 MiB MLP
matrix of Llama-3.1-8B pinned on its own takes 128 MiB, and a 436 MB decoder layer pinned as one
buffer 512 MiB. lisaft's optimizer on the CPU (lisaft/optim/cpu_offload.py) pins a copy of every
weight and a gradient accumulator per trainable tensor, so it carves them from slabs whose size
is already a power of two (at least the largest tensor): only each slab's unfilled tail is lost.
`arena_bytes` is the same packing without memory, for the estimator (lisaft/memory/host.py).
"""

from __future__ import annotations

import math

import torch

ALIGN = 64                 # bytes: every tensor starts on a cache line, whatever its dtype
MIN_SLAB_BYTES = 1 << 28   # 256 MiB: few allocations for small tensors


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def slab_size(largest_bytes: int, total_bytes: int) -> int:
    """The power of two that holds the largest tensor; at least MIN_SLAB_BYTES, unless all the
    tensors together need less (a small model takes one small slab)."""
    return max(_pow2(largest_bytes), min(MIN_SLAB_BYTES, _pow2(total_bytes + ALIGN * 64)))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def arena_bytes(sizes: list[int], slab: int) -> int:
    """Host memory `HostArena(slab)` takes for tensors of these byte sizes, taken in this order."""
    slabs, used = 0, slab
    for n in sizes:
        if used + n > slab:
            slabs, used = slabs + 1, 0
        used += _aligned(n)
    return slabs * slab


class HostArena:
    """Tensors taken in order from slabs of `slab` bytes; a tensor that does not fit in the
    current slab's rest opens a new slab. Nothing is given back: what a caller frees, it reuses."""

    def __init__(self, slab: int, pin: bool) -> None:
        self.slab, self.pin = slab, pin
        self._slabs: list[torch.Tensor] = []
        self._used = slab

    def tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        if n > self.slab:
            raise ValueError(f"a tensor of {n} bytes does not fit slabs of {self.slab}")
        if self._used + n > self.slab:
            self._slabs.append(torch.empty(self.slab, dtype=torch.uint8, pin_memory=self.pin))
            self._used = 0
        t = self._slabs[-1][self._used:self._used + n].view(dtype).view(shape)
        self._used += _aligned(n)
        return t

    @property
    def nbytes(self) -> int:
        return len(self._slabs) * self.slab
