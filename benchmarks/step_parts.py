"""The GPU suite's timer of a step's parts: train_step's phases (lisaft/train/step.py's Phases
seam) per micro-batch, and, for optimizer.cpu_offload, where the step waits on the host.

A phase ends with a device sync, so its time is the device's as well as the host's: that
serialises nothing train_step did not already (each micro-batch's loss is read after backward).
For cpu_offload the offloaded optimizers' own calls are wrapped on the instance, by name, and
timed cumulatively per step:

    gradient     backward handing a gradient to the copy stream (waits there while the bytes
                 in flight are at their bound: the link's share of backward)
    add          the host adding a copied gradient into its accumulator (worker threads)
    drain        the step waiting for the last copies and additions after backward
    step_unit    one unit's host step (the fused AdamW on the CPU), worker threads
    wait         the training loop waiting for host steps still running
    weights_ready  the step waiting for the new weights to be back on the device

A name the code no longer has is left out of `timed` (and the run still measures the rest). A
call is counted in the step whose time it took: with the host step overlapping the next
forward (cpu_offload's `overlap`), step k's `step_unit` shows in step k+1's parts, and the wait
for it in that step's first forward.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

from lisaft.train import Phases

# (object path from the offloaded optimizers, method name, what it is)
OFFLOAD_CALLS = (("transfers", "gradient"), ("transfers", "_add"), ("", "drain"), ("", "_step_unit"),
                 ("", "wait"), ("transfers", "weights_ready"))


class StepParts(Phases):
    """Times every phase of every micro-batch; `take()` returns one step's and starts the next."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.current: dict[str, list[float]] = defaultdict(list)
        self.timed: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.current[name].append(time.perf_counter() - t0)

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def instrument_offload(self, offloaded) -> None:
        """Wrap the offloaded optimizers' calls (OFFLOAD_CALLS) on their instances."""
        for owner_name, method in OFFLOAD_CALLS:
            owner = getattr(offloaded, owner_name) if owner_name else offloaded
            if owner is None or not callable(getattr(owner, method, None)):
                continue
            setattr(owner, method, self._timed(method.lstrip("_"), getattr(owner, method)))
            self.timed.append(method.lstrip("_"))

    def _timed(self, name: str, call):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.current[f"offload_{name}"].append(time.perf_counter() - t0)

        return timed

    def take(self) -> dict:
        """This step's parts: per-micro-batch lists for forward and backward, sums elsewhere."""
        out = {k: ([round(x, 4) for x in v] if k in ("forward", "backward") else round(sum(v), 4))
               for k, v in self.current.items()}
        self.current = defaultdict(list)
        return out
