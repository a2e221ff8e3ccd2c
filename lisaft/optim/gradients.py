"""Gradients across a unit or a step: the total norm and clipping, and the bytes a gradient holds."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from lisaft import internals


def _grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients present, a sparse one (coalesced) by its values."""
    return [g.values() if g.is_sparse else g for g in (p.grad for p in params) if g is not None]


def _total(norms: Sequence[tuple[torch.dtype, torch.Tensor]]) -> torch.Tensor:
    """The L2 norm of per-tensor norms, stacked grouped by dtype in first-seen order: the order
    clip_grad_norm's one multi-tensor kernel per dtype gives them."""
    by_dtype = defaultdict(list)
    for dtype, n in norms:
        by_dtype[dtype].append(n)
    return torch.linalg.vector_norm(torch.stack([n for ns in by_dtype.values() for n in ns]))


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float | None) -> float:
    """The total L2 norm of the gradients before clipping; with max_norm, the gradients are
    scaled by min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ does. A sparse
    gradient (coalesced) counts by its values."""
    return float(clip_grad_total(params, max_norm))


def clip_grad_total(params: Sequence[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """clip_grad_norm's norm, a 0-dim float32 tensor where the gradients are, not read by the
    host (the training step reads it with its other figures)."""
    grads = _grads(params)
    if not grads:
        return torch.zeros(())
    by_dtype = defaultdict(list)
    for g in grads:
        by_dtype[g.dtype].append(g)
    # One multi-tensor kernel per dtype, not a launch per tensor.
    total = _total([(dtype, n) for dtype, gs in by_dtype.items() for n in internals.foreach_norm(gs)])
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for dtype, gs in by_dtype.items():
            internals.foreach_mul_(gs, coef.to(dtype))
    return total


def tensor_norms(params: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, torch.Tensor]]:
    """Each gradient's L2 norm (sparse: coalesced, by its values) with its dtype, in params'
    order: a unit stepped before the others were ready leaves these, and `total_norm` over all
    units' lists in order is clip_grad_norm's norm bit for bit."""
    return [(g.dtype, n) for g in _grads(params) for n in internals.foreach_norm([g])]


def total_norm(norms: Sequence[tuple[torch.dtype, torch.Tensor]]) -> float:
    """clip_grad_norm's total from tensor_norms' lists."""
    return float(_total(norms)) if norms else 0.0


def grad_nbytes(g: torch.Tensor) -> int:
    if hasattr(g, "to_local"):  # training.fsdp: the slice this rank holds
        g = g.to_local()
    if g.is_sparse:
        values, indices = internals.sparse_sizes(g)
        return values * g.element_size() + indices * 8
    return g.numel() * g.element_size()
