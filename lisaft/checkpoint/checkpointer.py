"""Checkpoints that survive being killed at any moment, and resume that is the same run.

A checkpoint is a folder RUN/checkpoints/step-NNNNNN/ that is complete or absent. What it holds is
the run's components (components.py says how each is stored; `checkpoint_components` in
lisaft/train/session.py says which there are), and one file of its own:

    COMPLETE                    written last: the file list with sizes

It is written into a hidden temporary folder, every file fsynced, then renamed into place, so a
kill leaves either the old set of checkpoints or the new one. Components that write per-unit
files hard-link the ones that did not change from the previous checkpoint.

The checkpointer knows no component: it is handed a name -> component mapping, writes each where
its kind says and loads them in the order given.

Below it, the weights component of a run whose every rank holds the whole model (one process, or
data parallel): weights/, one safetensors file per training unit. A frozen LISA layer does not
change, so its unit file is hard-linked from the previous checkpoint instead of written again:
each checkpoint still holds every file (pruning an older one never breaks a newer one), while the
disk holds each unchanged layer once. And the readers that put a finished checkpoint's weights
into a whole model in one process (generate, tests), whichever weights component wrote them.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lisaft.checkpoint.components import STATE_FILE, STATE_FORMAT, read_components, stored
from lisaft.distributed import dist
from lisaft.errors import CheckpointMismatch, LisaftError, OlderCheckpoint
from lisaft.model.units import Unit, UnitChanges, state_dict_units

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
_PREFIX = "step-"


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders, newest first (complete or not)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
             and p.name[len(_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]), reverse=True)


def is_complete(ckpt: Path) -> tuple[bool, str]:
    marker = ckpt / MARKER
    if not marker.is_file():
        return False, "no completion marker"
    try:
        listing = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False, "unreadable completion marker"
    for rel, size in listing.get("files", {}).items():
        f = ckpt / rel
        if not f.is_file():
            return False, f"{rel} is missing"
        if f.stat().st_size != size:
            return False, f"{rel} has {f.stat().st_size} bytes, expected {size}"
    return True, ""


def complete_checkpoints(run_dir: Path, warn=print) -> list[Path]:
    """Complete checkpoints, newest first; incomplete or corrupt ones newer than the newest
    complete one are named in a warning."""
    found = []
    for ckpt in list_checkpoints(run_dir):
        ok, why = is_complete(ckpt)
        if ok:
            found.append(ckpt)
        elif not found:
            warn(f"skipping checkpoint {ckpt.name}: {why}")
    return found


class Checkpointer:
    """Writes and reads the run's checkpoints: every component, each stored as its kind says."""

    def __init__(self, run_dir: Path, keep_last: int, components: dict[str, Any]) -> None:
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.components = {name: stored(c) for name, c in components.items()}

    def save(self, step: int, base: Path | None) -> Path:
        """Write a complete checkpoint for `step` and prune old ones afterwards. `base` is the
        checkpoint the run continues from (None: nothing to link from). Every rank calls this:
        each component writes that rank's files."""
        root = self.run_dir / CHECKPOINTS
        final = root / step_dir_name(step)
        # No pid in the name: every rank must find the same folder for its own files.
        tmp = root / f".tmp-{step_dir_name(step)}"
        if dist.is_main():
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        state: dict[str, dict] = {}
        written: list[Path] = []
        for name, component in self.components.items():
            written += component.write(name, tmp, base, state)
        if dist.is_main():
            (tmp / STATE_FILE).write_text(json.dumps({"format": STATE_FORMAT, "components": state}, indent=1))
            written.append(tmp / STATE_FILE)
        for f in written:
            _fsync_file(f)
        dist.barrier()
        if dist.is_main():
            _pause_for_tests(tmp)
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            marker = tmp / MARKER
            marker.write_text(json.dumps({"step": step, "files": files}, indent=1))
            _fsync_file(marker)
            for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                _fsync_dir(sub)
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)  # an incomplete leftover of a killed run at the same step
            os.replace(tmp, final)
            _fsync_dir(root)
            prune(self.run_dir, self.keep_last)
        dist.barrier()
        for component in self.components.values():
            component.committed()
        return final

    def load(self, ckpt: Path) -> None:
        """Every component's state, in the order given. Raises OlderCheckpoint, before loading
        anything, when the checkpoint lacks a component that is not optional."""
        state = read_components(ckpt)
        for name, component in self.components.items():
            if not component.optional and not component.present(name, ckpt, state):
                raise OlderCheckpoint(f"{ckpt.name} was written by an older lisaft (no {name} state); it cannot "
                                      "be resumed by this version (docs/resume.md)", name)
        for name, component in self.components.items():
            component.read(name, ckpt, state)


