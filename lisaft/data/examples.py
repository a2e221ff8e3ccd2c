"""Training examples: rows (read by lisaft/data/read.py) turned into token ids with loss masks,
and the held-out split. The order the loop sees them in is lisaft/data/order.py's; how they
become tensors, lisaft/data/collate.py's.

An example is a plain dict {"input_ids": [...], "labels": [...]}. Labels are aligned with
input_ids (the model shifts them), and -100 marks a position with no loss. Only the response
carries loss:

- text: every token of `text`, then EOS.
- instruction: the prompt below, no loss; then `output` + EOS, with loss.

      ### Instruction:
      {instruction}

      ### Input:
      {input}

      ### Response:
      {output}<eos>

  The `### Input:` block is left out when `input` is absent or empty. `data.template` replaces
  this prompt with the recipe's own ({instruction}, {input}); `render_instruction_prompt` is the
  one place either is rendered, for training and for `lisaft generate`.
- chat: `messages` rendered with the tokenizer's chat template; loss on assistant turns only.
  Roles are system, user and assistant; `data.roles` maps other names onto them (ShareGPT's
  human/gpt), and any other role is an error naming the row.
  A turn's span is found by rendering the conversation up to the turn with the generation
  prompt, and up to and including the turn: the text between the two renders is the turn's
  content plus whatever the template closes it with (e.g. an end-of-turn token). The full
  conversation is tokenized once and a token carries loss when it starts inside such a span,
  so token boundaries are never guessed from partial renders. EOS is appended only when the
  template closes the last assistant turn with no special token at all.

Before any of this, `data.columns` renames fields (prompt -> instruction; ShareGPT's
conversations/from/value -> messages/role/content), see lisaft/data/read.py.

Examples longer than data.max_seq_len are cut at the end. data.packing puts whole train
examples into rows afterwards (lisaft/data/packing.py), each document seeing only itself; eval
examples are never packed, so eval metrics are the same numbers with packing on or off.

The order is a pure function of (seed, epoch, position), so a resumed run continues with
exactly the batches an uninterrupted one would have seen, and N data-parallel ranks together
see what one process with an N times larger batch sees.
"""

from __future__ import annotations

import warnings
from typing import Literal, overload

import numpy as np

from lisaft.config.schema import CHAT_ROLES, DataSection
from lisaft.console import LisaftWarning, first_line
from lisaft.data.collate import IGNORE_INDEX, Example
from lisaft.data.order import ORDER_SALT
from lisaft.data.read import Rows, read_rows, rename_columns
from lisaft.errors import LisaftError

# The instruction template. Pieces, not one format string, so a tokenizer can hold each as a
# single added token (the quickstart tokenizer does).
INSTRUCTION_HEADER = "### Instruction:\n"
INPUT_HEADER = "\n\n### Input:\n"
RESPONSE_HEADER = "\n\n### Response:\n"


class DataWarning(LisaftWarning):
    """Something was changed or dropped in the data; the run goes on."""


def render_instruction_prompt(instruction: str, input: str | None = None, template: str | None = None) -> str:
    """The prompt an instruction row trains with (and `lisaft generate` prompts with): the recipe's
    data.template when set, else the ### Instruction layout above."""
    if template is not None:
        return template.format(instruction=instruction, input=input or "")
    prompt = INSTRUCTION_HEADER + instruction
    if input:
        prompt += INPUT_HEADER + input
    return prompt + RESPONSE_HEADER


# ---------------------------------------------------------------------------------------------
# Rows to examples


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
        have = ", ".join(sorted(map(str, row))) or "none"
        raise LisaftError(f"{rows.where(i)}: missing field {name!r} (fields: {have})")
    if not isinstance(value, str):
        raise LisaftError(f"{rows.where(i)}: field {name!r} must be a string, got {type(value).__name__}")
    return value


class _Tokens:
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


def prompt_prefix(tokenizer) -> list[int]:
    """What every text and instruction example starts with (typically BOS): a prompt for
    generation must start the same way."""
    return _Tokens(tokenizer).prefix


