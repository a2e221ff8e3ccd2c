"""Checkpoints that survive being killed at any moment, and resume that is the same run.

A checkpoint is a folder RUN/checkpoints/step-NNNNNN/ that is complete or absent:

    weights/<unit>.safetensors  one file per unit (embeddings, head, layer-00012, ...)
    optimizer/<unit>.pt         that unit's optimizer state_dict, for every unit with moments
                                (LISA-offloaded ones included; written by the owning rank when
                                the state is sharded)
    rng-rank<r>.pt              python, numpy, torch and CUDA generator states of each rank
    state.json                  TrainState: step, counters, data order, logging window
    recipe.json                 the resolved recipe it was trained with (resume compares it)
    COMPLETE                    written last: the file list with sizes

It is written into a hidden temporary folder, every file fsynced, then renamed into place, so a
kill leaves either the old set of checkpoints or the new one. A frozen LISA layer does not change,
so its unit file is hard-linked from the previous checkpoint instead of written again, and so is
an optimizer file whose unit did not step (or the file an offloaded unit already sits in): each
checkpoint still holds every file (pruning an older one never breaks a newer one), while the disk
holds each unchanged layer once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lisaft import dist
from lisaft.units import layer_unit

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
_PREFIX = "step-"


@dataclass
class TrainState:
    """Progress saved with every checkpoint (everything the loop needs besides tensors)."""

    step: int = 0                     # optimizer steps completed
    tokens_seen: int = 0              # global non-padding tokens trained on
    data: dict = field(default_factory=dict)       # DataOrder.state_dict()
    window: dict = field(default_factory=dict)     # partial logging window (loss sums)
    recipe_digest: str = ""
    world_size: int = 1
    elapsed_s: float = 0.0
    lisa: dict = field(default_factory=dict)       # LisaController.state_dict(): interval, layers
    schedule: dict = field(default_factory=dict)   # schedules.Plan: the LR curve being followed


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


def unit_of(name: str, layers_prefix: str, head_names: set[str]) -> str:
    """The checkpoint unit a state-dict entry belongs to."""
    if name.startswith(layers_prefix):
        return layer_unit(int(name[len(layers_prefix):].split(".", 1)[0]))
    return "head" if name in head_names else "embeddings"


def split_units(model: torch.nn.Module, layers_path: str, head_params: list) -> tuple[dict, dict]:
    """{unit: {name: tensor}} of the model's state dict, and {alias: name} for tied tensors that
    are stored once."""
    head_ids = {id(p) for p in head_params}
    head_names = {n for n, p in model.named_parameters() if id(p) in head_ids}
    units: dict[str, dict[str, torch.Tensor]] = {}
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.shape, tensor.dtype) if tensor.numel() else (name,)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        units.setdefault(unit_of(name, layers_path + ".", head_names), {})[name] = tensor
    return units, aliases


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


def save_checkpoint(
    run_dir: Path,
    state: TrainState,
    model: torch.nn.Module,
    layers_path: str,
    head_params: list,
    write_optimizer: Callable[[Path, Path | None], list[Path]],
    changed_units: set[str] | None,
    base: Path | None,
    keep_last: int,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write a complete checkpoint for `state.step` and prune old ones afterwards.

    changed_units: units trained since `base` was written (None: everything may have changed).
    Units outside it are hard-linked from `base`. write_optimizer(folder, base) runs on every
    rank and writes that rank's optimizer/<unit>.pt files, returning those it wrote.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / step_dir_name(state.step)
    # No pid in the name: every rank must find the same folder for its RNG file.
    tmp = root / f".tmp-{step_dir_name(state.step)}"
    rank = dist.rank()
    if dist.is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "weights").mkdir(parents=True)
        (tmp / "optimizer").mkdir()
    dist.barrier()
    written: list[Path] = []
    if dist.is_main():
        units, aliases = split_units(model, layers_path, head_params)
        for unit, tensors in units.items():
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
        for rel, text in (extra_files or {}).items():
            (tmp / rel).write_text(text)
            written.append(tmp / rel)
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=1))
        written += [tmp / "aliases.json", tmp / "state.json"]
    dist.barrier()
    rng_file = tmp / f"rng-rank{rank}.pt"
    torch.save(_rng_state(), rng_file)
    _fsync_file(rng_file)
    for f in write_optimizer(tmp / "optimizer", base):
        _fsync_file(f)
    dist.barrier()
    if dist.is_main():
        _pause_for_tests(tmp)
        for f in written:
            _fsync_file(f)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        marker = tmp / MARKER
        marker.write_text(json.dumps({"step": state.step, "files": files}, indent=1))
        _fsync_file(marker)
        _fsync_dir(tmp / "weights")
        _fsync_dir(tmp / "optimizer")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)  # an incomplete leftover of a killed run at the same step
        os.replace(tmp, final)
        _fsync_dir(root)
        prune(run_dir, keep_last)
    dist.barrier()
    return final


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


def load_checkpoint(ckpt: Path, model: torch.nn.Module) -> TrainState:
    """Load weights into `model` and restore RNG states. The unit optimizers read their files
    from ckpt/optimizer themselves (UnitOptimizers.load_checkpoint)."""
    aliases = json.loads((ckpt / "aliases.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted((ckpt / "weights").glob("*.safetensors")):
        tensors.update(load_file(str(f), device="cpu"))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if m not in aliases]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {ckpt} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    state = TrainState(**json.loads((ckpt / "state.json").read_text()))
    rng_file = ckpt / f"rng-rank{dist.rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        warnings.warn(f"{ckpt.name} has no RNG state for rank {dist.rank()}", stacklevel=2)
    return state
