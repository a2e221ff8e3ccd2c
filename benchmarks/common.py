"""What several benchmarks share: a stand-in tokenizer and synthetic token rows."""

from __future__ import annotations


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
