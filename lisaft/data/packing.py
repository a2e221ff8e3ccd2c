"""Packing: whole examples into rows of at most max_seq_len tokens, by best-fit decreasing.

An example is never split: a row holds whole documents, and each keeps its own length in the
row's `doc_lens`, from which collate (lisaft/data/order.py) makes position ids that restart at 0
per document, so the attention implementation keeps documents apart and no document's first
token is predicted from the previous one. The rows are a pure function of (seed, the examples'
lengths, max_seq_len): the examples are taken in a seeded random order, stably sorted longest
first, and each goes into the open row it fills best (least room left), or a new row. Ties among
equal lengths follow the seeded order, so a different seed gives a different but equally full
packing.

The packing's digest (a hash of every row's documents, token ids and labels) goes into each
checkpoint: a resume over data that packs differently is refused instead of silently training
on other rows.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import numpy as np

from lisaft.data.collate import Example
from lisaft.data.digest import DataChanged, changed_message
from lisaft.data.order import ORDER_SALT

# Stream of the order salt used for the packing order (0: epochs, 1: held-out split).
_PACKING_STREAM = 2


def best_fit_rows(lengths: list[int], max_seq_len: int, seed: int) -> list[list[int]]:
    """Example indices per row: best-fit decreasing over a seeded permutation."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > max_seq_len):
        raise ValueError(f"every length must be in [1, {max_seq_len}]")
    seq = np.random.SeedSequence([ORDER_SALT, seed & (2**63 - 1), _PACKING_STREAM])
    perm = np.random.Generator(np.random.PCG64(seq)).permutation(lengths.size)
    order = perm[np.argsort(-lengths[perm], kind="stable")]
    rows: list[list[int]] = []
    # Open rows by room left: `rooms` is the sorted list of distinct rooms, `by_room` the rows
    # with each. A full row leaves both. bisect finds the best fit in O(log rooms).
    rooms: list[int] = []
    by_room: dict[int, list[int]] = {}
    for i in order.tolist():
        need = int(lengths[i])
        k = bisect.bisect_left(rooms, need)
        if k == len(rooms):
            r, room = len(rows), max_seq_len
            rows.append([])
        else:
            room = rooms[k]
            r = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(k)
        rows[r].append(i)
        left = room - need
        if left:
            if left not in by_room:
                by_room[left] = []
                bisect.insort(rooms, left)
            by_room[left].append(r)
    return rows


def _digest(rows: list[Example], max_seq_len: int) -> str:
    h = hashlib.sha256(f"lisaft-packing-v1 {max_seq_len} {len(rows)}".encode())
    for row in rows:
        h.update(np.asarray(row["doc_lens"], dtype=np.int64).tobytes())
        h.update(np.asarray(row["input_ids"], dtype=np.int64).tobytes())
        h.update(np.asarray(row["labels"], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


@dataclass
class Packing:
    """Packed training rows and what a checkpoint records of them."""

    rows: list[Example]  # {"input_ids", "labels", "doc_lens"}
    n_examples: int
    max_seq_len: int
    digest: str
    accept_change: bool = False  # training.accept_data_change: the data order warns of the change

    @property
    def real_tokens(self) -> int:
        return sum(len(r["input_ids"]) for r in self.rows)

    @property
    def fill(self) -> float:
        """Share of the rows' max_seq_len positions that hold a token."""
        return self.real_tokens / (len(self.rows) * self.max_seq_len)

    def summary(self) -> str:
        return (f"packing: {self.n_examples:,} examples in {len(self.rows):,} rows, "
                f"{self.fill:.1%} of positions real")

    def state_dict(self) -> dict:
        return {"digest": self.digest, "rows": len(self.rows)}

    def load_state_dict(self, d: dict) -> None:
        if d.get("digest") != self.digest and not self.accept_change:
            raise DataChanged(changed_message(f"packed into {d.get('rows')} rows with digest {d.get('digest')} "
                                              f"then, {len(self.rows)} rows with digest {self.digest} now"))


def pack_examples(examples: list[Example], max_seq_len: int, seed: int) -> Packing:
    """Whole examples (each at most max_seq_len tokens: truncation happens before) in rows."""
    lengths = [len(ex["input_ids"]) for ex in examples]
    rows = []
    for members in best_fit_rows(lengths, max_seq_len, seed):
        ids: list[int] = []
        labels: list[int] = []
        for i in members:
            ids.extend(examples[i]["input_ids"])
            labels.extend(examples[i]["labels"])
        rows.append({"input_ids": ids, "labels": labels, "doc_lens": [lengths[i] for i in members]})
    return Packing(rows, len(examples), max_seq_len, _digest(rows, max_seq_len))
