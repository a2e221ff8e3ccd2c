"""Stopping on a signal without losing work."""

from __future__ import annotations

import signal

from lisaft.console import say


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
        say(f"\n{signal.Signals(signum).name} received: finishing the current step and saving a "
            "checkpoint (send it again to abort at once)")

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def requested(self) -> bool:
        return self.signum is not None
