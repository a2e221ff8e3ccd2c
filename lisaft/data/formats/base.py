"""What every data format shares: the format object's interface, a row's text field, what the
tokenizer adds around a text, and cutting examples to data.max_seq_len.

A format (one module in this package) turns rows into examples for training, renders a row's
prompt for `lisaft generate` exactly as training laid it out, and describes the fields it reads.
An example is a plain dict {"input_ids": [...], "labels": [...]}: labels aligned with input_ids
(the model shifts them), IGNORE_INDEX marking a position with no loss. A preference pair is
{"chosen": example, "rejected": example}.
"""

from __future__ import annotations

from typing import ClassVar, Literal, overload

from lisaft.console import LisaftWarning, warn
from lisaft.data.read import Rows
from lisaft.errors import LisaftError

IGNORE_INDEX = -100

Example = dict  # {"input_ids": list[int], "labels": list[int]}; a pair: {"chosen": ..., "rejected": ...}


class DataWarning(LisaftWarning):
    """Something was changed or dropped in the data; the run goes on."""


class Prompt:
    """A row's prompt for `lisaft generate`: token ids as training laid them out, the expected
    answer when the row holds one, and the text the "> " line shows."""

    def __init__(self, ids: list[int], reference: str | None, shown: str):
        self.ids, self.reference, self.shown = ids, reference, shown


