"""What several benchmarks share: a stand-in tokenizer, synthetic token rows, and the record of
the machine a timing ran on."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable


class PadOnly:
    """The trainer needs only a pad id from the tokenizer when the examples are given."""

    pad_token_id = 0


def synthetic_rows(n: int, seq_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token rows (ids from 3, past the special tokens): the benchmarks that use them
    measure speed and memory, not learning."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, seq_len), generator=g).tolist()


def synthetic_examples(n: int, seq_len: int, vocab: int, seed: int) -> list[dict]:
    """`synthetic_rows` as training examples, the loss on every token."""
    return [{"input_ids": row, "labels": list(row)} for row in synthetic_rows(n, seq_len, vocab, seed)]


def timed_on_this_machine(cfg: dict, measure: Callable[[], dict]) -> dict:
    """`measure()`'s result beside the settings, the machine and the load average before and after
    (on a shared machine a timing means little without the load it ran under)."""
    import torch

    load_before = os.getloadavg()[0]
    measured = measure()
    return {"config": cfg, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__, **measured,
            "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
