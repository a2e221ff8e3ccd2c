"""What a checkpoint is made of: named components, and where each one's state is stored.

The checkpointer (checkpointer.py) is handed a name -> component mapping and knows none of them.
How a component is stored follows from what it is:

    state.json  ["components"][name]   a Component: state_dict() -> JSON-able, load_state_dict(sd)
    <name>.json                        OwnFile(component): read alone, before any set-up (the recipe)
    <name>-rank<r>.pt                  PerRank(component): each rank's own, torch.save'd (the RNG)
    <name>/                            a FolderComponent, handed that folder (and the same folder of
                                       the previous checkpoint, to hard-link what did not change)

A component a checkpoint lacks makes it unresumable (OlderCheckpoint), unless it is wrapped in
OptionalComponent(component, default): then a checkpoint written before the component existed loads the
default instead (or, with default None, leaves the component as set-up built it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from lisaft.console import warn
from lisaft.distributed import dist

STATE_FILE = "state.json"
STATE_FORMAT = 2


class Component(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


@runtime_checkable
class FolderComponent(Protocol):
    def write(self, folder: Path, base: Path | None) -> list[Path]:
        """Write this rank's files into `folder` (created by the component); `base` is the same
        component's folder in the checkpoint the run continues from, or None. Returns the files
        written (a hard link needs no fsync)."""
        ...

    def read(self, folder: Path) -> None: ...

    def committed(self) -> None:
        """The checkpoint just written is complete: it holds this component's current state."""
        ...


class _Stored:
    """How one named component lives in a checkpoint folder (the checkpointer's side)."""

    component: Any
    optional: bool = False

    def write(self, name: str, tmp: Path, base: Path | None, state: dict) -> list[Path]:
        raise NotImplementedError

    def present(self, name: str, ckpt: Path, state: dict) -> bool:
        raise NotImplementedError

    def read(self, name: str, ckpt: Path, state: dict) -> None:
        raise NotImplementedError

    def committed(self) -> None:
        pass


class _InState(_Stored):
    def __init__(self, component: Component) -> None:
        self.component = component

    def write(self, name: str, tmp: Path, base: Path | None, state: dict) -> list[Path]:
        if dist.is_main():
            state[name] = self.component.state_dict()
        return []

    def present(self, name: str, ckpt: Path, state: dict) -> bool:
        return name in state

    def read(self, name: str, ckpt: Path, state: dict) -> None:
        self.component.load_state_dict(state[name])


class _InFolder(_Stored):
    def __init__(self, component: FolderComponent) -> None:
        self.component = component

    def write(self, name: str, tmp: Path, base: Path | None, state: dict) -> list[Path]:
        return self.component.write(tmp / name, base / name if base is not None else None)

    def present(self, name: str, ckpt: Path, state: dict) -> bool:
        return (ckpt / name).is_dir()

    def read(self, name: str, ckpt: Path, state: dict) -> None:
        self.component.read(ckpt / name)

    def committed(self) -> None:
        self.component.committed()


class OwnFile(_Stored):
    """A component whose state is its own <name>.json beside state.json, for readers that need it
    without the rest of the checkpoint (the resume policy compares the recipe before set-up)."""

    def __init__(self, component: Component) -> None:
        self.component = component

    def write(self, name: str, tmp: Path, base: Path | None, state: dict) -> list[Path]:
        if not dist.is_main():
            return []
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(self.component.state_dict(), indent=1))
        return [path]

    def present(self, name: str, ckpt: Path, state: dict) -> bool:
        return (ckpt / f"{name}.json").is_file()

    def read(self, name: str, ckpt: Path, state: dict) -> None:
        self.component.load_state_dict(json.loads((ckpt / f"{name}.json").read_text()))


class PerRank(_Stored):
    """A component every rank saves for itself, in <name>-rank<r>.pt (tensors allowed)."""

    def __init__(self, component: Component) -> None:
        self.component = component

    @staticmethod
    def path(name: str, ckpt: Path) -> Path:
        return ckpt / f"{name}-rank{dist.rank()}.pt"

    def write(self, name: str, tmp: Path, base: Path | None, state: dict) -> list[Path]:
        path = self.path(name, tmp)
        torch.save(self.component.state_dict(), path)
        return [path]

    def present(self, name: str, ckpt: Path, state: dict) -> bool:
        return self.path(name, ckpt).is_file()

    def read(self, name: str, ckpt: Path, state: dict) -> None:
        self.component.load_state_dict(torch.load(self.path(name, ckpt), weights_only=True))


class OptionalComponent(_Stored):
    """A component a checkpoint may lack: one written before it existed loads `default` into it
    (None: the component keeps the state set-up gave it), and `warning`, when given, is said."""

    def __init__(self, component: Any, default: dict | None = None, warning: str | None = None) -> None:
        self.stored = stored(component)
        self.component = self.stored.component
        self.default = default
        self.warning = warning
        self.optional = True

    def write(self, name: str, tmp: Path, base: Path | None, state: dict) -> list[Path]:
        return self.stored.write(name, tmp, base, state)

    def present(self, name: str, ckpt: Path, state: dict) -> bool:
        return self.stored.present(name, ckpt, state)

    def read(self, name: str, ckpt: Path, state: dict) -> None:
        if self.stored.present(name, ckpt, state):
            self.stored.read(name, ckpt, state)
            return
        if self.default is not None:
            self.component.load_state_dict(self.default)
        if self.warning:
            warn(f"{ckpt.name}: {self.warning}")

    def committed(self) -> None:
        self.stored.committed()


def stored(component: Any) -> _Stored:
    """The storage of a component as handed to the checkpointer: wrapped already, a folder
    component (write/read/committed), or JSON state in state.json."""
    if isinstance(component, _Stored):
        return component
    if isinstance(component, FolderComponent):
        return _InFolder(component)
    return _InState(component)


def read_components(ckpt: Path) -> dict[str, dict]:
    """{component: state_dict} of a checkpoint's state.json. The first format (one flat record of
    counters, data order, LISA position and LR plan) is read into the same components."""
    raw = json.loads((ckpt / STATE_FILE).read_text())
    if "components" in raw:
        return raw["components"]
    components = {"progress": {k: raw[k] for k in ("step", "tokens_seen", "world_size", "window") if k in raw}}
    for name in ("data", "lisa", "schedule"):
        if raw.get(name):
            components[name] = raw[name]
    return components