def _text_examples(rows: Rows, tokens: _Tokens) -> list[Example]:
    eos = tokens.need_eos(rows.key)
    texts = [row_field(rows, i, "text") for i in range(len(rows.rows))]
    out = []
    for ids in tokens.encode(texts):
        ids = tokens.prefix + ids + [eos]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def _instruction_examples(rows: Rows, tokens: _Tokens, template: str | None) -> list[Example]:
    eos = tokens.need_eos(rows.key)
    prompts, outputs = [], []
    for i in range(len(rows.rows)):
        instruction = row_field(rows, i, "instruction")
        inp = row_field(rows, i, "input", optional=True)
        outputs.append(row_field(rows, i, "output"))
        prompts.append(render_instruction_prompt(instruction, inp, template))
    out = []
    # Prompt and response are tokenized apart so the boundary between loss and no loss falls on
    # a token boundary; the prompt ends in a newline, where tokenizers do not merge across.
    for p, r in zip(tokens.encode(prompts), tokens.encode(outputs)):
        p = tokens.prefix + p
        r = r + [eos]
        out.append({"input_ids": p + r, "labels": [IGNORE_INDEX] * len(p) + r})
    return out


# Role names of common chat datasets (ShareGPT, OpenAssistant, Gemini-style exports) and the role
# each means; a name not here gets no guess, since a wrong one would move the loss onto the user.
_KNOWN_ROLES = {
    "human": "user", "prompter": "user", "question": "user", "customer": "user",
    "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant", "chatgpt": "assistant",
    "answer": "assistant", "response": "assistant", "assistant": "assistant", "user": "user",
    "system": "system", "sys": "system", "system_prompt": "system",
}


def _role_hint(name: str) -> str:
    target = _KNOWN_ROLES.get(name.strip().lower())
    if target is not None:
        return f"e.g. {{{name}: {target}}}"
    return f"to the role it plays: {{{name}: user}}, {{{name}: assistant}} or {{{name}: system}}"


def chat_messages(rows: Rows, i: int, roles: dict[str, str]) -> list[dict]:
    """A chat row's turns with data.roles applied, or an error naming the row (training and
    `lisaft generate` alike)."""
    messages = rows.rows[i].get("messages")
    if messages is None:
        have = ", ".join(sorted(map(str, rows.rows[i]))) or "none"
        raise LisaftError(f"{rows.where(i)}: missing field 'messages' (fields: {have})")
    if not isinstance(messages, list) or not messages:
        raise LisaftError(f"{rows.where(i)}: field 'messages' must be a non-empty list of {{role, content}}")
    clean = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise LisaftError(
                f"{rows.where(i)}: messages[{j}] must be an object with string 'role' and 'content'"
            )
        role = roles.get(m["role"], m["role"])
        if role not in CHAT_ROLES:
            raise LisaftError(
                f"{rows.where(i)}: messages[{j}] has role {m['role']!r}, not one of {', '.join(CHAT_ROLES)}; "
                f"map it with data.roles, {_role_hint(m['role'])}")
        clean.append({"role": role, "content": m["content"]})
    return clean


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _chat_example(rows: Rows, i: int, tokenizer, tokens: _Tokens, special: set[int],
                  roles: dict[str, str]) -> Example:
    messages = chat_messages(rows, i, roles)
    try:
        full = _render(tokenizer, messages, False)
        spans = []
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = _render(tokenizer, messages[:j], True) if j else ""
            through = _render(tokenizer, messages[: j + 1], False)
            if not (through.startswith(before) and full.startswith(through)):
                raise LisaftError(
                    f"{rows.where(i)}: the chat template renders earlier turns differently once later "
                    "turns follow, so assistant turns cannot be located; use a template that renders "
                    "conversations incrementally"
                )
            spans.append((len(before), len(through)))
    except LisaftError:
        raise
    except Exception as e:  # jinja errors from the template itself (e.g. role order rules)
        raise LisaftError(f"{rows.where(i)}: the chat template rejected this conversation: {first_line(e)}") from None

    # The rendered text carries the template's own BOS, so nothing is added while tokenizing.
    if tokenizer.is_fast:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, starts = enc["input_ids"], [s for s, _ in enc["offset_mapping"]]
        labels = [
            t if any(a <= s < b for a, b in spans) else IGNORE_INDEX for t, s in zip(ids, starts)
        ]
    else:
        # No offsets: measure each span in tokens by encoding the text up to its ends.
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        labels = [IGNORE_INDEX] * len(ids)
        for a, b in spans:
            lo = len(tokenizer(full[:a], add_special_tokens=False)["input_ids"])
            hi = len(tokenizer(full[:b], add_special_tokens=False)["input_ids"])
            labels[lo:hi] = ids[lo:hi]
    if spans and spans[-1][1] == len(full) and not _turn_has_special(ids, labels, special):
        # The conversation ends on an assistant turn the template leaves open: without an EOS to
        # learn, the model would never stop generating.
        eos = tokens.need_eos(rows.key)
        ids = list(ids) + [eos]
        labels = labels + [eos]
    return {"input_ids": list(ids), "labels": labels}