class DataFormat:
    """One value of data.format. A new format is one module in lisaft/data/formats/ with one
    subclass; the package finds it (and data.format's Literal in config/schema.py names it)."""

    name: ClassVar[str]
    fields: ClassVar[str]            # the fields a row holds, for messages and docs
    required: ClassVar[tuple[str, ...]] = ()  # the fields every row must hold (a missing one names the format they fit)
    sequences_per_example: ClassVar[int] = 1  # sequences one example puts through the forward
    input_note: ClassVar[str | None] = None   # why `lisaft generate --input` has no place, if it has none

    def examples(self, rows: Rows, tokenizer, template: str | None, roles: dict[str, str]) -> list[Example]:
        raise NotImplementedError

    def fit(self, examples: list[Example], max_seq_len: int, rows: Rows) -> list[Example]:
        """The examples cut to max_seq_len, and those left with nothing to learn dropped, each counted."""
        return self.fitted(examples, max_seq_len, rows).kept

    def fitted(self, examples: list[Example], max_seq_len: int, rows: Rows) -> Fit:
        """What data.max_seq_len does to each example (the data audit reads it); warns of the cut
        and dropped ones and refuses data left with nothing to learn."""
        return truncate_and_filter(examples, max_seq_len, rows)

    def prompt(self, tokenizer, rows: Rows, i: int, template: str | None, roles: dict[str, str]) -> Prompt:
        raise NotImplementedError

    def command_line_row(self, prompt: str, input_text: str | None) -> dict:
        """The row `lisaft generate --prompt TEXT [--input TEXT]` stands for."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.name}: {self.fields}"


@overload
def row_field(rows: Rows, i: int, name: str, optional: Literal[False] = False) -> str: ...


@overload
def row_field(rows: Rows, i: int, name: str, optional: bool) -> str | None: ...


def row_field(rows: Rows, i: int, name: str, optional: bool = False) -> str | None:
    """A row's text field, or an error naming the row; `lisaft generate` checks its rows with it too."""
    row = rows.rows[i]
    value = row.get(name)
    if value is None:
        if optional:
            return None
        raise missing_field(rows, i, name)
    if not isinstance(value, str):
        raise LisaftError(f"{rows.where(i)}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def missing_field(rows: Rows, i: int, name: str) -> LisaftError:
    fields = set(map(str, rows.rows[i]))
    have = ", ".join(sorted(fields)) or "none"
    return LisaftError(f"{rows.where(i)}: missing field {name!r} (fields: {have}){_way_out(fields, name)}")


def _way_out(fields: set[str], name: str) -> str:
    """What the row's fields suggest: ShareGPT's names, another format's fields, or a rename."""
    from lisaft.data.formats import FORMATS

    if name == "messages" and "conversations" in fields:
        return ("; ShareGPT data: set data.columns {conversations: messages, from: role, value: content} and "
                "data.roles {human: user, gpt: assistant}")
    for fmt in FORMATS.values():
        if fmt.required and name not in fmt.required and set(fmt.required) <= fields:
            return f"; these are data.format {fmt.name}'s fields: set data.format: {fmt.name}"
    return "; data.columns renames a dataset's fields (old: new)" if fields else ""


class Fit:
    """What data.max_seq_len did to a split: every example as cut (in row order), the indices of
    those cut and of those dropped for having no loss token left; `kept` are the ones that train."""

    def __init__(self, cut: list[Example], truncated: list[int], dropped: list[int]):
        self.cut, self.truncated, self.dropped = cut, truncated, dropped

    @property
    def kept(self) -> list[Example]:
        gone = set(self.dropped)
        return [ex for i, ex in enumerate(self.cut) if i not in gone]


def carries_loss(labels: list[int]) -> bool:
    """Whether a label after position 0 carries loss: the one at 0 is never predicted (nothing
    precedes it), so an example needs one after it to teach anything."""
    return any(label != IGNORE_INDEX for label in labels[1:])


class Tokens:
    """What the tokenizer adds around a text, found by probing it rather than trusting flags
    that differ between tokenizer classes."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        bare = tokenizer("x", add_special_tokens=False)["input_ids"]
        full = tokenizer("x")["input_ids"]
        # Whatever sits before the text (typically BOS) starts every prompt; what the tokenizer
        # would add after it is not used, EOS is appended explicitly.
        self.prefix: list[int] = []
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                self.prefix = list(full[:start])
                break
        self.eos: int | None = tokenizer.eos_token_id

    def need_eos(self, key: str) -> int:
        if self.eos is None:
            raise LisaftError(f"{key}: the tokenizer has no EOS token, so a response cannot be ended")
        return self.eos

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.tok(texts, add_special_tokens=False)["input_ids"]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def numbers(rows: Rows, indices: list[int], shown: int = 5) -> str:
    """Where the examples came from: "lines 4, 17 and 90", or the first few and how many more."""
    names = [str(rows.numbers[i]) for i in indices[:shown]]
    more = len(indices) - len(names)
    listed = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
    if more:
        listed = ", ".join(names) + f" and {more} more"
    return f"{rows.unit}{'s' if len(indices) > 1 else ''} {listed}"


def truncate_and_filter(examples: list[Example], max_seq_len: int, rows: Rows) -> Fit:
    truncated, dropped = [], []
    cut = []
    for i, ex in enumerate(examples):
        if len(ex["input_ids"]) > max_seq_len:
            truncated.append(i)
            ex = {"input_ids": ex["input_ids"][:max_seq_len], "labels": ex["labels"][:max_seq_len]}
        if not carries_loss(ex["labels"]):
            dropped.append(i)
        cut.append(ex)
    where = f"{rows.key}: {rows.source}"
    if len(dropped) == len(examples):
        raise LisaftError(f"{where}: nothing to train on: {_lost(examples, dropped, max_seq_len)}")
    if truncated:
        warn(
            f"{where}: {len(truncated)} of {len(examples)} examples were longer than data.max_seq_len="
            f"{max_seq_len} and were cut at the end ({numbers(rows, truncated)})", DataWarning, stacklevel=4,
        )
    if dropped:
        warn(
            f"{where}: dropped {len(dropped)} of {len(examples)} examples with no response tokens left "
            f"to learn from (prompt fills data.max_seq_len={max_seq_len}, or no assistant turn): "
            f"{numbers(rows, dropped)}", DataWarning, stacklevel=4,
        )
    return Fit(cut, truncated, dropped)


def _lost(examples: list[Example], dropped: list[int], max_seq_len: int) -> str:
    """Why every example lost its loss tokens: cut away by data.max_seq_len, or never had any."""
    had = [i for i in dropped if carries_loss(examples[i]["labels"])]
    if not had:
        return (f"none of the {len(examples)} examples has a token that carries loss (no response, "
                "or no assistant turn)")
    first = min(next(j for j, label in enumerate(examples[i]["labels"][1:], 1) if label != IGNORE_INDEX)
                for i in had)
    said = f"{len(had)} of {len(examples)} examples lost every loss token to data.max_seq_len={max_seq_len}"
    if len(had) < len(examples):
        said += f", the other {len(examples) - len(had)} have none"
    return f"{said}; the earliest loss token sits at position {first}, so raise data.max_seq_len above it"
