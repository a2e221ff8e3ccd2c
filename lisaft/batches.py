"""Which examples each micro-batch holds, and how they become tensors.

Kept apart from loading (lisaft/data.py): the training step and the benchmarks need only this, with
examples they made themselves.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lisaft.errors import LisaftError

IGNORE_INDEX = -100
# Seeds the data order (and the held-out split) apart from the other consumers of
# training.seed: model init and LISA sampling.
_ORDER_SALT = 0x6C697361_64617461

Example = dict  # {"input_ids": list[int], "labels": list[int]}


def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    seq = np.random.SeedSequence([_ORDER_SALT, seed & (2**63 - 1), 0, epoch])
    return np.random.Generator(np.random.PCG64(seq)).permutation(n)


class DataOrder:
    """Which examples each micro-batch holds, resumable and shardable.

    Each epoch is a permutation of range(n) that depends only on (seed, epoch). A global
    micro-batch is the next batch_size * world_size entries of it; rank r takes its slice
    [r*b, (r+1)*b). A tail shorter than a global micro-batch is skipped and the next epoch
    begins, so every micro-batch is full and all ranks step together. The state is just
    (epoch, position), position counted in permutation entries.
    """

    def __init__(self, n_examples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 unit: str = "examples"):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.n = n_examples
        self.unit = unit  # what an index stands for in messages: examples, or packed rows
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.global_batch = batch_size * world_size
        if n_examples < self.global_batch:
            per = f"training.batch_size={batch_size}" + (f" x {world_size} ranks" if world_size > 1 else "")
            raise LisaftError(
                f"data.train: the dataset is smaller than one batch: {n_examples} {unit}, "
                f"{per} needs {self.global_batch}; lower training.batch_size or add data"
            )
        self.epoch = 0
        self.position = 0
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = _epoch_permutation(self.n, self.seed, self.epoch)
            self._perm_epoch = self.epoch
        return self._perm

    def next_indices(self) -> list[int]:
        if self.position + self.global_batch > self.n:
            self.epoch += 1
            self.position = 0
        lo = self.position + self.rank * self.batch_size
        batch = self._permutation()[lo:lo + self.batch_size]
        self.position += self.global_batch
        return [int(i) for i in batch]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "n_examples": self.n}

    def load_state_dict(self, d: dict) -> None:
        n = d.get("n_examples", self.n)
        if n != self.n:
            raise LisaftError(
                f"data.train: the checkpoint was taken with {n} training {self.unit}, the data now gives "
                f"{self.n}; the data (or data.max_seq_len / data.packing) changed since the run started"
            )
        self.epoch = int(d["epoch"])
        self.position = int(d["position"])


def eval_index_batches(n_examples: int, batch_size: int) -> list[list[int]]:
    """Eval batches in a fixed order, the last one possibly short: every example counts once."""
    return [list(range(i, min(i + batch_size, n_examples))) for i in range(0, n_examples, batch_size)]


def doc_lens(example: Example) -> list[int]:
    """The documents an example holds: a packed row's `doc_lens`, else the one example."""
    return example.get("doc_lens") or [len(example["input_ids"])]


def real_positions(examples: list[Example]) -> int:
    """Positions that hold a token of some document (not padding)."""
    return sum(len(ex["input_ids"]) for ex in examples)


def _doc_positions(lens: list[int]) -> np.ndarray:
    """Position ids restarting at 0 at each document."""
    total = sum(lens)
    starts = np.repeat(np.cumsum([0] + lens[:-1]), lens)
    return np.arange(total) - starts


def _doc_starts(lens: list[int]) -> list[int]:
    return np.cumsum([0] + lens[:-1]).tolist()


def collate(examples: list[Example], pad_id: int, flatten: bool = False) -> dict:
    """Tensors for one micro-batch.

    Plain examples are right-padded to the longest, with attention_mask 0 and label -100 on the
    padding. Packed rows (with `doc_lens`) get position ids restarting at 0 per document and no
    attention_mask: transformers then builds a block-diagonal causal mask from the position ids
    (sdpa, eager). A padded tail is one more document of its own, with label -100. `flatten`
    puts every document of the micro-batch into one row with no padding at all, plus the
    cumulative lengths the flash-attention varlen kernels take (cu_seq_lens_q/k, max_length_q/k).
    In both layouts the first token of each document carries no loss: nothing in the row may
    predict it.
    """
    if flatten:
        return _collate_flat(examples)
    if not any("doc_lens" in ex for ex in examples):
        return _collate_padded(examples, pad_id)
    input_ids, labels = _pad_rows(examples, pad_id)
    width = input_ids.shape[1]
    position_ids = torch.zeros_like(input_ids)
    for row, ex in enumerate(examples):
        k = len(ex["input_ids"])
        lens = doc_lens(ex) + ([width - k] if k < width else [])
        labels[row, _doc_starts(doc_lens(ex))] = IGNORE_INDEX
        position_ids[row] = torch.from_numpy(_doc_positions(lens))
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def _pad_rows(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels of the examples, each row padded to the longest (no loss on padding)."""
    width = max(len(ex["input_ids"]) for ex in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, ex in enumerate(examples):
        k = len(ex["input_ids"])
        input_ids[row, :k] = torch.tensor(ex["input_ids"], dtype=torch.long)
        labels[row, :k] = torch.tensor(ex["labels"], dtype=torch.long)
    return input_ids, labels


def _collate_padded(examples: list[Example], pad_id: int) -> dict:
    input_ids, labels = _pad_rows(examples, pad_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, ex in enumerate(examples):
        attention_mask[row, : len(ex["input_ids"])] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def _collate_flat(examples: list[Example]) -> dict:
    lens = [n for ex in examples for n in doc_lens(ex)]
    input_ids = torch.tensor([t for ex in examples for t in ex["input_ids"]], dtype=torch.long)[None]
    labels = torch.tensor([t for ex in examples for t in ex["labels"]], dtype=torch.long)[None]
    labels[0, _doc_starts(lens)] = IGNORE_INDEX
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
    # max_length_* must be Python ints: the varlen kernels take them as host scalars.
    return {"input_ids": input_ids, "labels": labels,
            "position_ids": torch.from_numpy(_doc_positions(lens))[None],
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
            "max_length_q": max(lens), "max_length_k": max(lens)}


def to_device(batch: dict, device) -> dict:
    """The batch's tensors on `device`; the varlen kernels' host ints stay as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def steps_for_epochs(epochs: float, train_rows: int, rows_per_step: int) -> int:
    """training.epochs as optimizer steps: enough steps to show every row `epochs` times, where a
    step takes batch_size x grad_accum_steps rows on each rank."""
    return max(1, math.ceil(epochs * train_rows / rows_per_step))
