"""Each training unit's optimizer (lisaft/model/units.py says what a unit is).

`UnitOptimizers` keeps each unit's moments in one of three places:

    resident   an optimizer on the training device (a trainable unit, or any unit under `keep`)
    host       its state_dict in host memory, pinned on CUDA (LISA's offload_cpu)
    disk       its state_dict in a file under the run's lisa_offload/ (offload_disk)

and moves whole optimizers between them through state_dict / load_state_dict. A checkpoint holds
one optimizer/<unit>.pt per unit with state, hard-linked from the previous checkpoint (or from
the offload file) when unchanged. With sharded data-parallel state (`owner_per_unit`) each unit
has one owner rank that keeps its moments, steps it and broadcasts its weights; under
training.fsdp each optimizer steps this rank's `slices` of its unit's parameters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from lisaft.config.optimizers import optimizer_kind
from lisaft.config.schema import OptimizerSection
from lisaft.distributed import dist
from lisaft.model.units import Unit, UnitChanges
from lisaft.optim import host_step
from lisaft.optim.adamw import QUANTIZATION_MAP_BYTES, AdamW, PagedPool, Rounding
from lisaft.optim.build import build_unit_optimizer


class Slices(Protocol):
    """The parameters an optimizer steps: this rank's slices under training.fsdp
    (distributed/fsdp.py LocalShards), the parameters themselves otherwise (WholeParams)."""

    @property
    def rank(self) -> int | None:
        """Which slice: part of the rounding noise's key (None: whole tensors)."""

    def local(self, params: list[nn.Parameter]) -> list[nn.Parameter]: ...

    def release_grads(self, params: list[nn.Parameter]) -> None: ...


