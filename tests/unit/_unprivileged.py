"""Permission failures as a user meets them. Root ignores file modes, so when the tests run as
root the call runs in a forked child that has dropped to the `nobody` user; the file modes then
apply for real. Nothing is faked: the library code meets a real EACCES."""

import os
import tempfile
from pathlib import Path

from lisaft.errors import LisaftError

NOBODY = 65534


def open_dir(path: Path) -> Path:
    """Let the unprivileged child reach `path` (pytest's tmp folders are private to root)."""
    top = Path(tempfile.gettempdir())
    for p in [path, *path.parents]:
        if p == top or p == p.parent:
            break
        os.chmod(p, os.stat(p).st_mode | 0o005)
    return path


def lisaft_error_as_unprivileged(fn) -> str | None:
    """Call fn as a user file modes apply to; return the LisaftError message it raised, or None.
    Any other exception comes back as 'unexpected TYPE: message'."""
    if os.geteuid() != 0:
        try:
            fn()
        except LisaftError as e:
            return str(e)
        except Exception as e:
            return f"unexpected {type(e).__name__}: {e}"
        return None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        message = b""
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
        except LisaftError as e:
            message = str(e).encode()
        except BaseException as e:
            message = f"unexpected {type(e).__name__}: {e}".encode()
        os.write(w, message)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        message = f.read().decode()
    os.waitpid(pid, 0)
    return message or None
