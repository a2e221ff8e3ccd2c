"""What lisaft tells the user outside the progress display: one channel for each kind.

- `say`: status lines (resume summary, stop on signal) on stdout.
- `warn`: a warning through Python's warnings module, category `LisaftWarning`; the CLI shows
  every warning as one line "warning: ..." on stderr, and tests can catch them with pytest.warns.
- `first_line`: the one line of an exception a user sees inside lisaft's own messages.
"""

from __future__ import annotations

import warnings


class LisaftWarning(UserWarning):
    """Something the user should know that does not stop the run."""


def say(message: str) -> None:
    print(message, flush=True)


def warn(message: str, category: type[Warning] = LisaftWarning, stacklevel: int = 2) -> None:
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name when it has none."""
    for line in str(e).strip().splitlines():
        if line.strip():
            return line.strip()
    return type(e).__name__
