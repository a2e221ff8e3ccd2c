"""Training examples: rows (read by lisaft/data/read.py) turned into token ids with loss masks
by the recipe's data format (lisaft/data/formats/: text, instruction, chat, preference, one
object each), and the held-out split. The order the loop sees them in is lisaft/data/order.py's;
how they become tensors, lisaft/data/collate.py's.

Before any of this, `data.columns` renames fields (prompt -> instruction; ShareGPT's
conversations/from/value -> messages/role/content), see lisaft/data/read.py.

Examples longer than data.max_seq_len are cut at the end (a preference pair's completions, never
its prompt). data.packing puts whole train examples into rows afterwards (lisaft/data/packing.py),
each document seeing only itself; eval examples are never packed, so eval metrics are the same
numbers with packing on or off.

The order is a pure function of (seed, epoch, position), so a resumed run continues with
exactly the batches an uninterrupted one would have seen, and N data-parallel ranks together
see what one process with an N times larger batch sees.
"""

from __future__ import annotations

import warnings

import numpy as np

from lisaft.config.schema import DataSection
from lisaft.data.formats import data_format
from lisaft.data.formats.base import DataWarning, Example
from lisaft.data.formats.instruction import render_instruction_prompt
from lisaft.data.order import ORDER_SALT
from lisaft.data.read import Rows, read_rows, rename_columns
from lisaft.errors import LisaftError

__all__ = ["DataWarning", "build_examples", "load_splits", "render_instruction_prompt"]


def build_examples(rows: Rows, fmt: str, tokenizer, template: str | None = None,
                   roles: dict[str, str] | None = None) -> list[Example]:
    """Every row as an example of data.format `fmt`, before data.max_seq_len cuts it."""
    return data_format(fmt).examples(rows, tokenizer, template, roles or {})


def _fitted(rows: Rows, section: DataSection, tokenizer) -> list[Example]:
    fmt = data_format(section.format)
    return fmt.fit(fmt.examples(rows, tokenizer, section.template, section.roles), section.max_seq_len, rows)


def _held_out(n: int, fraction: float, seed: int) -> list[int]:
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise LisaftError(
            f"data.eval_fraction: holding out {fraction} of {n} rows would leave nothing to train on"
        )
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([ORDER_SALT, seed & (2**63 - 1), 1])))
    return sorted(int(i) for i in rng.permutation(n)[:n_eval])


def load_splits(section: DataSection, tokenizer, seed: int) -> tuple[list[Example], list[Example] | None]:
    """Train examples and eval examples (from data.eval, else a seeded held-out
    data.eval_fraction of the train rows, else None)."""
    train_rows = rename_columns(read_rows(section.train, "data.train", section.subset, section.train_split),
                                section.columns)
    eval_rows: Rows | None = None
    if section.eval is not None:
        if section.eval_fraction > 0:
            warnings.warn("data.eval is set, so data.eval_fraction is ignored", DataWarning, stacklevel=2)
        eval_rows = rename_columns(read_rows(section.eval, "data.eval", section.subset, section.eval_split),
                                   section.columns)
    elif section.eval_fraction > 0:
        # Split rows, not examples, so the held-out set does not depend on the tokenizer.
        held = _held_out(len(train_rows.rows), section.eval_fraction, seed)
        held_set = set(held)
        eval_rows = train_rows.subset(held)
        eval_rows.key = "data.train (held out by data.eval_fraction)"
        train_rows = train_rows.subset([i for i in range(len(train_rows.rows)) if i not in held_set])

    train = _fitted(train_rows, section, tokenizer)
    evals = _fitted(eval_rows, section, tokenizer) if eval_rows is not None else None
    return train, evals

