"""How a micro-batch's examples become tensors: padded rows, or one flat row of packed documents
with per-document positions and the varlen kernels' boundaries."""

from __future__ import annotations

import numpy as np
import torch

from lisaft.data.formats.base import IGNORE_INDEX, Example

__all__ = ["IGNORE_INDEX", "Example", "collate", "doc_lens", "real_positions", "to_device"]


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
    (sdpa, eager). A padded tail is one more document of its own, with label -100. A batch whose
    rows are each one whole document gets no position ids at all (plain causal attention). `flatten`
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
    if all(doc_lens(ex) == [width] for ex in examples):
        # Each row one document and no padding: the model's own positions are the documents'.
        # Without position ids transformers neither looks for packed documents (a read of the
        # device per forward) nor builds a mask: sdpa runs is_causal, as for the peers' rows.
        labels[:, 0] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}
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
