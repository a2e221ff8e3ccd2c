"""One exception type for every error a user can fix: the CLI prints its message and exits 2."""


class LisaftError(Exception):
    """Bad recipe, missing file, bad data row or impossible combination. The message names the
    key, file or row; the CLI shows it without a traceback."""

    exit_code = 2


class RunFailed(LisaftError):
    """A run that started and then could not go on (out of memory): exit 1, with what to do."""

    exit_code = 1


class CheckpointError(LisaftError):
    """A checkpoint this run cannot continue from; `lisaft resume` tries the next older one."""


class OlderCheckpoint(CheckpointError):
    """Written by an older lisaft: it lacks a component this version needs (and that is not
    optional). No older checkpoint of the same run can be better."""

    def __init__(self, message: str, component: str) -> None:
        super().__init__(message)
        self.component = component  # the first component the checkpoint lacks


class CheckpointMismatch(CheckpointError):
    """The checkpoint holds state that does not fit this run: weights of another model, optimizer
    state for units it does not have, LISA layers another recipe sampled, other data."""
