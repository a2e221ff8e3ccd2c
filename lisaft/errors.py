"""One exception type for every error a user can fix: the CLI prints its message and exits 2."""


class LisaftError(Exception):
    """Bad recipe, missing file, bad data row or impossible combination. The message names the
    key, file or row; the CLI shows it without a traceback."""

    exit_code = 2


class RunFailed(LisaftError):
    """A run that started and then could not go on (out of memory): exit 1, with what to do."""

    exit_code = 1
