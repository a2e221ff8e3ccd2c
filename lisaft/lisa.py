"""LISA: train γ sampled decoder layers per interval of K steps, plus embeddings and head.

Two parts. `LayerSampler` says which layers interval i trains, as a pure function of
(seed, i, layer count, γ, sampling), so a resumed or data-parallel run needs no saved or communicated
RNG. `LisaController` applies that choice to whole training units (lisaft/optim/unit_optimizers.py): it flips
requires_grad, frees the gradients of frozen parameters, and tells the unit optimizers what
becomes of a deactivated layer's optimizer (lisa.state_policy):

    discard       dropped; a re-sampled layer starts with fresh moments (the paper)
    offload_cpu   its state_dict copied to host memory (pinned on CUDA), restored when sampled again
    offload_disk  written under the run's lisa_offload/, restored likewise, the file removed once read
    keep          left resident, as LMFlow does: optimizer memory creeps toward full fine-tuning

Offloading is exact: a restored layer continues with the same moments and step count it
left with, so offload_cpu, offload_disk and keep train bit-identically.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from torch import nn

from lisaft.config.schema import LisaSection
from lisaft.errors import CheckpointMismatch, LisaftError
from lisaft.model.units import Unit
from lisaft.optim.gradients import grad_nbytes
from lisaft.optim.unit_optimizers import UnitOptimizers

# Separates the sampler's stream from any other user of the same seed (data order, init).
_SAMPLER_DOMAIN = 0x4C495341  # "LISA"


class LayerSampler:
    """Which γ of n layers interval i trains (lisa.sampling).

    uniform: γ layers uniformly without replacement, drawn afresh for each interval (the paper).
        Coverage is left to chance: over a few intervals some layer may never train.
    cyclic: intervals are grouped in cycles of ceil(n/γ); each cycle walks a permutation of the
        layers drawn afresh for the cycle, γ at a time, so every layer trains at least once per
        cycle. When γ does not divide n the cycle's last interval tops up its short slice with
        layers from the start of the same permutation (they train twice in that cycle).
    Either way a pure function of (seed, interval): nothing to save or communicate."""

    def __init__(self, n_layers: int, active_layers: int, seed: int, sampling: str = "uniform") -> None:
        if not 1 <= active_layers <= n_layers:
            raise ValueError(f"need 1 <= active_layers <= n_layers, got {active_layers} of {n_layers}")
        if sampling not in ("uniform", "cyclic"):
            raise ValueError(f"sampling must be uniform or cyclic, got {sampling!r}")
        self.n_layers = n_layers
        self.active_layers = active_layers
        self.sampling = sampling
        # SeedSequence takes non-negative entropy; masking keeps distinct int64 seeds distinct.
        self._seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF

    @property
    def cycle_intervals(self) -> int:
        """Intervals per cycle under cyclic sampling: ceil(n/γ)."""
        return -(-self.n_layers // self.active_layers)

    def active_set(self, interval: int) -> list[int]:
        if interval < 0:
            raise ValueError(f"interval must be >= 0, got {interval}")
        if self.sampling == "cyclic":
            return self._cyclic(interval)
        keys = self._keys(interval, ())
        # The γ smallest of n uniform keys are a uniform γ-subset. Unlike Generator.choice this
        # relies only on PCG64's doubles, whose stream numpy keeps stable across versions.
        chosen = np.argsort(keys, kind="stable")[: self.active_layers]
        return sorted(int(i) for i in chosen)

    def _cyclic(self, interval: int) -> list[int]:
        cycle, slot = divmod(interval, self.cycle_intervals)
        # A second spawn key keeps cycle c's draw apart from uniform's draw for interval c.
        order = np.argsort(self._keys(cycle, (1,)), kind="stable")
        lo = slot * self.active_layers
        chosen = list(order[lo:lo + self.active_layers])
        chosen += list(order[:self.active_layers - len(chosen)])
        return sorted(int(i) for i in chosen)

    def _keys(self, index: int, stream: tuple[int, ...]) -> np.ndarray:
        ss = np.random.SeedSequence([self._seed, int(index)], spawn_key=(_SAMPLER_DOMAIN, *stream))
        return np.random.Generator(np.random.PCG64(ss)).random(self.n_layers)


class LisaController:
    """Owns requires_grad of every parameter and which units are trainable.

    Call activate_for_step(step) before each optimizer step's forward. With lisa.enabled false
    every unit trains, nothing switches, and the statistics read the same."""

    def __init__(self, units: list[Unit], optimizers: UnitOptimizers, section: LisaSection, seed: int,
                 check_agreement: Callable[[int, list[int]], None] | None = None) -> None:
        self.units = units
        self.optimizers = optimizers
        self.enabled = section.enabled
        self.policy = section.state_policy
        self.interval_steps = section.interval_steps
        self._layers = [u for u in units if u.layer is not None]
        n = len(self._layers)
        if self.enabled and section.active_layers == "auto":
            # The set-up resolves auto (lisaft.memory.auto_layers) before building the controller.
            raise LisaftError("lisa.active_layers: auto must be resolved from the memory estimate before "
                              "training starts")
        active = 0 if section.active_layers == "auto" else section.active_layers
        if self.enabled and active > n:
            raise LisaftError(
                f"lisa.active_layers is {active} but the model has only {n} decoder "
                f"layers; set lisa.active_layers to at most {n}"
            )
        self.sampler = (LayerSampler(n, active, seed, section.sampling)
                        if self.enabled and n else None)
        if self.enabled:
            self._always = [u for u in units if u.layer is None and
                            (section.train_embeddings if u.name == "embeddings" else section.train_head)]
        else:
            self._always = list(units)
        self._interval: int | None = None
        self._active: list[int] = []
        self._trainable: list[Unit] = []
        self.last_switch_s = 0.0
        # training.fsdp: called with (interval, layers) at each switch; raises if ranks disagree.
        self.check_agreement = check_agreement

    # -- switching ------------------------------------------------------------------------------

    def activate_for_step(self, step: int) -> bool:
        """Make the set of interval step // K trainable (step counts optimizer steps from 0).
        True at each interval boundary, even when the new draw equals the old set."""
        if self.sampler is None:
            if self._interval is None:
                self._interval = 0
                self._set_trainable(list(range(len(self._layers))))
            return False
        interval = step // self.interval_steps
        if interval == self._interval:
            return False
        t0 = time.perf_counter()
        before = set(self._trainable) if self._interval is not None else set(self.units)
        self._interval = interval
        self._set_trainable(self.sampler.active_set(interval))
        if self.check_agreement is not None:
            self.check_agreement(interval, self._active)
        now = set(self._trainable)
        # Leaving first: their paged buffers are what the entering layers are given.
        for unit in sorted(before - now, key=lambda u: u.index):
            self.optimizers.deactivate(unit, self.policy)
        for unit in self._trainable:
            self.optimizers.activate(unit)
        self.last_switch_s = time.perf_counter() - t0
        return True

    def _set_trainable(self, layers: list[int]) -> None:
        self._active = sorted(layers)
        chosen = {self._layers[i].name for i in self._active} | {u.name for u in self._always}
        self._trainable = [u for u in self.units if u.name in chosen]
        on = {p for u in self._trainable for p in u.params}
        for unit in self.units:
            for p in unit.params:
                p.requires_grad_(p in on)
                if p not in on:
                    p.grad = None

    # -- statistics -----------------------------------------------------------------------------

    @property
    def active_layers(self) -> list[int]:
        return list(self._active)

    @property
    def interval(self) -> int | None:
        return self._interval

    def trainable_units(self) -> list[Unit]:
        return list(self._trainable)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for u in self._trainable for p in u.params]

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters())

    def grad_bytes(self) -> int:
        # Only trainable units hold gradients: a switch frees those of the units it freezes.
        return sum(grad_nbytes(p.grad) for u in self._trainable for p in u.params if p.grad is not None)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"interval": self._interval, "active_layers": self.active_layers}

    def load_state_dict(self, sd: dict) -> None:
        """Restore the interval and its active set. The checkpoint's optimizer files are read after
        this (lisaft/checkpoint/optimizer_files.py), placing moments by `resident_units()`."""
        interval = sd.get("interval")
        if interval is None:
            self._interval, self._active, self._trainable = None, [], []
            return
        if self.sampler is None:
            self._interval = 0
            self._set_trainable(list(range(len(self._layers))))
            return
        active = self.sampler.active_set(int(interval))
        if list(sd.get("active_layers", active)) != active:
            raise CheckpointMismatch(
                f"checkpoint trained layers {sd['active_layers']} in interval {interval}, but "
                f"this recipe samples {active}: training.seed, lisa.active_layers or lisa.sampling "
                "changed"
            )
        self._interval = int(interval)
        self._set_trainable(active)

    def resident_units(self) -> set[str]:
        """Units whose moments a resumed run keeps on the device."""
        if self.policy == "keep" or not self.enabled:
            return {u.name for u in self.units}
        return {u.name for u in self._trainable}
