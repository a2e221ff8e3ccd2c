"""data.format preference: rows of `prompt`, `chosen` and `rejected`; each becomes a pair
{"chosen": example, "rejected": example} whose two sequences share the prompt's tokens (no loss)
and carry loss, i.e. are scored, on their own answer only.

Two shapes, as TRL names them:
- standard: three strings. The prompt is tokenized as the text and instruction formats start a
  text (the tokenizer's own prefix, typically BOS, then the prompt's tokens); each answer
  without special tokens, followed by EOS, which is scored with it.
- conversational: `prompt` a list of messages, `chosen`/`rejected` the assistant turn(s) that
  follow it, rendered with the chat template; the scored spans are found as the chat format
  finds assistant turns. Rows whose `chosen` and `rejected` hold the whole conversation
  (UltraFeedback's binarized sets) are split at the turns the two share: those are the prompt.

A row is refused, naming it, when an answer is empty or has no assistant turn, when chosen equals
rejected, when a conversational prompt ends with an assistant turn (a prefill, which the template
would close and answer with a new turn), or when the prompt fills data.max_seq_len. A longer pair
is cut at the end: its answers lose tokens, never its prompt; the cut pairs are counted in one
warning.
"""

from __future__ import annotations

from lisaft.console import warn
from lisaft.data.formats.base import (
    IGNORE_INDEX,
    DataFormat,
    DataWarning,
    Example,
    Fit,
    Prompt,
    Tokens,
    encode,
    missing_field,
    numbers,
    row_field,
)
from lisaft.data.formats.chat import chat_messages, chat_prompt_ids, conversation_example, split_conversations
from lisaft.data.read import Rows
from lisaft.errors import LisaftError

ANSWERS = ("chosen", "rejected")


def _turns(rows: Rows, i: int, roles: dict[str, str]) -> tuple[list[dict], dict[str, list[dict]]]:
    """A conversational row's prompt turns and each answer's turns."""
    row = rows.rows[i]
    answers = {k: chat_messages(rows, i, roles, k) for k in ANSWERS}
    if isinstance(row.get("prompt"), list):
        prompt = chat_messages(rows, i, roles, "prompt")
        # Whole conversations that repeat the prompt: keep what follows it.
        answers = {k: a[len(prompt):] if a[:len(prompt)] == prompt else a for k, a in answers.items()}
        return prompt, answers
    c, r = answers["chosen"], answers["rejected"]
    shared = 0
    while shared < min(len(c), len(r)) and c[shared] == r[shared]:
        shared += 1
    prompt = c[:shared]
    if not prompt and isinstance(row.get("prompt"), str):
        prompt = [{"role": "user", "content": row["prompt"]}]
    return prompt, {"chosen": c[shared:], "rejected": r[shared:]}


def _check_turns(rows: Rows, i: int, prompt: list[dict], answers: dict[str, list[dict]]) -> None:
    row = rows.rows[i]
    if row["chosen"] == row["rejected"]:  # as given: a whole conversation repeated would split into no answers
        raise LisaftError(f"{rows.where(i)}: chosen and rejected are the same "
                          f"{'conversation' if 'prompt' not in row else 'answer'}")
    if not prompt:
        raise LisaftError(f"{rows.where(i)}: no prompt: give field 'prompt', or chosen and rejected "
                          "conversations that share their first turns")
    if prompt[-1]["role"] == "assistant":
        # A prefill: the template would close that turn and score each answer as a new one after it.
        raise LisaftError(f"{rows.where(i)}: the prompt ends with an assistant turn (a prefill), which lisaft "
                          "does not continue: end the prompt with a user turn and put the assistant's text at "
                          "the start of both answers")
    for k, turns in answers.items():
        if not any(t["role"] == "assistant" for t in turns):
            raise LisaftError(f"{rows.where(i)}: the {k} conversation has no assistant turn after the prompt's "
                              f"{len(prompt)} turn{'s' if len(prompt) > 1 else ''}: nothing to score")
        if not any(t["role"] == "assistant" and t["content"].strip() for t in turns):
            raise LisaftError(f"{rows.where(i)}: the {k} answer is empty")
        if turns[0]["role"] != "assistant":
            raise LisaftError(f"{rows.where(i)}: the {k} answer must start with an assistant turn, got "
                              f"{turns[0]['role']!r}")
    if answers["chosen"] == answers["rejected"]:
        raise LisaftError(f"{rows.where(i)}: chosen and rejected are the same answer")


def _conversational_pair(rows: Rows, i: int, tokenizer, tokens: Tokens, special: set[int],
                         roles: dict[str, str]) -> Example:
    prompt, answers = _turns(rows, i, roles)
    _check_turns(rows, i, prompt, answers)
    return {k: conversation_example(tokenizer, prompt + answers[k], rows, i, tokens, special,
                                    first_turn=len(prompt)) for k in ANSWERS}


