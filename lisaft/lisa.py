"""LISA: train γ sampled decoder layers per interval of K steps, plus embeddings and head.

Two parts. `LayerSampler` says which layers interval i trains, as a pure function of
(seed, i, layer count, γ), so a resumed or data-parallel run needs no saved or communicated
RNG. `LisaController` applies that choice: it flips requires_grad, frees the gradients of
frozen parameters, and decides what becomes of a deactivated layer's optimizer state
(lisa.state_policy):

    discard       freed; a re-sampled layer starts with fresh moments (the paper)
    offload_cpu   copied to host memory (pinned on CUDA), restored when sampled again
    offload_disk  written under offload_dir, restored likewise, the file removed once read
    keep          left resident, as LMFlow does: optimizer memory creeps toward full fine-tuning

Offloading is exact: a restored layer continues with the same moments and step count it
left with, so offload_cpu, offload_disk and keep train bit-identically.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lisaft import dist, optim
from lisaft.errors import LisaftError
from lisaft.models import ModelParts
from lisaft.recipe import LisaSection

# Separates the sampler's stream from any other user of the same seed (data order, init).
_SAMPLER_DOMAIN = 0x4C495341  # "LISA"


class LayerSampler:
    """γ of n layers, uniformly without replacement, drawn afresh for each interval."""

    def __init__(self, n_layers: int, active_layers: int, seed: int) -> None:
        if not 1 <= active_layers <= n_layers:
            raise ValueError(f"need 1 <= active_layers <= n_layers, got {active_layers} of {n_layers}")
        self.n_layers = n_layers
        self.active_layers = active_layers
        # SeedSequence takes non-negative entropy; masking keeps distinct int64 seeds distinct.
        self._seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF

    def active_set(self, interval: int) -> list[int]:
        if interval < 0:
            raise ValueError(f"interval must be >= 0, got {interval}")
        ss = np.random.SeedSequence([self._seed, int(interval)], spawn_key=(_SAMPLER_DOMAIN,))
        rng = np.random.Generator(np.random.PCG64(ss))
        # The γ smallest of n uniform keys are a uniform γ-subset. Unlike Generator.choice this
        # relies only on PCG64's doubles, whose stream numpy keeps stable across versions.
        keys = rng.random(self.n_layers)
        chosen = np.argsort(keys, kind="stable")[: self.active_layers]
        return sorted(int(i) for i in chosen)


class LisaController:
    """Owns requires_grad of every parameter and the residency of every layer's moments.

    Call activate_for_step(step) before each optimizer step's forward. With lisa.enabled false
    everything trains, nothing switches, and the statistics read the same."""

    def __init__(self, model: nn.Module, parts: ModelParts, section: LisaSection, optimizer,
                 device: torch.device, offload_dir: Path, seed: int) -> None:
        self.model = model
        self.section = section
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.offload_dir = Path(offload_dir)
        self.enabled = section.enabled
        self.policy = section.state_policy
        self.interval_steps = section.interval_steps
        n = len(parts.layers)
        if self.enabled and section.active_layers > n:
            raise LisaftError(
                f"lisa.active_layers is {section.active_layers} but the model has only {n} decoder "
                f"layers; set lisa.active_layers to at most {n}"
            )
        self.sampler = LayerSampler(n, section.active_layers, seed) if self.enabled and n else None

        self._names: dict[nn.Parameter, str] = {p: name for name, p in model.named_parameters()}
        self._by_name = {name: p for p, name in self._names.items()}
        self._layer_params: list[list[nn.Parameter]] = [list(layer.parameters()) for layer in parts.layers]
        self._layer_of = {p: i for i, ps in enumerate(self._layer_params) for p in ps}
        if self.enabled:
            always = (parts.embeddings if section.train_embeddings else []) + \
                     (parts.head if section.train_head else [])
        else:
            always = list(self._names)
        self._always = set(always)

        self._interval: int | None = None
        self._active: list[int] = []
        self._trainable: list[nn.Parameter] = []
        # Offloaded moments, per layer: {param name: {state key: host tensor or number}}.
        self._host: dict[int, dict[str, dict]] = {}
        # Offloaded to disk, per layer: (file, bytes of moments in it).
        self._disk: dict[int, tuple[Path, int]] = {}
        self.last_switch_s = 0.0
        # Files a crashed run of this rank left behind are stale: a resume rewrites what it needs.
        if self.offload_dir.is_dir():
            for stale in self.offload_dir.glob(f"layer-*-rank{dist.rank()}.*"):
                stale.unlink(missing_ok=True)

    # -- switching ------------------------------------------------------------------------------

    def activate_for_step(self, step: int) -> bool:
        """Make the set of interval step // K trainable (step counts optimizer steps from 0).
        True at each interval boundary, even when the new draw equals the old set."""
        if not self.enabled or self.sampler is None:
            if self._interval is None:
                self._interval = 0
                self._set_trainable(set(range(len(self._layer_params))))
            return False
        interval = step // self.interval_steps
        if interval == self._interval:
            return False
        t0 = time.perf_counter()
        new = self.sampler.active_set(interval)
        first = self._interval is None
        old = set(range(len(self._layer_params))) if first else set(self._active)
        self._interval, self._active = interval, new
        self._set_trainable(set(new))
        if self.policy != "keep":
            leaving = sorted(old - set(new))
            entering = sorted(set(new) - old) if not first else new
            # Leaving first: their paged buffers are what the entering layers are given.
            self._sync()
            for i in leaving:
                self._deactivate(i)
            self._sync()
            for i in entering:
                self._reactivate(i)
        self.last_switch_s = time.perf_counter() - t0
        return True

    def _set_trainable(self, layers: set[int]) -> None:
        trainable = set(self._always)
        for i in layers:
            trainable.update(self._layer_params[i])
        for p in self._names:
            on = p in trainable
            p.requires_grad_(on)
            if not on:
                p.grad = None
        self._trainable = [p for p in self._names if p in trainable]

    def _leaving_params(self, i: int) -> list[nn.Parameter]:
        # A parameter shared with an always-trained part keeps its state.
        return [p for p in self._layer_params[i] if not p.requires_grad]

    def _deactivate(self, i: int) -> None:
        params = self._leaving_params(i)
        if self.policy == "discard":
            for p in params:
                optim.drop_state(self.optimizer, p)
            return
        pin = self.device.type == "cuda"
        moved = {}
        for p in params:
            st = optim.export_state(self.optimizer, p, remove=True, pin=pin)
            if st is not None:
                moved[self._names[p]] = st
        if not moved:
            return
        if self.policy == "offload_cpu":
            self._host[i] = moved
        else:
            self._sync()  # pinned copies above may still be in flight
            self._disk[i] = self._write(i, moved)

    def _reactivate(self, i: int) -> None:
        if i in self._host:
            moved = self._host.pop(i)
        elif i in self._disk:
            path, _ = self._disk.pop(i)
            moved = torch.load(path, map_location="cpu", weights_only=True)
            path.unlink()
        else:
            return
        for name, st in moved.items():
            optim.import_state(self.optimizer, self._by_name[name], st)

    def _file(self, i: int) -> Path:
        # Each data-parallel rank offloads its own replica's moments, possibly into a shared folder.
        return self.offload_dir / f"layer-{i:04d}-rank{dist.rank()}.pt"

    def _write(self, i: int, moved: dict) -> tuple[Path, int]:
        self.offload_dir.mkdir(parents=True, exist_ok=True)
        path = self._file(i)
        tmp = path.with_suffix(".tmp")
        torch.save(moved, tmp)
        os.replace(tmp, path)  # a reader never sees half a file
        return path, sum(optim.state_nbytes(st) for st in moved.values())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- statistics -----------------------------------------------------------------------------

    @property
    def active_layers(self) -> list[int]:
        if not self.enabled:
            return list(range(len(self._layer_params)))
        return list(self._active)

    @property
    def interval(self) -> int | None:
        return self._interval

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self._trainable)

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self._trainable)

    def grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self._names if p.grad is not None)

    def state_bytes(self) -> tuple[int, int]:
        resident = optim.resident_state_bytes(self.optimizer, self.device)
        offloaded = sum(optim.state_nbytes(st) for moved in self._host.values() for st in moved.values())
        offloaded += sum(nbytes for _, nbytes in self._disk.values())
        return resident, offloaded

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The sampler position and every moment, resident and offloaded, as host tensors.
        Reading it changes nothing: offloaded files stay where they are."""
        self._sync()
        states: dict[str, dict] = {}
        for p, name in self._names.items():
            st = optim.export_state(self.optimizer, p, remove=False)
            if st is not None:
                states[name] = st
        # On CPU a restored layer trains on the very tensors held here, so a checkpoint written
        # later must not alias them; on CUDA they are copied to the device and stay untouched.
        clone = self.device.type == "cpu"
        for moved in self._host.values():
            for name, st in moved.items():
                states[name] = {k: v.clone() if clone and torch.is_tensor(v) else v for k, v in st.items()}
        for path, _ in self._disk.values():
            states.update(torch.load(path, map_location="cpu", weights_only=True))
        return {
            "enabled": self.enabled,
            "interval": self._interval,
            "active_layers": self.active_layers,
            "state_policy": self.policy,
            "optimizer": states,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore onto freshly built weights-loaded model and optimizer: the active set, then
        each parameter's moments where this policy keeps them (on the device if its layer is
        active or the policy is keep, else host memory or disk; a discard run has none)."""
        unknown = sorted(set(sd.get("optimizer", {})) - set(self._by_name))
        if unknown:
            raise LisaftError(
                f"checkpoint optimizer state names parameters this model does not have: "
                f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}"
            )
        for p in self._names:
            optim.drop_state(self.optimizer, p)
        self._host.clear()
        for path, _ in self._disk.values():
            path.unlink(missing_ok=True)
        self._disk.clear()

        interval = sd.get("interval")
        if interval is None:
            self._interval, self._active = None, []
        elif not self.enabled or self.sampler is None:
            self._interval = 0
            self._set_trainable(set(range(len(self._layer_params))))
        else:
            active = self.sampler.active_set(int(interval))
            if list(sd.get("active_layers", active)) != active:
                raise LisaftError(
                    f"checkpoint trained layers {sd['active_layers']} in interval {interval}, but "
                    f"this recipe samples {active}: training.seed or lisa.active_layers changed"
                )
            self._interval, self._active = int(interval), active
            self._set_trainable(set(active))

        offloaded: dict[int, dict[str, dict]] = {}
        for name, st in sd.get("optimizer", {}).items():
            p = self._by_name[name]
            layer = self._layer_of.get(p)
            resident = p.requires_grad or layer is None or self.policy == "keep" or interval is None
            if resident:
                optim.import_state(self.optimizer, p, st, copy=True)
            elif self.policy != "discard":
                offloaded.setdefault(layer, {})[name] = st
        pin = self.device.type == "cuda"
        for i, moved in offloaded.items():
            if self.policy == "offload_cpu":
                self._host[i] = {name: {k: optim._host_copy(v, pin) if torch.is_tensor(v) else v
                                        for k, v in st.items()} for name, st in moved.items()}
            else:
                self._disk[i] = self._write(i, moved)
