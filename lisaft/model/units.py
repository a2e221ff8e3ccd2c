"""Training units: the one mapping from parameters to units.

A unit is what LISA switches, what a checkpoint stores as one weights file, and what owns one
optimizer: the embeddings (everything below the first decoder layer), each decoder layer, and the
head (output projection and final norm; a head tied to the input embedding belongs to the
embeddings).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from lisaft.model.parts import ModelParts


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


def state_dict_units(model: nn.Module, units: list[Unit]) -> dict[str, str]:
    """{model.state_dict() name: unit name}, derived from the units' own parameters, so the
    checkpoint files a tensor under the unit that trains it. A buffer belongs to the unit of the
    innermost module around it whose parameters all belong to one unit; any other to the first
    unit (the embeddings)."""
    unit_of_param = {id(p): u.name for u in units for p in u.params}
    names = {n: unit_of_param[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
             if id(p) in unit_of_param}
    module_units: dict[str, set[str]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        module_units[mod_name] = {unit_of_param[id(p)] for p in module.parameters() if id(p) in unit_of_param}
    for name, _ in model.named_buffers(remove_duplicate=False):
        owner = units[0].name
        prefix = name.rsplit(".", 1)[0] if "." in name else ""
        while True:
            found = module_units.get(prefix, set())
            if len(found) == 1:
                owner = next(iter(found))
                break
            if len(found) > 1 or not prefix:
                break
            prefix = prefix.rsplit(".", 1)[0] if "." in prefix else ""
        names[name] = owner
    return names


class UnitChanges:
    """How many times each unit's state changed: its optimizer stepped it (weights and moments).
    Every place that updates a unit bumps it here; a checkpoint component that writes per-unit
    files keeps its own `since()` mark and hard-links the files of the units whose count did not
    move since it last saved (or read) them."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    def bump(self, names: Iterable[str]) -> None:
        for name in names:
            self._count[name] = self._count.get(name, 0) + 1

    def count(self, name: str) -> int:
        return self._count.get(name, 0)

    def counts(self) -> dict[str, int]:
        return dict(self._count)

    def since(self) -> ChangeMark:
        return ChangeMark(self)


class ChangeMark:
    """What changed since one component's last save. Until it first saves or reads, everything
    counts as changed."""

    def __init__(self, changes: UnitChanges) -> None:
        self._changes = changes
        self._at: dict[str, int] | None = None

    def changed(self, name: str) -> bool:
        return self._at is None or self._changes.count(name) != self._at.get(name, 0)

    def saved(self) -> None:
        """The component's files now hold every unit's current state."""
        self._at = self._changes.counts()

    def forget(self) -> None:
        """No file of the component's last checkpoint may be linked into the next one."""
        self._at = None
