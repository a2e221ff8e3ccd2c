"""Training units and their optimizers.

A unit is what LISA switches, what a checkpoint stores as one weights file, and what owns one
optimizer: the embeddings (everything below the first decoder layer), each decoder layer, and the
head (output projection and final norm; a head tied to the input embedding belongs to the
embeddings). `UnitOptimizers` keeps each unit's moments in one of three places:

    resident   an optimizer on the training device (a trainable unit, or any unit under `keep`)
    host       its state_dict in host memory, pinned on CUDA (LISA's offload_cpu)
    disk       its state_dict in a file under the run's lisa_offload/ (offload_disk)

and moves whole optimizers between them through state_dict / load_state_dict. A checkpoint holds
one optimizer/<unit>.pt per unit with state, hard-linked from the previous checkpoint (or from
the offload file) when unchanged. With sharded data-parallel state each unit has one owner rank
that keeps its moments, steps it and broadcasts its weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lisaft import dist
from lisaft.errors import LisaftError
from lisaft.models import ModelParts
from lisaft.optim import (
    AdamW, PagedPool, Rounding, build_unit_optimizer, host_state_dict, state_dict_bytes,
)
from lisaft.recipe import OptimizerSection

# The two 256-entry float32 code books every 8-bit moment shares (counted once, as resident).
_CODE_BOOK_BYTES = 2 * 256 * 4


def layer_unit(index: int) -> str:
    return f"layer-{index:05d}"


@dataclass(eq=False)  # hashed by identity: sets of units
class Unit:
    name: str                      # also the checkpoint's file names: weights/<name>.safetensors
    index: int                     # position from the bottom: embeddings 0, layers 1..n, head n+1
    params: list[nn.Parameter]
    layer: int | None = None       # decoder-layer index, None for embeddings and head


def model_units(parts: ModelParts) -> list[Unit]:
    units = [Unit("embeddings", 0, list(parts.embeddings))]
    units += [Unit(layer_unit(i), i + 1, list(layer.parameters()), i) for i, layer in enumerate(parts.layers)]
    units.append(Unit("head", len(units), list(parts.head)))
    return [u for u in units if u.params]


class UnitOptimizers:
    def __init__(self, units: list[Unit], section: OptimizerSection, device: torch.device,
                 offload_dir: Path, seed: int, shard: bool = False) -> None:
        self.units = {u.name: u for u in units}
        self.section = section
        self.device = torch.device(device)
        self.offload_dir = Path(offload_dir)
        self.rounding = Rounding(section.bf16_update, seed)
        self.pool = PagedPool() if section.name.startswith("paged_") and self.device.type == "cuda" else None
        self.shard = shard and dist.world_size() > 1
        self.lr = section.lr
        self.resident: dict[str, AdamW] = {}
        self.host: dict[str, dict] = {}
        self.disk: dict[str, tuple[Path, int]] = {}
        self.dirty: set[str] = set()          # state changed since the last checkpoint
        self.grad_sq: torch.Tensor | None = None  # in-backward gradient norm², when measured
        self._unit_of = {p: u for u in units for p in u.params}
        self._hooks = []
        if section.in_backward:
            self._register_hooks()
        # Files a crashed run of this rank left behind are stale: a resume rewrites what it needs.
        if self.offload_dir.is_dir():
            for stale in self.offload_dir.glob("*.pt*"):
                stale.unlink(missing_ok=True)

    # -- ownership ------------------------------------------------------------------------------

    def owns(self, unit: Unit) -> bool:
        """Whether this rank keeps and steps the unit's moments."""
        return not self.shard or unit.index % dist.world_size() == dist.rank()

    def owner_of_params(self, units: list[Unit]) -> dict[int, int]:
        return {id(p): u.index % dist.world_size() for u in units for p in u.params}

    # -- residency ------------------------------------------------------------------------------

    def optimizer(self, unit: Unit) -> AdamW:
        """The unit's resident optimizer, created (or restored from host or disk) when missing."""
        opt = self.resident.get(unit.name)
        if opt is None:
            opt = build_unit_optimizer(unit.params, self.section, self.device, self.rounding,
                                       unit.index, self.pool)
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
            self.dirty.add(unit.name)
            opt.release()
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
        for unit in units:
            if self.owns(unit):
                self.optimizer(unit).step()
                self.dirty.add(unit.name)
            for p in unit.params:
                p.grad = None
        if self.shard:
            params = [p for u in units for p in u.params]
            dist.broadcast_from_owners(params, self.owner_of_params(units))

    def _register_hooks(self) -> None:
        for p, unit in self._unit_of.items():
            # torch refuses hooks on a tensor that does not require grad, but the hook stays with
            # the tensor: a layer frozen now gets its updates once LISA samples it.
            trains = p.requires_grad
            p.requires_grad_(True)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._step_in_backward))
            p.requires_grad_(trains)

    def _step_in_backward(self, p: torch.Tensor) -> None:
        unit = self._unit_of[p]
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
        if self.grad_sq is not None:
            g = p.grad.detach()
            self.grad_sq += (g.values() if g.is_sparse else g).float().pow(2).sum()
        self.optimizer(unit).step_param(p)
        self.dirty.add(unit.name)
        p.grad = None

    # -- statistics -----------------------------------------------------------------------------

    def state_bytes(self) -> tuple[int, int]:
        """(optimizer state held for the training device, state offloaded to host or disk)."""
        resident = sum(opt.resident_bytes() for opt in self.resident.values())
        if any(v.dtype == torch.uint8 for opt in self.resident.values() for st in opt.state.values()
               for v in st.values() if torch.is_tensor(v)):
            resident += _CODE_BOOK_BYTES
        if self.pool is not None:
            resident += self.pool.nbytes()
        offloaded = sum(state_dict_bytes(sd) for sd in self.host.values())
        offloaded += sum(nbytes for _, nbytes in self.disk.values())
        return resident, offloaded

    # -- checkpoints ----------------------------------------------------------------------------

    def _saves(self, unit: Unit) -> bool:
        return self.owns(unit) if self.shard else dist.is_main()

    def write_checkpoint(self, folder: Path, base: Path | None) -> list[Path]:
        """optimizer/<unit>.pt for each unit with state that this rank saves. A unit unchanged
        since `base` is hard-linked from it, an offloaded one from its offload file."""
        written = []
        for name, unit in self.units.items():
            if not self._saves(unit):
                continue
            target = folder / f"{name}.pt"
            previous = base / "optimizer" / f"{name}.pt" if base is not None else None
            if name not in self.dirty and previous is not None and self._has_state(name) \
                    and _link(previous, target):
                continue
            # An offload file is immutable (a restore reads and removes it): link it as it is.
            if name in self.disk and _link(self.disk[name][0], target):
                continue
            sd = self._host_state(name)
            if sd is None:
                continue
            torch.save(sd, target)
            written.append(target)
        return written

    def _has_state(self, name: str) -> bool:
        opt = self.resident.get(name)
        return bool(opt is not None and opt.state) or name in self.host or name in self.disk

    def _host_state(self, name: str) -> dict | None:
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

    def saved(self) -> None:
        """The checkpoint just written holds every unit's current state."""
        self.dirty.clear()

    def load_checkpoint(self, folder: Path, resident: set[str], policy: str) -> None:
        """Replace all state with a checkpoint's: units in `resident` get optimizers on the
        device, the others go where `policy` keeps inactive units (nowhere for discard)."""
        names = {f.name[:-3] for f in folder.glob("*.pt")} if folder.is_dir() else set()
        unknown = sorted(names - set(self.units))
        if unknown:
            raise LisaftError(f"checkpoint {folder.parent.name} holds optimizer state for units this model "
                              f"does not have: {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}")
        for opt in self.resident.values():
            opt.release()
        self.resident.clear()
        self.host.clear()
        for path, _ in self.disk.values():
            path.unlink(missing_ok=True)
        self.disk.clear()
        pin = self.device.type == "cuda"
        for name in sorted(names):
            unit = self.units[name]
            if not self.owns(unit):
                continue
            sd = torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=True)
            if name in resident:
                self.optimizer(unit).load_state_dict(sd)  # a fresh one: all state was cleared above
            elif policy == "offload_cpu":
                self.host[name] = _pinned(sd) if pin else sd
            elif policy == "offload_disk":
                self.disk[name] = (self._write_offload(name, sd), state_dict_bytes(sd))
        self.dirty.clear()


def _pinned(sd: dict) -> dict:
    pin = lambda v: v.pin_memory() if torch.is_tensor(v) else v  # noqa: E731
    return {"state": {i: {k: pin(v) for k, v in st.items()} for i, st in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def _link(source: Path, target: Path) -> bool:
    try:
        os.link(source, target)
        return True
    except OSError:
        return False  # missing, or a filesystem without hard links: write the file
