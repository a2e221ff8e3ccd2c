"""Which examples each micro-batch holds: the data order, a pure function of the seed and the
epoch, and eval's fixed batches."""

from __future__ import annotations

import math

import numpy as np

from lisaft.console import warn
from lisaft.data.digest import DataChanged, changed_message
from lisaft.errors import LisaftError

# Seeds the data order (and the held-out split) apart from the other consumers of
# training.seed: model init and LISA sampling.
ORDER_SALT = 0x6C697361_64617461


def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    seq = np.random.SeedSequence([ORDER_SALT, seed & (2**63 - 1), 0, epoch])
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
                 unit: str = "examples", digest: str | None = None, accept_change: bool = False,
                 whole: bool = False):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.n = n_examples
        self.unit = unit  # what an index stands for in messages: examples, or packed rows
        self.digest = digest  # data/digest.py: the examples' token ids and labels, in order
        self.accept_change = accept_change  # training.accept_data_change: continue over new data
        self.whole = whole  # every rank takes the whole global micro-batch (GRPO picks its share itself)
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
        assert self._perm is not None
        return self._perm

    def next_indices(self) -> list[int]:
        if self.position + self.global_batch > self.n:
            self.epoch += 1
            self.position = 0
        lo = self.position + (0 if self.whole else self.rank * self.batch_size)
        batch = self._permutation()[lo:lo + (self.global_batch if self.whole else self.batch_size)]
        self.position += self.global_batch
        return [int(i) for i in batch]

    def state_dict(self) -> dict:
        sd = {"epoch": self.epoch, "position": self.position, "n_examples": self.n}
        return sd if self.digest is None else {**sd, "digest": self.digest}

    def load_state_dict(self, d: dict) -> None:
        n = d.get("n_examples", self.n)
        saved = d.get("digest")  # absent in checkpoints of earlier versions: the count still counts
        what = ""
        if n != self.n:
            what = f"{n} training {self.unit} then, {self.n} now"
        elif saved is not None and self.digest is not None and saved != self.digest:
            what = f"digest {saved} then, {self.digest} now"
        if what and not self.accept_change:
            raise DataChanged(changed_message(what))
        if what:
            warn(f"data.train changed since the checkpoint ({what}); continuing over the new data as asked")
        self.epoch = int(d["epoch"])
        self.position = int(d["position"])


def eval_index_batches(n_examples: int, batch_size: int) -> list[list[int]]:
    """Eval batches in a fixed order, the last one possibly short: every example counts once."""
    return [list(range(i, min(i + batch_size, n_examples))) for i in range(0, n_examples, batch_size)]


def steps_for_epochs(epochs: float, train_rows: int, rows_per_step: int) -> int:
    """training.epochs as optimizer steps: enough steps to show every row `epochs` times, where a
    step takes batch_size x grad_accum_steps rows on each rank."""
    return max(1, math.ceil(epochs * train_rows / rows_per_step))
