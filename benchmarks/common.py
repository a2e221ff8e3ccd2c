"""What several benchmarks share: a stand-in tokenizer, synthetic token rows, and the record of
the machine a timing ran on."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable


class PadOnly:
    """The trainer needs only a pad id from the tokenizer when the examples are given."""

    pad_token_id = 0


class IdsTokenizer(PadOnly):
    """GRPO's stand-in: ids 0 and 2 are padding and EOS, and a completion decodes to its ids as
    text, which the rewards read (benchmarks measure speed and memory, not what is said)."""

    eos_token_id = 2

    def batch_decode(self, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [" ".join(map(str, row)) for row in rows]


def synthetic_prompts(n: int, prompt_len: int, vocab: int, seed: int) -> list[dict]:
    """data.format prompts examples of `prompt_len` tokens each (the longest a GRPO recipe takes),
    each with an `answer` for exact_match."""
    from lisaft.data.formats.prompts import prompt_example

    return [prompt_example(row, f"prompt {i}", {"answer": "0"}, f"row {i + 1}")
            for i, row in enumerate(synthetic_rows(n, prompt_len, vocab, seed))]


def synthetic_rows(n: int, seq_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token rows (ids from 3, past the special tokens): the benchmarks that use them
    measure speed and memory, not learning."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, seq_len), generator=g).tolist()


def synthetic_examples(n: int, seq_len: int, vocab: int, seed: int) -> list[dict]:
    """`synthetic_rows` as training examples, the loss on every token."""
    return [{"input_ids": row, "labels": list(row)} for row in synthetic_rows(n, seq_len, vocab, seed)]


def synthetic_documents(rows: int, seq_len: int, vocab: int, seed: int, per_row: int = 4) -> list[dict]:
    """`per_row` documents for each packed row of `seq_len` tokens (data.packing fills each row with
    exactly that many): rows of several documents, so sdpa gets the block-diagonal mask (and
    FlashAttention its document lengths) that the estimate counts for packed rows."""
    assert seq_len % per_row == 0, (seq_len, per_row)
    return synthetic_examples(rows * per_row, seq_len // per_row, vocab, seed)


def synthetic_pairs(n: int, seq_len: int, vocab: int, seed: int) -> list[dict]:
    """Preference pairs: a prompt of a quarter of `seq_len` (no loss), a chosen answer to `seq_len`
    in all, a rejected one to three quarters of it; the pair batch pads the rejected sequence, so
    attention gets the padding mask the estimate counts for pairs."""
    out = []
    for row in synthetic_rows(n, seq_len, vocab, seed):
        prompt = seq_len // 4
        rejected = row[: 3 * seq_len // 4]
        out.append({k: {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}
                    for k, ids in (("chosen", row), ("rejected", rejected))})
    return out


def timed_on_this_machine(cfg: dict, measure: Callable[[], dict]) -> dict:
    """`measure()`'s result beside the settings, the machine and the load average before and after
    (on a shared machine a timing means little without the load it ran under)."""
    import torch

    load_before = os.getloadavg()[0]
    measured = measure()
    return {"config": cfg, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__, **measured,
            "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def hf_in_order(ordered: list[list[int]]):
    """HF Trainer's side of a lisaft comparison: a dataset of `ordered` token rows (each its own
    labels, no padding) and a Trainer subclass that reads it in that order, so that its batches
    are lisaft's, step for step. Returns (dataset, trainer class)."""
    import torch
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer

    class Rows(Dataset):
        def __len__(self):
            return len(ordered)

        def __getitem__(self, i):
            ids = torch.tensor(ordered[i])
            return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    return Rows(), InOrderTrainer


def lmflow_style_switch(layers, gamma: int) -> None:
    """Reference LISA as LMFlow and axolotl ship it, written here from its described behaviour:
    freeze every decoder layer, then unfreeze `gamma` of them drawn with NumPy's global RNG (which
    the Trainer seeds). Embeddings and head are never touched, so they always train; the Trainer
    built its optimizer over every parameter, and AdamW skips only parameters whose grad is None,
    so a deactivated layer's moments stay where they are."""
    import numpy as np

    for layer in layers:
        layer.requires_grad_(False)
    for i in np.random.choice(len(layers), gamma, replace=False):
        layers[int(i)].requires_grad_(True)
