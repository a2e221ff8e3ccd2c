"""The unit optimizers' part of a checkpoint: optimizer/<unit>.pt, one file per unit with state.

A unit whose moments did not change since the previous checkpoint is hard-linked from it, and a
unit LISA offloaded to disk is linked from its offload file, so each checkpoint holds every file
while the disk holds each unchanged state once. With sharded data-parallel state each rank writes
and reads the units it owns; under training.fsdp every rank writes its slices of every unit into
optimizer/rank-R/ (`per_rank`, which the parallel strategy sets).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lisaft.checkpoint.reshard import ReshardNotes, read_resharded
from lisaft.checkpoint.run_state import saved_world_size
from lisaft.console import warn
from lisaft.distributed import dist
from lisaft.errors import CheckpointError, CheckpointMismatch
from lisaft.lisa import LisaController
from lisaft.optim.adamw import state_order
from lisaft.optim.unit_optimizers import UnitOptimizers


class OptimizerFiles:
    """A checkpoint folder component (components.FolderComponent) for the unit optimizers."""

    def __init__(self, optimizers: UnitOptimizers, controller: LisaController, per_rank: bool = False) -> None:
        self.optimizers = optimizers
        self.controller = controller
        # training.fsdp: every rank holds state for its slices of every unit, in optimizer/rank-R/.
        self.per_rank = per_rank
        self.since = optimizers.changes.since()

    def _dir(self, folder: Path) -> Path:
        return folder / f"rank-{dist.rank()}" if self.per_rank else folder

    def _saves(self, name: str) -> bool:
        opts = self.optimizers
        if self.per_rank:
            return True
        return opts.owns(opts.units[name]) if opts.owner_per_unit else dist.is_main()

    def write(self, folder: Path, base: Path | None) -> list[Path]:
        """optimizer/<unit>.pt for each unit with state that this rank saves; returns the files
        written (linked ones need no fsync)."""
        opts = self.optimizers
        folder = self._dir(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name in opts.units:
            if not self._saves(name):
                continue
            target = folder / f"{name}.pt"
            linked = self._dir(base) / target.name if base is not None else None
            if not self.since.changed(name) and linked is not None and opts.has_state(name) and _link(linked, target):
                continue
            # An offload file is immutable (a restore reads and removes it): link it as it is.
            offload = opts.offload_file(name)
            if offload is not None and _link(offload, target):
                continue
            sd = opts.host_state(name)
            if sd is None:
                continue
            torch.save(sd, target)
            written.append(target)
        return written

    def committed(self) -> None:
        """The checkpoint just written holds every unit's current state."""
        self.since.saved()

    def read(self, folder: Path) -> None:
        """Replace all state with the checkpoint's: the units LISA keeps resident (the controller
        is loaded first) get optimizers on the device, the others go where lisa.state_policy keeps
        inactive units (nowhere for discard)."""
        opts = self.optimizers
        ckpt = folder.parent
        if self.per_rank and (old_world := saved_world_size(ckpt)) != dist.world_size():
            self._read_resharded(folder, old_world)
            return
        folder = self._dir(folder)
        names = {f.name[:-3] for f in folder.glob("*.pt")} if folder.is_dir() else set()
        self._check_known(names, ckpt)
        opts.clear()
        resident = self.controller.resident_units()
        for name in sorted(names):
            if opts.owns(opts.units[name]):
                sd = read_state_file(folder / f"{name}.pt")
                opts.restore(name, sd, resident=name in resident, policy=self.controller.policy)
        self.since.saved()

    def _check_known(self, names: set[str], ckpt: Path) -> None:
        unknown = sorted(names - set(self.optimizers.units))
        if unknown:
            raise CheckpointMismatch(f"checkpoint {ckpt.name} holds optimizer state for units this model "
                                     f"does not have: {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}")

    def _read_resharded(self, folder: Path, old_world: int) -> None:
        """training.fsdp on another number of ranks than wrote the checkpoint: each unit's state
        for this rank's slices, cut from every old rank's (lisaft/checkpoint/reshard.py)."""
        opts = self.optimizers
        names = {f.name[:-3] for f in folder.glob("rank-*/*.pt")}
        self._check_known(names, folder.parent)
        opts.clear()
        resident = self.controller.resident_units()
        notes = ReshardNotes()
        eight_bit = opts.section.name.endswith("_8bit")
        for name in sorted(names):
            shapes = [p.shape for p in state_order(opts.units[name].params)]
            sd = read_resharded(folder, name, shapes, old_world, dist.world_size(), dist.rank(), eight_bit, notes)
            if sd is not None:
                opts.restore(name, sd, resident=name in resident, policy=self.controller.policy)
        self.since.forget()  # every rank's files are new: none can be linked from this checkpoint
        if notes.requantized and dist.is_main():
            warn(f"the 8-bit optimizer moments of {notes.requantized} tensors were dequantized and quantized "
                 "again for the new slices: their blocks do not line up across the change of ranks "
                 "(docs/distributed.md)")


def _link(source: Path, target: Path) -> bool:
    try:
        os.link(source, target)
        return True
    except OSError:
        return False  # missing, or a filesystem without hard links: write the file


def read_state_file(path: Path) -> dict:
    """One unit's optimizer state. A damaged file says so: torch's own text for a file it cannot
    unpickle advises weights_only=False, which is no fix for a truncated or garbled file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise  # a read error names its file; resume tells it from a damaged checkpoint
    except Exception as e:
        raise CheckpointError(f"{path}: damaged optimizer state file (torch cannot read it: "
                          f"{type(e).__name__})") from None
