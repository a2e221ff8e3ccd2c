"""optimizer.in_backward: each parameter is updated the moment its gradient is complete, and the
gradient freed, so the step never holds more than one parameter's gradient.

The hooks stay registered on every parameter for the whole run; a parameter LISA freezes gets no
gradient and so no update, and one it samples later updates without re-registering.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lisaft.model.units import Unit
from lisaft.optim.unit_optimizers import UnitOptimizers


class GradNorm:
    """The total gradient norm of one step, filled in by the hooks (None when not measured)."""

    def __init__(self, device: torch.device | None) -> None:
        self.sq = torch.zeros((), dtype=torch.float32, device=device) if device is not None else None
        self.value: torch.Tensor | None = None  # read by the step with its other figures


class StepInBackward:
    def __init__(self, units: list[Unit], optimizers: UnitOptimizers) -> None:
        self.optimizers = optimizers
        self._unit_of: dict[torch.Tensor, Unit] = {p: u for u in units for p in u.params}
        self._norm: GradNorm | None = None
        self._hooks = []
        for p in self._unit_of:
            # torch refuses hooks on a tensor that does not require grad, but the hook stays with
            # the tensor: a layer frozen now gets its updates once LISA samples it.
            trains = p.requires_grad
            p.requires_grad_(True)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._step))
            p.requires_grad_(trains)

    @contextmanager
    def step(self, measure_norm: bool) -> Iterator[GradNorm]:
        """Around the step's backward passes: yields the GradNorm the hooks fill in."""
        self._norm = GradNorm(self.optimizers.device if measure_norm else None)
        try:
            yield self._norm
        finally:
            norm, self._norm = self._norm, None
            if norm.sq is not None:
                norm.value = norm.sq.sqrt()

    def _step(self, p: torch.Tensor) -> None:
        unit = self._unit_of[p]
        assert p.grad is not None, "called by the post-accumulate-grad hook"
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
        if self._norm is not None and self._norm.sq is not None:
            g = p.grad.detach()
            self._norm.sq += (g.values() if g.is_sparse else g).float().pow(2).sum()
        self.optimizers.optimizer(unit).step_param(p)
        self.optimizers.changes.bump([unit.name])
        p.grad = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
