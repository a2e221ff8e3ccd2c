"""data.format instruction: the prompt below, no loss; then `output` + EOS, with loss.

      ### Instruction:
      {instruction}

      ### Input:
      {input}

      ### Response:
      {output}<eos>

The `### Input:` block is left out when `input` is absent or empty. `data.template` replaces
this prompt with the recipe's own ({instruction}, {input}); `render_instruction_prompt` is the
one place either is rendered, for training and for `lisaft generate`.
"""

from __future__ import annotations

from lisaft.data.formats.base import IGNORE_INDEX, DataFormat, Example, Prompt, Tokens, encode, row_field
from lisaft.data.read import Rows

# The instruction template. Pieces, not one format string, so a tokenizer can hold each as a
# single added token (the quickstart tokenizer does).
INSTRUCTION_HEADER = "### Instruction:\n"
INPUT_HEADER = "\n\n### Input:\n"
RESPONSE_HEADER = "\n\n### Response:\n"


def render_instruction_prompt(instruction: str, input: str | None = None, template: str | None = None) -> str:
    """The prompt an instruction row trains with (and `lisaft generate` prompts with): the recipe's
    data.template when set, else the ### Instruction layout above."""
    if template is not None:
        return template.format(instruction=instruction, input=input or "")
    prompt = INSTRUCTION_HEADER + instruction
    if input:
        prompt += INPUT_HEADER + input
    return prompt + RESPONSE_HEADER


class Instruction(DataFormat):
    name = "instruction"
    required = ("instruction", "output")
    fields = "`instruction`, optional `input`, `output` (loss on the output only)"

    def examples(self, rows: Rows, tokenizer, template: str | None, roles: dict[str, str]) -> list[Example]:
        tokens = Tokens(tokenizer)
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

    def prompt(self, tokenizer, rows: Rows, i: int, template: str | None, roles: dict[str, str]) -> Prompt:
        instruction, given = row_field(rows, i, "instruction"), row_field(rows, i, "input", optional=True)
        text = render_instruction_prompt(instruction, given, template)
        shown = instruction + (f": {given}" if given else "")
        return Prompt(Tokens(tokenizer).prefix + encode(tokenizer, text), row_field(rows, i, "output", optional=True),
                      shown)

    def command_line_row(self, prompt: str, input_text: str | None) -> dict:
        return {"instruction": prompt, "input": input_text}