def _turn_has_special(ids: list[int], labels: list[int], special: set[int]) -> bool:
    """Whether the last labelled run of tokens (the final assistant turn) holds a special token,
    i.e. the template already closes the turn with something the model can learn to emit."""
    j = len(labels) - 1
    while j >= 0 and labels[j] == IGNORE_INDEX:
        j -= 1
    while j >= 0 and labels[j] != IGNORE_INDEX:
        if ids[j] in special:
            return True
        j -= 1
    return False


def _chat_examples(rows: Rows, tokenizer, tokens: _Tokens, roles: dict[str, str]) -> list[Example]:
    if not getattr(tokenizer, "chat_template", None):
        raise LisaftError(f"{rows.key}: data.format is chat but the tokenizer has no chat template")
    special = set(tokenizer.all_special_ids)
    return [_chat_example(rows, i, tokenizer, tokens, special, roles) for i in range(len(rows.rows))]


def build_examples(rows: Rows, fmt: str, tokenizer, template: str | None = None,
                   roles: dict[str, str] | None = None) -> list[Example]:
    tokens = _Tokens(tokenizer)
    if fmt == "text":
        return _text_examples(rows, tokens)
    if fmt == "instruction":
        return _instruction_examples(rows, tokens, template)
    return _chat_examples(rows, tokenizer, tokens, roles or {})


def _numbers(rows: Rows, indices: list[int], shown: int = 5) -> str:
    """Where the examples came from: "lines 4, 17 and 90", or the first few and how many more."""
    names = [str(rows.numbers[i]) for i in indices[:shown]]
    more = len(indices) - len(names)
    listed = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
    if more:
        listed = ", ".join(names) + f" and {more} more"
    return f"{rows.unit}{'s' if len(indices) > 1 else ''} {listed}"


def _truncate_and_filter(examples: list[Example], max_seq_len: int, rows: Rows) -> list[Example]:
    truncated, dropped = [], []
    kept = []
    for i, ex in enumerate(examples):
        if len(ex["input_ids"]) > max_seq_len:
            truncated.append(i)
            ex = {"input_ids": ex["input_ids"][:max_seq_len], "labels": ex["labels"][:max_seq_len]}
        # The label at position 0 is never predicted (nothing precedes it), so an example needs a
        # loss-carrying label after it to teach anything.
        if all(l == IGNORE_INDEX for l in ex["labels"][1:]):
            dropped.append(i)
            continue
        kept.append(ex)
    where = f"{rows.key}: {rows.source}"
    if truncated:
        warnings.warn(
            f"{where}: {len(truncated)} of {len(examples)} examples were longer than data.max_seq_len="
            f"{max_seq_len} and were cut at the end ({_numbers(rows, truncated)})", DataWarning, stacklevel=3,
        )
    if dropped:
        warnings.warn(
            f"{where}: dropped {len(dropped)} of {len(examples)} examples with no response tokens left "
            f"to learn from (prompt fills data.max_seq_len={max_seq_len}, or no assistant turn): "
            f"{_numbers(rows, dropped)}", DataWarning, stacklevel=3,
        )
    if not kept:
        raise LisaftError(f"{where}: no usable examples: every example lost its response tokens")
    return kept


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

    train = _truncate_and_filter(
        build_examples(train_rows, section.format, tokenizer, section.template, section.roles),
        section.max_seq_len, train_rows
    )
    evals = None
    if eval_rows is not None:
        evals = _truncate_and_filter(
            build_examples(eval_rows, section.format, tokenizer, section.template, section.roles),
            section.max_seq_len, eval_rows
        )
    return train, evals