class WholeParams:
    """Every rank holds and steps whole parameters."""

    rank = None

    def local(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return params

    def release_grads(self, params: list[nn.Parameter]) -> None:
        pass  # the step frees the parameters' own gradients


class UnitOptimizers:
    def __init__(self, units: list[Unit], section: OptimizerSection, device: torch.device,
                 offload_dir: Path, seed: int, owner_per_unit: bool = False, slices: Slices | None = None) -> None:
        self.units = {u.name: u for u in units}
        # training.fsdp: each optimizer steps this rank's slices of its unit, and the rounding
        # noise of a slice differs from every other rank's.
        self.slices = slices if slices is not None else WholeParams()
        self.section = section
        self.device = torch.device(device)
        self.offload_dir = Path(offload_dir)
        self.rounding = Rounding(section.bf16_update, seed, shard=self.slices.rank)
        self.pool = PagedPool() if optimizer_kind(section.name).paged and self.device.type == "cuda" else None
        # training.shard_optimizer_state: one owner rank per unit keeps its moments and steps it.
        self.owner_per_unit = owner_per_unit and dist.world_size() > 1
        self.lr = section.lr
        self.resident: dict[str, AdamW] = {}
        self.host: dict[str, dict] = {}
        self.disk: dict[str, tuple[Path, int]] = {}
        self.changes = UnitChanges()  # every update of a unit (its weights and moments) counts here
        if self.device.type == "cpu":
            params = sum(p.numel() for u in units for p in u.params)
            host_step.note_missing(params, optimizer_kind(section.name).eight_bit)
        # Files a crashed run of this rank left behind are stale: a resume rewrites what it needs.
        if self.offload_dir.is_dir():
            for stale in self.offload_dir.glob("*.pt*"):
                stale.unlink(missing_ok=True)

    # -- ownership ------------------------------------------------------------------------------

    def owns(self, unit: Unit) -> bool:
        """Whether this rank keeps and steps the unit's moments."""
        return not self.owner_per_unit or unit.index % dist.world_size() == dist.rank()

    def owner_of_params(self, units: list[Unit]) -> dict[int, int]:
        return {id(p): u.index % dist.world_size() for u in units for p in u.params}

    # -- residency ------------------------------------------------------------------------------

    def optimizer(self, unit: Unit) -> AdamW:
        """The unit's resident optimizer, created (or restored from host or disk) when missing."""
        opt = self.resident.get(unit.name)
        if opt is None:
            params = self.slices.local(unit.params)
            opt = build_unit_optimizer(params, self.section, self.device, self.rounding,
                                       unit.index, self.pool, layer=unit.layer is not None)
            self._set_group_lr(opt)
            if unit.name in self.host:
                opt.load_state_dict(self.host.pop(unit.name))
            elif unit.name in self.disk:
                path, _ = self.disk.pop(unit.name)
                opt.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
                path.unlink()
            self.resident[unit.name] = opt
        return opt

    def activate(self, unit: Unit) -> None:
        if self.owns(unit):
            self.optimizer(unit)

    def deactivate(self, unit: Unit, policy: str) -> None:
        """Apply LISA's state policy to a unit that leaves the trainable set."""
        opt = self.resident.get(unit.name)
        if policy == "keep" or opt is None:
            return
        del self.resident[unit.name]
        if policy == "discard" or not opt.state:
            opt.release()  # no moments: a checkpoint has no file for the unit to link
            return
        pin = self.device.type == "cuda"
        if pin:
            torch.cuda.synchronize(self.device)  # the last step's kernels wrote these moments
        sd = host_state_dict(opt, pin=pin)
        if pin:
            torch.cuda.synchronize(self.device)  # the pinned copies are complete
        opt.release()
        if policy == "offload_cpu":
            self.host[unit.name] = sd
        else:
            self.disk[unit.name] = (self._write_offload(unit.name, sd), state_dict_bytes(sd))

    def _write_offload(self, name: str, sd: dict) -> Path:
        self.offload_dir.mkdir(parents=True, exist_ok=True)
        path = self.offload_dir / f"{name}.pt"
        tmp = path.with_suffix(".pt.tmp")
        torch.save(sd, tmp)
        os.replace(tmp, path)  # a reader never sees half a file
        return path

    # -- stepping -------------------------------------------------------------------------------

    def set_lr(self, lr: float, step: int) -> None:
        """Before backward: with in_backward the updates run inside it."""
        self.lr = lr
        self.rounding.step = step
        for opt in self.resident.values():
            self._set_group_lr(opt)

    def _set_group_lr(self, opt: AdamW) -> None:
        for group in opt.param_groups:
            group["lr"] = self.lr

    def step(self, units: list[Unit]) -> None:
        """Update the trainable units (this rank's share when sharded), then free every
        gradient; with sharded state each owner sends its units' new weights to every rank."""
        # Every rank counts every unit: an owner's update reaches the others' weights below.
        self.changes.bump(u.name for u in units)
        for unit in units:
            if self.owns(unit):
                self.optimizer(unit).step()
            for p in unit.params:
                p.grad = None
            self.slices.release_grads(unit.params)
        if self.owner_per_unit:
            params = [p for u in units for p in u.params]
            dist.broadcast_from_owners(params, self.owner_of_params(units))

    def wait(self) -> None:
        """Every update has reached the training device's weights. Device optimizers step
        synchronously; the CPU step of optimizer.cpu_offload (lisaft/optim/cpu_offload.py) may still be
        running when the loop wants to read weights outside a forward."""

    # -- statistics -----------------------------------------------------------------------------

    def state_bytes(self) -> tuple[int, int]:
        """(optimizer state held for the training device, state offloaded to host or disk)."""
        resident = sum(opt.resident_bytes() for opt in self.resident.values())
        if any(v.dtype == torch.uint8 for opt in self.resident.values() for st in opt.state.values()
               for v in st.values() if torch.is_tensor(v)):
            resident += QUANTIZATION_MAP_BYTES  # shared by every 8-bit moment
        if self.pool is not None:
            resident += self.pool.nbytes()
        offloaded = sum(state_dict_bytes(sd) for sd in self.host.values())
        offloaded += sum(nbytes for _, nbytes in self.disk.values())
        return resident, offloaded

    # -- what a checkpoint reads and restores (lisaft/checkpoint/optimizer_files.py) ------------------------

    def has_state(self, name: str) -> bool:
        opt = self.resident.get(name)
        return bool(opt is not None and opt.state) or name in self.host or name in self.disk

    def offload_file(self, name: str) -> Path | None:
        return self.disk[name][0] if name in self.disk else None

    def host_state(self, name: str) -> dict | None:
        """The unit's optimizer state_dict in host memory, wherever it lives; None without state."""
        if name in self.host:
            return self.host[name]
        if name in self.disk:
            return torch.load(self.disk[name][0], map_location="cpu", weights_only=True)
        opt = self.resident.get(name)
        if opt is None or not opt.state:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return host_state_dict(opt)

    def clear(self) -> None:
        """Forget every unit's state, wherever it is held."""
        for opt in self.resident.values():
            opt.release()
        self.resident.clear()
        self.host.clear()
        for path, _ in self.disk.values():
            path.unlink(missing_ok=True)
        self.disk.clear()

    def restore(self, name: str, sd: dict, resident: bool, policy: str) -> None:
        """Install a checkpoint's state for one unit: on the device, or where `policy` keeps an
        inactive unit's moments (nowhere for discard). Call after clear()."""
        if resident:
            self.optimizer(self.units[name]).load_state_dict(sd)
        elif policy == "offload_cpu":
            self.host[name] = _pinned(sd) if self.device.type == "cuda" else sd
        elif policy == "offload_disk":
            self.disk[name] = (self._write_offload(name, sd), state_dict_bytes(sd))


def _pinned(sd: dict) -> dict:
    pin = lambda v: v.pin_memory() if torch.is_tensor(v) else v  # noqa: E731
    return {"state": {i: {k: pin(v) for k, v in st.items()} for i, st in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def host_state_dict(opt: torch.optim.Optimizer, pin: bool = False) -> dict:
    """opt.state_dict() with every tensor copied to host memory (pinned on request): what an
    offloaded or checkpointed unit keeps. The caller synchronizes before reading pinned copies."""
    sd = opt.state_dict()

    def host(v):
        if not torch.is_tensor(v):
            return v
        out = torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
        # A paged tensor is host-addressable unified memory: a plain CPU copy reads it.
        out.copy_(v, non_blocking=pin and v.is_cuda)
        return out

    return {"state": {i: {k: host(v) for k, v in st.items()} for i, st in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def state_dict_bytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values()
               if torch.is_tensor(v))
