"""Checkpoints that survive being killed at any moment, and resume that is the same run.

A checkpoint is a folder RUN/checkpoints/step-NNNNNN/ that is complete or absent:

    weights/<unit>.safetensors  one file per unit (embeddings, head, layer-00012, ...)
    optimizer/<unit>.pt         that unit's optimizer state_dict, for every unit with moments
                                (LISA-offloaded ones included; written by the owning rank when
                                the state is sharded)
    rng-rank<r>.pt              python, numpy, torch and CUDA generator states of each rank
    state.json                  {"components": {name: state_dict}}: every stateful component of
                                the run (progress counters, data order, LISA position, LR plan, ...)
    recipe.json                 the resolved recipe it was trained with (resume compares it)
    COMPLETE                    written last: the file list with sizes and xxh3-64 checksums

It is written into a hidden temporary folder, every file fsynced, then renamed into place, so a
kill leaves either the old set of checkpoints or the new one. A frozen LISA layer does not change,
so its unit file is hard-linked from the previous checkpoint instead of written again, and so is
an optimizer file whose unit did not step (or the file an offloaded unit already sits in): each
checkpoint still holds every file (pruning an older one never breaks a newer one), while the disk
holds each unchanged layer once.

The checkpointer knows no component: it is handed a name -> object mapping of everything with
state (`state_dict()` / `load_state_dict()`, saved in state.json) and of folder components that
write their own files (the unit optimizers: `write(folder, base)` / `read(folder)` /
`committed()`). A new stateful part of a run is one more entry.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lisaft.console import warn
from lisaft.distributed import dist
from lisaft.errors import LisaftError
from lisaft.model.units import Unit, state_dict_units

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
_PREFIX = "step-"


STATE_FORMAT = 2


class Component(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class FolderComponent(Protocol):
    def write(self, folder: Path, base: Path | None) -> list[Path]: ...

    def read(self, folder: Path) -> None: ...

    def committed(self) -> None: ...


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


def _rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def file_checksum(path: Path) -> str:
    """xxh3-64 of a file's bytes: it runs at memory speed, far faster than the disk the file was
    just written to (docs/resume.md gives the cost at 8B)."""
    import xxhash

    h, buf = xxhash.xxh3_64(), bytearray(1 << 24)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _checksums(tmp: Path, paths: list[Path], base: Path | None) -> dict[str, str]:
    """{file: checksum} of a checkpoint being written; a file hard-linked from `base` (a frozen
    LISA layer) keeps base's checksum instead of being read again."""
    known = {}
    if base is not None and (base / MARKER).is_file():
        known = json.loads((base / MARKER).read_text()).get("xxh3_64", {})
    sums = {}
    for p in paths:
        rel = str(p.relative_to(tmp))
        old = base / rel if base is not None else None
        same = rel in known and old is not None and old.is_file() and os.path.samefile(old, p)
        sums[rel] = known[rel] if same else file_checksum(p)
    return sums


