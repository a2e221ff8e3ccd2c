"""The training data's digest: one hash of every example's token ids and labels, in order.

Saved with each checkpoint (in the data order's state) so a resume over data that tokenizes
differently (a row edited, added, removed or moved, another tokenizer, max_seq_len or format) is
refused instead of silently training on other examples. The examples are the ones the run trains
on: packed rows when data.packing is on, so packing's own digest agrees with it."""

from __future__ import annotations

import hashlib
from array import array

from lisaft.errors import CheckpointMismatch

ACCEPT_KEY = "training.accept_data_change"


class DataChanged(CheckpointMismatch):
    """The data a checkpoint was trained on is not the data now: never a reason to try an older
    checkpoint of the same run, which saw the same data."""


def examples_digest(examples: list[dict]) -> str:
    """16 hex digits over the examples' input_ids and labels in order, with their lengths, so a
    token moved from one example to the next changes it too."""
    h = hashlib.blake2b(f"lisaft-data-v1 {len(examples)}".encode(), digest_size=8)
    # A preference pair is its chosen sequence, then its rejected one.
    for ex in (seq for pair in examples for seq in ((pair["chosen"], pair["rejected"]) if "chosen" in pair
                                                    else (pair,))):
        ids, labels = ex["input_ids"], ex["labels"]
        h.update(len(ids).to_bytes(8, "little"))
        h.update(array("q", ids).tobytes())
        h.update(array("q", labels).tobytes())
        if "desirable" in ex:  # unpaired feedback: its label is data too
            h.update(b"+" if ex["desirable"] else b"-")
    return h.hexdigest()


def changed_message(what: str) -> str:
    return (f"data.train: the training data changed since the checkpoint ({what}): an edited, added, removed "
            f"or reordered row, or another tokenizer, data.format or data.max_seq_len; resuming would train on "
            f"other examples than the run's. To continue over the new data on purpose, pass --set {ACCEPT_KEY}=true")
