"""Stopping on a signal without losing work."""

from __future__ import annotations

import signal
from pathlib import Path

from lisaft.console import say
from lisaft.distributed import dist


class StopRequest:
    """First SIGINT/SIGTERM: finish the optimizer step, checkpoint, exit. A second one aborts at
    once (default handlers are restored after the first)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, signal._HANDLER] = {}

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:
                pass  # not the main thread: no signal handling
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        for sig in self._previous:
            signal.signal(sig, signal.SIG_DFL)
        if dist.is_main():  # every rank gets the signal; one says so
            say(f"\n{signal.Signals(signum).name} received: finishing the current step and saving a "
                "checkpoint (send it again to abort at once)")

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def message(self, step: int, checkpoint: str, resume: str, asked: bool) -> str:
        """The stop's one line: why, the checkpoint written, the command that continues the run
        (`resume`, the parallel strategy's). `asked`: a test's stop_at, not a signal; neither means
        another rank was signalled."""
        why = signal.Signals(self.signum).name if self.signum else ("stop requested" if asked else
                                                                     "another rank was stopped")
        return (f"stopped ({why}) at step {step}; checkpoint {checkpoint} written. "
                f"Continue with: {resume}")


def resume_command(run_dir: Path, batch_size: int, torchrun: bool = False) -> str:
    """How to continue a stopped run: under torchrun, the same launch (a plain `lisaft resume`
    would be one rank, another global batch), and the one-process form that keeps the batch
    (under torchrun too where the strategy needs a process group even on one rank: FSDP)."""
    world = dist.world_size()
    if world == 1:
        return f"{'torchrun --nproc-per-node 1 -m ' if torchrun else ''}lisaft resume {run_dir}"
    one = "torchrun --nproc-per-node 1 -m lisaft" if torchrun else "lisaft"
    return (f"torchrun --nproc-per-node {dist.local_world_size()} -m lisaft resume {run_dir}"
            + (f" (on {world} ranks in all)" if dist.local_world_size() != world else "")
            + f", or on one process `{one} resume {run_dir} --set training.batch_size={batch_size * world}`,"
            " which keeps the global batch")