def verify_checksums(ckpt: Path) -> None:
    """Raise naming the first file whose bytes differ from those written (a checkpoint written
    before checksums has none to compare)."""
    sums = json.loads((ckpt / MARKER).read_text()).get("xxh3_64", {})
    for rel, expected in sums.items():
        if file_checksum(ckpt / rel) != expected:
            raise LisaftError(f"{rel} does not match the checksum written with it (changed on disk)")


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
    """Writes and reads the run's checkpoints: weights by unit, the components' state, RNG."""

    def __init__(self, run_dir: Path, model: torch.nn.Module, units: list[Unit], keep_last: int,
                 components: dict[str, Component], folders: dict[str, FolderComponent]) -> None:
        self.run_dir = Path(run_dir)
        self.model = model
        self.units = units
        self.keep_last = keep_last
        self.components = components
        self.folders = folders
        # False when a folder component writes the weights itself (training.fsdp: each rank its slice).
        self.unit_weights = True

    def save(self, step: int, changed_units: set[str] | None, base: Path | None,
             extra_files: dict[str, str] | None = None) -> Path:
        """Write a complete checkpoint for `step` and prune old ones afterwards.

        changed_units: units trained since `base` was written (None: everything may have changed);
        the others are hard-linked from `base`. Every rank calls this: each folder component
        writes that rank's files."""
        root = self.run_dir / CHECKPOINTS
        final = root / step_dir_name(step)
        # No pid in the name: every rank must find the same folder for its RNG file.
        tmp = root / f".tmp-{step_dir_name(step)}"
        if dist.is_main():
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if self.unit_weights:
                (tmp / "weights").mkdir()
            for name in self.folders:
                (tmp / name).mkdir()
        dist.barrier()
        written: list[Path] = []
        if dist.is_main():
            if self.unit_weights:
                written += self._write_weights(tmp, changed_units, base)
            for rel, text in (extra_files or {}).items():
                (tmp / rel).write_text(text)
                written.append(tmp / rel)
            state = {"format": STATE_FORMAT,
                     "components": {name: c.state_dict() for name, c in self.components.items()}}
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
            written.append(tmp / "state.json")
        dist.barrier()
        rng_file = tmp / f"rng-rank{dist.rank()}.pt"
        torch.save(_rng_state(), rng_file)
        _fsync_file(rng_file)
        for name, folder in self.folders.items():
            for f in folder.write(tmp / name, base):
                _fsync_file(f)
        dist.barrier()
        if dist.is_main():
            _pause_for_tests(tmp)
            for f in written:
                _fsync_file(f)
            paths = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in paths}
            sums = _checksums(tmp, paths, base)
            marker = tmp / MARKER
            marker.write_text(json.dumps({"step": step, "files": files, "xxh3_64": sums}, indent=1))
            _fsync_file(marker)
            for sub in (*(["weights"] if self.unit_weights else []), *self.folders):
                _fsync_dir(tmp / sub)
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)  # an incomplete leftover of a killed run at the same step
            os.replace(tmp, final)
            _fsync_dir(root)
            prune(self.run_dir, self.keep_last)
        dist.barrier()
        for folder in self.folders.values():
            folder.committed()
        return final

    def _write_weights(self, tmp: Path, changed_units: set[str] | None, base: Path | None) -> list[Path]:
        by_unit, aliases = split_units(self.model, self.units)
        written = []
        for unit, tensors in by_unit.items():
            target = tmp / "weights" / f"{unit}.safetensors"
            source = base / "weights" / f"{unit}.safetensors" if base is not None else None
            if changed_units is not None and unit not in changed_units and source is not None and source.is_file():
                try:
                    os.link(source, target)
                    continue
                except OSError:
                    pass  # filesystem without hard links: write the file
            cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
            save_file(cpu, str(target), metadata={"unit": unit})
            written.append(target)
        (tmp / "aliases.json").write_text(json.dumps(aliases))
        return [*written, tmp / "aliases.json"]

    def load(self, ckpt: Path) -> None:
        """Weights into the model, every component's state, then each folder component's files
        and the RNG states of this rank. Raises on anything that does not match, first on a
        file whose bytes are not those written (checksums in the marker)."""
        verify_checksums(ckpt)
        components = read_components(ckpt)
        missing = [name for name in self.components if name not in components]
        if missing:
            # Before per-unit optimizers there was no LISA position or LR plan in a checkpoint.
            what = "one optimizer for the whole model, " if missing[0] in ("lisa", "schedule") else ""
            raise LisaftError(f"{ckpt.name} was written by an older lisaft ({what}no {missing[0]} state); it "
                              "cannot be resumed by this version (docs/resume.md)")
        if self.unit_weights:
            _load_weights(ckpt, self.model)
        for name, component in self.components.items():
            component.load_state_dict(components[name])
        for name, folder in self.folders.items():
            folder.read(ckpt / name)
        rng_file = ckpt / f"rng-rank{dist.rank()}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            warn(f"{ckpt.name} has no RNG state for rank {dist.rank()}")


def read_components(ckpt: Path) -> dict[str, dict]:
    """{component: state_dict} of a checkpoint's state.json. The first format (one flat record of
    counters, data order, LISA position and LR plan) is read into the same components."""
    raw = json.loads((ckpt / "state.json").read_text())
    if "components" in raw:
        return raw["components"]
    components = {"progress": {k: raw[k] for k in ("step", "tokens_seen", "world_size", "window") if k in raw}}
    for name in ("data", "lisa", "schedule"):
        if raw.get(name):
            components[name] = raw[name]
    return components


def saved_world_size(ckpt: Path) -> int:
    """How many processes wrote the checkpoint (its progress component)."""
    return int(read_components(ckpt).get("progress", {}).get("world_size", 1))


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
    """A checkpoint's weights into a whole (unsharded) model, in one process: the unit files, or
    the slices a training.fsdp run wrote through torch.distributed.checkpoint, joined by DCP."""
    shards = ckpt / "shards"
    if not shards.is_dir():
        _load_weights(ckpt, model)
        return
    if not (shards / ".metadata").is_file():
        raise LisaftError(f"checkpoint {ckpt.name} holds FSDP shards in the layout before "
                          "torch.distributed.checkpoint (shards/rank-R.safetensors), which only a resume reads")
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group, which is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # In place: each whole tensor is filled from the rows every rank's file holds.
        dcp.load(state, storage_reader=dcp.FileSystemReader(shards), no_dist=True)


def _load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    aliases = json.loads((ckpt / "aliases.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted((ckpt / "weights").glob("*.safetensors")):
        tensors.update(load_file(str(f), device="cpu"))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if m not in aliases]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {ckpt} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