def _standard_pairs(rows: Rows, tokens: Tokens, indices: list[int]) -> dict[int, Example]:
    eos = tokens.need_eos(rows.key)
    fields = {k: [row_field(rows, i, k) for i in indices] for k in ("prompt", *ANSWERS)}
    for n, i in enumerate(indices):
        if not fields["prompt"][n].strip():
            raise LisaftError(f"{rows.where(i)}: the prompt is empty")
        for k in ANSWERS:
            if not fields[k][n].strip():
                raise LisaftError(f"{rows.where(i)}: the {k} answer is empty")
        if fields["chosen"][n] == fields["rejected"][n]:
            raise LisaftError(f"{rows.where(i)}: chosen and rejected are the same answer")
    _warn_of_spaced_prompts(rows, [i for n, i in enumerate(indices) if fields["prompt"][n][-1:].isspace()])
    encoded = {k: tokens.encode(v) for k, v in fields.items()}
    out = {}
    for n, i in enumerate(indices):
        p = tokens.prefix + encoded["prompt"][n]
        out[i] = {k: {"input_ids": p + encoded[k][n] + [eos],
                      "labels": [IGNORE_INDEX] * len(p) + encoded[k][n] + [eos]} for k in ANSWERS}
    return out


def _warn_of_spaced_prompts(rows: Rows, spaced: list[int]) -> None:
    """The prompt and each answer are tokenized apart (as TRL does), so a prompt's trailing space
    stays a token of its own, where the joined text would start the answer's first word with it
    ("Answer: " + "good": ':' ' ' | 'good', not ':' ' good')."""
    if spaced:
        warn(
            f"{rows.key}: {rows.source}: {len(spaced)} of {len(rows.rows)} string prompts end with whitespace "
            f"({numbers(rows, spaced)}); prompt and answers are tokenized apart, so it is a token of its own "
            "before each answer, not the start of the answer's first word as in the joined text: end the "
            "prompts without it and start the answers with it (`lisaft data --examples` shows the split)",
            DataWarning, stacklevel=4)


def prompt_length(example: Example) -> int:
    """Positions before the first scored token: the prompt's."""
    return next((j for j, label in enumerate(example["labels"]) if label != IGNORE_INDEX), len(example["labels"]))


class Preference(DataFormat):
    name = "preference"
    required = ("prompt", "chosen", "rejected")
    fields = ("`prompt`, `chosen`, `rejected`: strings (prompt tokens, then each answer plus EOS) or messages "
              "(the prompt's turns, then the assistant answer)")
    sequences_per_example = 2
    input_note = "--input is ignored for preference prompts; put the whole prompt in --prompt"

    def examples(self, rows: Rows, tokenizer, template: str | None, roles: dict[str, str]) -> list[Example]:
        tokens = Tokens(tokenizer)
        standard, talk = split_conversations(rows, tokenizer, self.name,
                                             lambda row: any(isinstance(row.get(k), list) for k in ANSWERS))
        special = set(tokenizer.all_special_ids)
        pairs = _standard_pairs(rows, tokens, standard)
        for i in talk:
            pairs[i] = _conversational_pair(rows, i, tokenizer, tokens, special, roles)
        return [pairs[i] for i in range(len(rows.rows))]

    def fitted(self, examples: list[Example], max_seq_len: int, rows: Rows) -> Fit:
        cut = []
        out = []
        for i, pair in enumerate(examples):
            prompt = prompt_length(pair["chosen"])
            if prompt >= max_seq_len:
                raise LisaftError(f"{rows.where(i)}: the prompt fills data.max_seq_len={max_seq_len} ({prompt} "
                                  "tokens), leaving no answer to score; shorten it or raise data.max_seq_len")
            if any(len(pair[k]["input_ids"]) > max_seq_len for k in ANSWERS):
                cut.append(i)
                pair = {k: {f: v[:max_seq_len] for f, v in pair[k].items()} for k in ANSWERS}
            out.append(pair)
        if cut:
            warn(
                f"{rows.key}: {rows.source}: {len(cut)} of {len(examples)} pairs were longer than data.max_seq_len="
                f"{max_seq_len}; their answers were cut at the end, their prompts kept ({numbers(rows, cut)})",
                DataWarning, stacklevel=4)
        return Fit(out, cut, [])

    def prompt(self, tokenizer, rows: Rows, i: int, template: str | None, roles: dict[str, str]) -> Prompt:
        row = rows.rows[i]
        if isinstance(row.get("prompt"), str):
            text = row_field(rows, i, "prompt")
            reference = row.get("chosen") if isinstance(row.get("chosen"), str) else None
            return Prompt(Tokens(tokenizer).prefix + encode(tokenizer, text), reference, text)
        if "prompt" not in row and not isinstance(row.get("chosen"), list):
            raise missing_field(rows, i, "prompt")
        turns = chat_messages(rows, i, roles, "prompt" if "prompt" in row else "chosen")
        answer: list[dict] = []
        if "prompt" not in row:  # a whole conversation: prompt with what precedes its last answer
            while turns and turns[-1]["role"] == "assistant":
                answer, turns = turns[-1:] + answer, turns[:-1]
        elif isinstance(row.get("chosen"), list):
            chosen = chat_messages(rows, i, roles, "chosen")
            answer = chosen[len(turns):] if chosen[:len(turns)] == turns else chosen
        if not turns:
            raise LisaftError(f"{rows.where(i)}: the conversation has no turn before its answer to prompt with")
        reference = answer[0]["content"] if answer else None
        return Prompt(chat_prompt_ids(tokenizer, turns, rows.where(i)), reference, turns[-1]["content"])

    def command_line_row(self, prompt: str, input_text: str | None) -> dict:
        return {"prompt": prompt}
