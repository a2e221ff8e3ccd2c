"""data.format prompts: rows holding a `prompt` for GRPO to sample completions of, as TRL's
prompt-only format.

- standard: `prompt` a string, tokenized as the text and instruction formats start a text (the
  tokenizer's own prefix, typically BOS, then the prompt's tokens); completions are strings.
- conversational: `prompt` a list of {role, content} messages, rendered with the chat template
  and its generation prompt (as `lisaft generate` prompts a chat run); completions are message
  lists, [{"role": "assistant", "content": text}], as TRL hands them to the rewards.

Every other field of the row (an `answer`, a test case) is kept in the example's `columns` and
passed to the reward functions by name. An example carries no loss of its own: its `labels` are
all IGNORE_INDEX, since what trains is the completions sampled from it. A prompt that fills
data.max_seq_len leaves no room to answer and is refused, naming its row.
"""

from __future__ import annotations

from lisaft.data.formats.base import IGNORE_INDEX, DataFormat, Example, Fit, Prompt, Tokens, encode, row_field
from lisaft.data.formats.chat import chat_messages, chat_prompt_ids, need_chat_template
from lisaft.data.read import Rows
from lisaft.errors import LisaftError


def prompt_example(ids: list[int], prompt: str | list[dict], columns: dict, where: str) -> Example:
    """One prompt as an example: its tokens, no loss of its own, the prompt as the rewards see it,
    the row's other fields, and where the row is (a failing reward names it)."""
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * len(ids), "prompt": prompt, "columns": columns,
            "where": where}


def conversational(example: Example) -> bool:
    """Whether the example's completions are message lists (a chat prompt) or strings."""
    return isinstance(example["prompt"], list)


class Prompts(DataFormat):
    name = "prompts"
    required = ("prompt",)
    fields = ("`prompt`: a string, or messages rendered with the chat template and its generation prompt; "
              "every other field goes to the rewards")
    input_note = "--input is ignored for prompts; put the whole prompt in --prompt"

    def examples(self, rows: Rows, tokenizer, template: str | None, roles: dict[str, str]) -> list[Example]:
        tokens = Tokens(tokenizer)
        out: list[Example] = []
        for i, row in enumerate(rows.rows):
            columns, where = {k: v for k, v in row.items() if k != "prompt"}, rows.where(i)
            if isinstance(row.get("prompt"), list):
                need_chat_template(tokenizer, rows.key, f"{self.name} with messages ({where})")
                turns = chat_messages(rows, i, roles, "prompt")
                out.append(prompt_example(chat_prompt_ids(tokenizer, turns, where), turns, columns, where))
                continue
            text = row_field(rows, i, "prompt")
            if not text.strip():
                raise LisaftError(f"{where}: the prompt is empty")
            out.append(prompt_example(tokens.prefix + encode(tokenizer, text), text, columns, where))
        return out

    def fitted(self, examples: list[Example], max_seq_len: int, rows: Rows) -> Fit:
        for i, ex in enumerate(examples):
            if len(ex["input_ids"]) >= max_seq_len:
                raise LisaftError(
                    f"{rows.where(i)}: the prompt fills data.max_seq_len={max_seq_len} ({len(ex['input_ids'])} "
                    "tokens), leaving no room for a completion; shorten it or raise data.max_seq_len")
        return Fit(list(examples), [], [])

    def prompt(self, tokenizer, rows: Rows, i: int, template: str | None, roles: dict[str, str]) -> Prompt:
        row = rows.rows[i]
        answer = row.get("answer")
        reference = str(answer) if answer is not None else None
        if isinstance(row.get("prompt"), list):
            turns = chat_messages(rows, i, roles, "prompt")
            return Prompt(chat_prompt_ids(tokenizer, turns, rows.where(i)), reference, turns[-1]["content"])
        text = row_field(rows, i, "prompt")
        return Prompt(Tokens(tokenizer).prefix + encode(tokenizer, text), reference, text)

    def command_line_row(self, prompt: str, input_text: str | None) -> dict:
        return {"prompt": prompt}
