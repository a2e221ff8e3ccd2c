"""The training step's seam for profilers (benchmarks/step_profile.py): `train_step` and the
parallel strategy's update run each phase inside `phase(name)`. Below train/, so both use it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Phases:
    """Names: lisa, collate, forward, backward, clip, optimizer. This one times nothing."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield
