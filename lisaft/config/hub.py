"""Local path or Hugging Face hub id: the one rule, and the hub's reachability.

Hub ids are "name" or "org/name". A reference that exists on disk is local; one that can only
have meant a path (absolute, starting with "." or "~", with a backslash or more than one "/",
or, for data, with the suffix of a data file) is a missing path, never a hub lookup. Everything else is a
hub id.
"""

from __future__ import annotations

import functools
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from lisaft.console import first_line
from lisaft.errors import LisaftError

# The file kinds data.train / data.eval read (lisaft/data/read.py).
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def is_local(ref: str) -> bool:
    return Path(ref).exists()


def can_only_be_path(ref: str, data_file: bool = False) -> bool:
    p = Path(ref)
    return (p.is_absolute() or ref.startswith((".", "~")) or "\\" in ref or ref.count("/") > 1
            or (data_file and p.suffix.lower() in DATA_FILE_SUFFIXES))


@functools.lru_cache(maxsize=1)
def hub_offline() -> bool:
    """Whether the hub is out of reach: HF_HUB_OFFLINE is set, or a connection to its endpoint
    does not open within 3 s. Asked once, before a library spends tens of seconds on retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    url = urlparse(constants.ENDPOINT)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
            result.append(True)
        except OSError:
            pass

    # A thread bounds name resolution too, which socket timeouts do not cover.
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(4)
    return not result


def hub_error(key: str, ref: str, err: Exception) -> LisaftError:
    """The one line for a model or tokenizer reference that did not load from the hub."""
    if can_only_be_path(ref):
        return LisaftError(f"{key}: {ref}: no such folder")
    if hub_offline():
        return LisaftError(
            f"{key}: {ref!r} is not a local folder and the hub cannot be reached from here (offline), "
            "nor is it in the local cache; point it to a folder saved with save_pretrained")
    return LisaftError(
        f"{key}: {ref!r} is not a local folder and could not be fetched from the hub "
        f"(no such repository, or it needs a login): {first_line(err)}"
    )
