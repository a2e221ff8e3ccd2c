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

from dataclasses import dataclass

import numpy as np

from lisaft.config.schema import DataSection
from lisaft.console import warn
from lisaft.data.audit import SplitAudit, audit_split, check_split
from lisaft.data.formats import data_format
from lisaft.data.formats.base import DataWarning, Example, Fit
from lisaft.data.formats.instruction import render_instruction_prompt
from lisaft.data.order import ORDER_SALT
from lisaft.data.read import Rows, read_rows, rename_columns
from lisaft.errors import LisaftError

__all__ = ["DataWarning", "Split", "build_examples", "data_splits", "load_splits", "render_instruction_prompt"]


def build_examples(rows: Rows, fmt: str, tokenizer, template: str | None = None,
                   roles: dict[str, str] | None = None) -> list[Example]:
    """Every row as an example of data.format `fmt`, before data.max_seq_len cuts it."""
    return data_format(fmt).examples(rows, tokenizer, template, roles or {})


@dataclass
class Split:
    """One split as `lisaft train` builds it: its rows, their examples as tokenized, what
    data.max_seq_len did to them (`fit.kept` train) and the data audit's counts."""

    rows: Rows
    examples: list[Example]
    fit: Fit
    audit: SplitAudit


def build_split(rows: Rows, section: DataSection, tokenizer) -> Split:
    """Tokenize, cut to data.max_seq_len, count, and refuse what would train on nothing: the one
    path of `lisaft train` and `lisaft data` alike."""
    fmt = data_format(section.format)
    examples = fmt.examples(rows, tokenizer, section.template, section.roles)
    fit = fmt.fitted(examples, section.max_seq_len, rows)
    audit = audit_split(fmt, rows, examples, fit, tokenizer)
    check_split(audit, rows, tokenizer)
    return Split(rows, examples, fit, audit)


def _held_out(n: int, fraction: float, seed: int) -> list[int]:
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise LisaftError(
            f"data.eval_fraction: holding out {fraction} of {n} rows would leave nothing to train on"
        )
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([ORDER_SALT, seed & (2**63 - 1), 1])))
    return sorted(int(i) for i in rng.permutation(n)[:n_eval])


def read_splits(section: DataSection, seed: int) -> tuple[Rows, Rows | None]:
    """Train rows and eval rows (from data.eval, else a seeded held-out data.eval_fraction of the
    train rows, else None)."""
    train_rows = rename_columns(read_rows(section.train, "data.train", section.subset, section.train_split),
                                section.columns)
    eval_rows: Rows | None = None
    if section.eval is not None:
        if section.eval_fraction > 0:
            warn("data.eval is set, so data.eval_fraction is ignored", DataWarning, stacklevel=3)
        eval_rows = rename_columns(read_rows(section.eval, "data.eval", section.subset, section.eval_split),
                                   section.columns)
    elif section.eval_fraction > 0:
        # Split rows, not examples, so the held-out set does not depend on the tokenizer.
        held = _held_out(len(train_rows.rows), section.eval_fraction, seed)
        held_set = set(held)
        eval_rows = train_rows.subset(held)
        eval_rows.key = "data.train (held out by data.eval_fraction)"
        train_rows = train_rows.subset([i for i in range(len(train_rows.rows)) if i not in held_set])
    return train_rows, eval_rows


def data_splits(section: DataSection, tokenizer, seed: int) -> tuple[Split, Split | None]:
    """The train split and the eval split (None without one), built and checked."""
    train_rows, eval_rows = read_splits(section, seed)
    train = build_split(train_rows, section, tokenizer)
    return train, build_split(eval_rows, section, tokenizer) if eval_rows is not None else None


def load_splits(section: DataSection, tokenizer, seed: int) -> tuple[list[Example], list[Example] | None]:
    """Train examples and eval examples (None without an eval split), as they train."""
    train, evals = data_splits(section, tokenizer, seed)
    return train.fit.kept, evals.fit.kept if evals is not None else None
