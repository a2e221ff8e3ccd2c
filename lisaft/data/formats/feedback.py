"""data.format feedback: unpaired feedback, rows of `prompt`, `completion` and a boolean `label`
(true: a desirable answer), as TRL's unpaired preference format; KTO trains on it. Each row is an
example {"input_ids", "labels", "desirable"}: the prompt's tokens carry no loss, the completion's
are scored.

Two shapes, as TRL names them:
- standard: `prompt` and `completion` strings: the tokenizer's own prefix (typically BOS) and the
  prompt's tokens, then the completion's without special tokens, followed by EOS.
- conversational: `prompt` a list of messages and `completion` the assistant turn(s) that follow
  it, rendered with the chat template; the scored span is found as the chat format finds
  assistant turns.

A row is refused, naming it, when the prompt or completion is empty or the label is not true or
false. A longer row is cut at the end and one that keeps no completion token is dropped, each
counted in one warning, as for the other formats.
"""

from __future__ import annotations

from lisaft.data.formats.base import (
    IGNORE_INDEX,
    DataFormat,
    Example,
    Fit,
    Prompt,
    Tokens,
    encode,
    missing_field,
    row_field,
    truncate_and_filter,
)
from lisaft.data.formats.chat import chat_messages, chat_prompt_ids, conversation_example, split_conversations
from lisaft.data.read import Rows
from lisaft.errors import LisaftError


def _label(rows: Rows, i: int) -> bool:
    value = rows.rows[i].get("label")
    if value is None:
        raise missing_field(rows, i, "label")
    if not isinstance(value, bool):
        raise LisaftError(f"{rows.where(i)}: field 'label' must be true (a desirable completion) or false, got "
                          f"{value!r}")
    return value


def _conversational(rows: Rows, i: int, tokenizer, tokens: Tokens, special: set[int],
                    roles: dict[str, str]) -> Example:
    prompt, completion = chat_messages(rows, i, roles, "prompt"), chat_messages(rows, i, roles, "completion")
    if completion[0]["role"] != "assistant" or not any(t["content"].strip() for t in completion):
        raise LisaftError(f"{rows.where(i)}: the completion must start with a non-empty assistant turn")
    return conversation_example(tokenizer, prompt + completion, rows, i, tokens, special, first_turn=len(prompt))


def _standard(rows: Rows, tokens: Tokens, indices: list[int]) -> dict[int, Example]:
    eos = tokens.need_eos(rows.key)
    fields = {k: [row_field(rows, i, k) for i in indices] for k in ("prompt", "completion")}
    for k, values in fields.items():
        for n, i in enumerate(indices):
            if not values[n].strip():
                raise LisaftError(f"{rows.where(i)}: the {k} is empty")
    encoded = {k: tokens.encode(v) for k, v in fields.items()}
    out = {}
    for n, i in enumerate(indices):
        p, c = tokens.prefix + encoded["prompt"][n], encoded["completion"][n] + [eos]
        out[i] = {"input_ids": p + c, "labels": [IGNORE_INDEX] * len(p) + c}
    return out


class Feedback(DataFormat):
    name = "feedback"
    required = ("prompt", "completion", "label")
    fields = ("`prompt`, `completion`: strings (prompt tokens, then the completion plus EOS) or messages (the "
              "prompt's turns, then the assistant answer); `label`: true for a desirable completion, false if not")
    input_note = "--input is ignored for feedback prompts; put the whole prompt in --prompt"

    def examples(self, rows: Rows, tokenizer, template: str | None, roles: dict[str, str]) -> list[Example]:
        tokens = Tokens(tokenizer)
        standard, talk = split_conversations(rows, tokenizer, self.name,
                                             lambda row: isinstance(row.get("prompt"), list))
        special = set(tokenizer.all_special_ids)
        out = _standard(rows, tokens, standard)
        for i in talk:
            out[i] = _conversational(rows, i, tokenizer, tokens, special, roles)
        return [{**out[i], "desirable": _label(rows, i)} for i in range(len(rows.rows))]

    def fitted(self, examples: list[Example], max_seq_len: int, rows: Rows) -> Fit:
        fit = truncate_and_filter(examples, max_seq_len, rows)
        # The cut keeps the tokens; the label goes with them.
        return Fit([{**c, "desirable": ex["desirable"]} for c, ex in zip(fit.cut, examples)], fit.truncated,
                   fit.dropped)

    def prompt(self, tokenizer, rows: Rows, i: int, template: str | None, roles: dict[str, str]) -> Prompt:
        row = rows.rows[i]
        # A desirable completion is what the model should answer; an undesirable one is no reference.
        good = row.get("label") is True
        if isinstance(row.get("prompt"), str):
            text = row_field(rows, i, "prompt")
            reference = row.get("completion") if good and isinstance(row.get("completion"), str) else None
            return Prompt(Tokens(tokenizer).prefix + encode(tokenizer, text), reference, text)
        turns = chat_messages(rows, i, roles, "prompt")
        answer = chat_messages(rows, i, roles, "completion") if good and "completion" in row else []
        return Prompt(chat_prompt_ids(tokenizer, turns, rows.where(i)), answer[0]["content"] if answer else None,
                      turns[-1]["content"])

    def command_line_row(self, prompt: str, input_text: str | None) -> dict:
        return {"prompt": prompt}