def _pause_for_tests(tmp: Path) -> None:
    """The crash-safety test kills the process here, with every file written but no marker yet:
    the worst moment. Inert unless the variable is set."""
    spec = os.environ.get("LISAFT_TEST_PAUSE_BEFORE_MARKER")  # "STEP:SECONDS"
    if spec and tmp.name == f".tmp-{step_dir_name(int(spec.split(':')[0]))}":
        (tmp.parent / "PAUSED").write_text(tmp.name)
        import time

        time.sleep(float(spec.split(":")[1]))


def prune(run_dir: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` complete checkpoints, and incomplete ones older
    than the newest complete one. Runs only after a new checkpoint is complete."""
    complete = 0
    for ckpt in list_checkpoints(run_dir):
        ok, _ = is_complete(ckpt)
        if ok and complete < keep_last:
            complete += 1
            continue
        if complete:
            shutil.rmtree(ckpt, ignore_errors=True)


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """A finished checkpoint's weights into a whole (unsharded) model, in one process, whichever
    weights component wrote them: the unit files (weights/), or the slices a training.fsdp run
    wrote through torch.distributed.checkpoint (shards/), joined by DCP."""
    if (ckpt / "shards").is_dir():
        read_shards_whole(ckpt / "shards", model)
    else:
        read_unit_weights(ckpt / "weights", model)


ALIASES = "aliases.json"


def split_units(model: torch.nn.Module, units: list[Unit]) -> tuple[dict, dict]:
    """{unit: {name: tensor}} of the model's state dict, and {alias: name} for tied tensors that
    are stored once."""
    unit_of = state_dict_units(model, units)
    by_unit: dict[str, dict[str, torch.Tensor]] = {}
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.shape, tensor.dtype) if tensor.numel() else (name,)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        by_unit.setdefault(unit_of.get(name, units[0].name), {})[name] = tensor
    return by_unit, aliases


class UnitWeights:
    """A checkpoint folder component (components.FolderComponent): <unit>.safetensors for every
    unit and aliases.json (tied tensors stored once), written by rank 0. A unit that did not
    change since this component last saved is hard-linked from the previous checkpoint."""

    def __init__(self, model: torch.nn.Module, units: list[Unit], changes: UnitChanges) -> None:
        self.model = model
        self.units = units
        self.since = changes.since()

    def write(self, folder: Path, base: Path | None) -> list[Path]:
        if not dist.is_main():
            return []
        folder.mkdir(parents=True, exist_ok=True)
        by_unit, aliases = split_units(self.model, self.units)
        written = []
        for unit, tensors in by_unit.items():
            target = folder / f"{unit}.safetensors"
            source = base / target.name if base is not None else None
            if not self.since.changed(unit) and source is not None and source.is_file():
                try:
                    os.link(source, target)
                    continue
                except OSError:
                    pass  # filesystem without hard links: write the file
            cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
            save_file(cpu, str(target), metadata={"unit": unit})
            written.append(target)
        (folder / ALIASES).write_text(json.dumps(aliases))
        return [*written, folder / ALIASES]

    def read(self, folder: Path) -> None:
        read_unit_weights(folder, self.model)
        self.since.saved()

    def committed(self) -> None:
        self.since.saved()


def read_unit_weights(folder: Path, model: torch.nn.Module) -> None:
    """A weights/ folder into the model; raises CheckpointMismatch when it is another model's."""
    aliases_file = folder / ALIASES
    if not aliases_file.is_file():
        aliases_file = folder.parent / ALIASES  # checkpoints before weights/ held it
    aliases = json.loads(aliases_file.read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f), device="cpu"))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if m not in aliases]
    if missing or unexpected:
        raise CheckpointMismatch(f"checkpoint {folder.parent.name} does not match the model: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}")


def read_shards_whole(folder: Path, model: torch.nn.Module) -> None:
    """The slices a training.fsdp run wrote through torch.distributed.checkpoint (shards/), joined
    by DCP into a whole (unsharded) model in one process."""
    if not (folder / ".metadata").is_file():
        raise LisaftError(f"checkpoint {folder.parent.name} holds FSDP shards in the layout before "
                          "torch.distributed.checkpoint (shards/rank-R.safetensors), which only a resume reads")
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group, which is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # In place: each whole tensor is filled from the rows every rank's file holds.
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
