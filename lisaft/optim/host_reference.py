"""The host kernel's math (lisaft/optim/host_kernel.py) in plain torch, operation for operation.

It is the oracle the tests hold the kernel to (within an ulp on every CPU: docs/memory.md), and
the step for bfloat16 moments where numba cannot load (today's torch path has no bf16 moments).
It makes a float32 copy of each array and several passes, so it is several times slower than the
kernel."""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
BLOCK = 256


def counter_hash(idx: torch.Tensor, k1: int, k2: int) -> torch.Tensor:
    """host_kernel._hash on int64 counters; 32-bit results in int64 (products wrap, the low 32
    bits are exact)."""
    h = (((idx + k1) & M32) * 0x9E3779B1 & M32) ^ k2
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def to_bf16(x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """float32 -> bfloat16: stochastic with 16 bits of noise, else round to nearest even."""
    if noise is None:
        return x.to(torch.bfloat16)
    b = (x.view(torch.int32).to(torch.int64) & M32) + (noise & 0xFFFF)
    b = ((b & M32) >> 16).to(torch.int32)  # 16-bit patterns, as int32
    return b.to(torch.int16).view(torch.bfloat16)


def adam(w, g, m, v, s: list[float]):
    w = w * s[0]
    m = m * s[1] + g * s[2]
    v = v * s[3] + (g * s[4]) * g
    w = w - s[5] * (m / (torch.sqrt(v) * s[6] + s[7]))
    return w, m, v


def _write(dst: torch.Tensor, x: torch.Tensor, noise: torch.Tensor | None) -> None:
    dst.copy_(to_bf16(x, noise) if dst.dtype == torch.bfloat16 else x)


def step_dense(w, g, m, v, s, offset: int, k1: int, k2: int, stochastic: bool) -> None:
    """As host_kernel.step_dense, on torch tensors (1-D views)."""
    idx = torch.arange(offset, offset + w.numel(), dtype=torch.int64)
    h = counter_hash(idx, k1, k2)
    wi, mi, vi = adam(w.float(), g.float(), m.float(), v.float(), s)
    _write(w, wi, h if stochastic else None)
    _write(m, mi, h >> 16)
    _write(v, vi, counter_hash(idx, k2, k1))


def nearest_code(code: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The nearest entry's index, ties to the lower entry, as host_kernel._nearest."""
    j = (torch.searchsorted(code, x, right=True) - 1).clamp(0, 255)
    up = (j + 1).clamp(max=255)
    take_up = (j < 255) & ((code[up] - x) < (x - code[j]))
    return torch.where(take_up, up, j).to(torch.uint8)


def step_8bit(w, g, qm, qv, am, av, code1, code2, s, offset: int, k1: int, k2: int, stochastic: bool) -> None:
    n = w.numel()
    blocks = -(-n // BLOCK)
    pad = blocks * BLOCK - n
    mi = code1[qm.long()] * am.repeat_interleave(BLOCK)[:n]
    vi = code2[qv.long()] * av.repeat_interleave(BLOCK)[:n]
    wi, mi, vi = adam(w.float(), g.float(), mi, vi, s)
    idx = torch.arange(offset, offset + n, dtype=torch.int64)
    _write(w, wi, counter_hash(idx, k1, k2) if stochastic else None)
    for q, a, x, code in ((qm, am, mi, code1), (qv, av, vi, code2)):
        amax = torch.nn.functional.pad(x.abs(), (0, pad)).view(blocks, BLOCK).amax(dim=1)
        r = torch.where(amax > 0, 1 / amax, torch.ones_like(amax))
        q.copy_(nearest_code(code, x * r.repeat_interleave(BLOCK)[:n]))
        a.copy_(amax)
