"""The recipe's field types: a count, a number and a flag as YAML gives them, and the base of every
section (unknown keys refused). Below schema.py, so every section's module uses the same ones."""

from __future__ import annotations

import math
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
    """A real number, and a finite one: a NaN or inf learning rate (or norm, or ratio) trains only
    NaN, step after step."""
    if isinstance(v, bool):
        raise ValueError("must be a number, not true/false")
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v  # pydantic names what it is instead
    if not math.isfinite(f):
        raise ValueError(f"must be a finite number, got {v}")
    return v


Int = Annotated[int, BeforeValidator(whole_number)]
Float = Annotated[float, BeforeValidator(_real_number)]
Bool = Annotated[bool, Strict()]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
