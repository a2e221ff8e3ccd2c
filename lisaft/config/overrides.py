"""`--set key.path=value`: recipe keys given on the command line.

A value is read as YAML, as it would be in the recipe file (`true`, `3e-4`, `null`, `[a, b]`). A
relative path typed on the command line means the current directory, as for any other command;
paths in the recipe file keep meaning the recipe's folder (recipe.load_recipe applies both).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from lisaft.errors import LisaftError


@dataclass(frozen=True)
class Override:
    item: str  # as typed, for messages
    parts: tuple[str, ...]
    value: Any
    raw: str  # the text after "="
    flag: str | None = None  # the command-line flag that set the key, as typed, when not --set

    @property
    def typed(self) -> str:
        """As the user typed it: `--set key=value`, or the flag."""
        return self.flag if self.flag is not None else f"--set {self.item}"

    def blame(self, line: str) -> str:
        """A message about the key this sets, naming what the user typed."""
        return f"--set {line}" if self.flag is None else f"{self.flag}: {line}"

    def as_text(self) -> str:
        return quoted_as_text(self.key, self.raw)

    @property
    def key(self) -> str:
        return ".".join(self.parts)

    def covers(self, loc: tuple) -> bool:
        """Whether the recipe key at `loc` was set by this override (itself or inside it)."""
        return tuple(loc[: len(self.parts)]) == self.parts


def quoted_as_text(key: str, raw: str) -> str:
    """A --set that passes `raw` as a string whatever it holds, as a shell would need it typed:
    YAML double quotes (JSON's string syntax is YAML's) inside shell single quotes."""
    return "--set " + shlex.quote(f"{key}={json.dumps(raw, ensure_ascii=False)}")


def parse_override(item: str) -> Override:
    if "=" not in item:
        raise LisaftError(f"--set {item!r}: expected key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise LisaftError(f"--set {item!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise LisaftError(f"--set {key}: the value is not valid YAML ({problem}); to pass it as text, "
                          f"quote it: {quoted_as_text(key, raw)}") from None
    return Override(item, tuple(key.split(".")), value, raw)


def flag_override(flag: str, key: str, value: Any) -> Override:
    """What a command-line flag sets: recipe `key` to `value`, with the flag as typed for messages."""
    return Override(f"{key}={json.dumps(value)}", tuple(key.split(".")), value, json.dumps(value), flag)


def parsed_overrides(overrides: Sequence[str | Override]) -> tuple[Override, ...]:
    return tuple(o if isinstance(o, Override) else parse_override(o) for o in overrides)


def apply_overrides(data: dict, overrides: Sequence[str | Override]) -> dict:
    """Apply dotted `key.path=value` overrides (values parsed as YAML) to a raw recipe dict."""
    for o in parsed_overrides(overrides):
        node = data
        for part in o.parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise LisaftError(f"--set {o.key}: {part!r} is not a section")
            node = nxt
        node[o.parts[-1]] = o.value
    return data
