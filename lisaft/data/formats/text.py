"""data.format text: every token of `text`, then EOS, carries loss."""

from __future__ import annotations

from lisaft.data.formats.base import DataFormat, Example, Prompt, Tokens, encode, row_field
from lisaft.data.read import Rows


class Text(DataFormat):
    name = "text"
    required = ("text",)
    fields = "field `text`"
    input_note = "--input is ignored for text prompts; put the whole text in --prompt"

    def examples(self, rows: Rows, tokenizer, template: str | None, roles: dict[str, str]) -> list[Example]:
        tokens = Tokens(tokenizer)
        eos = tokens.need_eos(rows.key)
        texts = [row_field(rows, i, "text") for i in range(len(rows.rows))]
        out = []
        for ids in tokens.encode(texts):
            ids = tokens.prefix + ids + [eos]
            out.append({"input_ids": ids, "labels": list(ids)})
        return out

    def prompt(self, tokenizer, rows: Rows, i: int, template: str | None, roles: dict[str, str]) -> Prompt:
        text = row_field(rows, i, "text")
        return Prompt(Tokens(tokenizer).prefix + encode(tokenizer, text), None, text)

    def command_line_row(self, prompt: str, input_text: str | None) -> dict:
        return {"text": prompt}
