"""The recipe's field types: a count, a number and a flag as YAML gives them, and the base of every
section (unknown keys refused). Below schema.py, so every section's module uses the same ones."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def whole_number(v: Any) -> Any:
    """A count: `true` is not 1, and `1e3` (which YAML reads as a string) is 1000."""
    if isinstance(v, bool):
        raise ValueError("must be a whole number, not true/false")
    if isinstance(v, str) and _NUMBER.fullmatch(v.strip()):
        f = float(v)
        if not f.is_integer():
            raise ValueError(f"must be a whole number, got {v}")
        return int(f)
    return v


def _real_number(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be a number, not true/false")
    return v


Int = Annotated[int, BeforeValidator(whole_number)]
Float = Annotated[float, BeforeValidator(_real_number)]
Bool = Annotated[bool, Strict()]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
