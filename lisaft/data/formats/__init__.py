"""The data formats: one module per value of data.format, each holding one DataFormat subclass
(base.py says what a format does). The registry finds them, so a new format is one file here
(and one word in data.format's Literal, config/schema.py; tests/unit/test_formats.py holds the
two to each other)."""

from __future__ import annotations

import importlib
import pkgutil
from typing import get_args

from lisaft.config.schema import DataSection
from lisaft.data.formats.base import DataFormat

# data.format's values in the schema's order (the order messages list them in).
SCHEMA_NAMES: tuple[str, ...] = get_args(DataSection.model_fields["format"].annotation)


def _discover() -> dict[str, DataFormat]:
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")
    found: dict[str, DataFormat] = {}
    todo = list(DataFormat.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "name" in vars(cls):
            found[cls.name] = cls()
    return {**{n: found[n] for n in SCHEMA_NAMES if n in found}, **found}


FORMATS: dict[str, DataFormat] = _discover()


def data_format(name: str) -> DataFormat:
    """The format object of a data.format value (the schema already checked the name)."""
    return FORMATS[name]
