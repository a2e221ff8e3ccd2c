"""`lisaft generate`: try a trained model with the prompt format its run trained on.

A prompt is built exactly as training built the prompt part of an example (lisaft/data/examples.py): rows
are read and renamed by the run's data.columns, chat turns mapped by its data.roles and checked by
the same functions training uses; instruction rows go through the run's template, chat rows
through the tokenizer's chat template with the generation prompt, text rows stay as they are.
Greedy unless --temperature > 0. The model is RUN/final (a Hugging Face folder) or a checkpoint,
built from the checkpoint's own recipe as training built it (lisaft/generate/target.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lisaft.console import warn
from lisaft.data.read import Rows
from lisaft.errors import LisaftError
from lisaft.generate.target import Target, load_model, load_tokenizer, resolve_target


@dataclass
class Prompt:
    row: dict  # the row as given (a file's own field names), shown under --json
    ids: list[int]  # the prompt's token ids, as training laid them out
    reference: str | None  # the expected answer, when the row holds one
    shown: str  # what the "> " line shows of the prompt


def read_prompts(prompt: str | None, input_text: str | None, input_file: Path | None,
                 fmt: str, limit: int | None, columns: dict[str, str] | None = None) -> tuple[Rows, list[dict]]:
    """Rows in the training format of `fmt` (a file's renamed by the run's data.columns, as
    training renames them), and the rows as given. A row may carry its expected answer
    (`output`, or a final assistant message), which is then compared with the generation."""
    if (prompt is None) == (input_file is None):
        raise LisaftError("give --prompt TEXT or --input-file FILE.jsonl (one of them)")
    if prompt is not None:
        from lisaft.data.formats import data_format

        row = data_format(fmt).command_line_row(prompt, input_text)
        return Rows([row], "--prompt", "the command line", "row"), [row]
    from lisaft.data.read import read_rows, rename_columns

    rows = read_rows(str(input_file), "--input-file")
    if limit:
        rows = rows.subset(list(range(min(limit, len(rows.rows)))))
    given = list(rows.rows)  # rename_columns builds new dicts, so these stay as the file has them
    return rename_columns(rows, columns or {}), given


def prompt_and_reference(tokenizer, fmt: str, rows: Rows, i: int, template: str | None = None,
                         roles: dict[str, str] | None = None) -> tuple[list[int], str | None, str]:
    """Row i's prompt token ids, its expected answer if any, and the part of it to show."""
    from lisaft.data.formats import data_format

    p = data_format(fmt).prompt(tokenizer, rows, i, template, roles or {})
    return p.ids, p.reference, p.shown


def _ignored_input(fmt: str, input_file: Path | None) -> str | None:
    """What to say when --input has no place to go (it fills an instruction row's `input`)."""
    from lisaft.data.formats import data_format

    if input_file is not None:
        return "--input is ignored with --input-file: each row holds its own input"
    return data_format(fmt).input_note


def _prompts(target: Target, tokenizer, rows: Rows, given: list[dict], from_file: bool) -> list[Prompt]:
    data = target.data
    template = data.template if data is not None else None
    # A file's role names are the dataset's, mapped as training mapped them; --prompt's are lisaft's.
    roles = data.roles if data is not None and from_file else {}
    out = []
    for i, row in enumerate(given):
        ids, reference, shown = prompt_and_reference(tokenizer, target.format, rows, i, template, roles)
        out.append(Prompt(row, ids, reference, shown))
    return out


def generate_command(path: Path, prompt: str | None = None, input_text: str | None = None,
                     input_file: Path | None = None, fmt: str | None = None, limit: int | None = None,
                     max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0, json_out: bool = False) -> int:
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1 or (limit is not None and limit < 1):
        raise LisaftError("--temperature must be >= 0, --top-p in (0, 1], --max-new-tokens and --limit >= 1")
    target = resolve_target(path, fmt)
    if input_text is not None and (note := _ignored_input(target.format, input_file)):
        warn(note)
    rows, given = read_prompts(prompt, input_text, input_file, target.format, limit,
                               target.data.columns if target.data is not None else None)
    # Every row is checked before the model loads: a bad line costs no wait.
    tokenizer = load_tokenizer(target)
    prompts = _prompts(target, tokenizer, rows, given, from_file=input_file is not None)
    model = load_model(target)
    if not json_out:
        print(f"{target.model_dir}: {target.format} prompts ({target.source}); "
              + ("greedy" if temperature == 0 else f"sampled, temperature {temperature}, top-p {top_p}"),
              flush=True)
    exact = 0
    for p in prompts:
        output = _generate(model, tokenizer, p.ids, max_new_tokens, temperature, top_p, seed)
        hit = None if p.reference is None else output.strip() == p.reference.strip()
        exact += bool(hit)
        _show(p, output, hit, json_out)
    with_ref = sum(p.reference is not None for p in prompts)
    if with_ref and not json_out:
        print(f"exact match: {exact}/{with_ref} ({exact / with_ref:.0%})")
    return 0


def _generate(model, tokenizer, ids: list[int], max_new_tokens: int, temperature: float,
              top_p: float, seed: int) -> str:
    import torch

    torch.manual_seed(seed)  # each prompt's sample is reproducible on its own
    input_ids = torch.tensor([ids], device=model.device)
    sampled = temperature > 0
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
        do_sample=sampled, temperature=temperature if sampled else None, top_p=top_p if sampled else None,
        top_k=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def _show(prompt: Prompt, output: str, hit: bool | None, json_out: bool) -> None:
    if json_out:
        print(json.dumps({"prompt": prompt.row, "output": output, "reference": prompt.reference, "exact": hit}),
              flush=True)
        return
    mark = "" if hit is None else ("  [exact]" if hit else f"  [expected {prompt.reference!r}]")
    print(f"> {prompt.shown}\n{output}{mark}", flush=True)
