"""`lisaft generate`: try a trained model with the prompt format its run trained on.

A prompt is built exactly as training built the prompt part of an example (lisaft/data.py):
instruction rows through the instruction template, chat rows through the tokenizer's chat
template with the generation prompt, text rows as they are. Greedy unless --temperature > 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lisaft.console import first_line
from lisaft.errors import LisaftError

FORMATS = ("text", "instruction", "chat")


@dataclass
class Target:
    model_dir: Path
    format: str
    source: str  # where the format came from, for the header line
    template: str | None = None  # the run's data.template for instruction rows


def resolve_target(path: Path, fmt: str | None) -> Target:
    """RUN (uses RUN/final and RUN/recipe.yaml), RUN/final, or any Hugging Face model folder."""
    path = Path(path)
    if not path.exists():
        raise LisaftError(f"{path}: no such run or model folder")
    run_dir = path if (path / "recipe.yaml").is_file() else path.parent
    model_dir = path / "final" if path == run_dir else path
    if not (model_dir / "config.json").is_file():
        what = ("the run has no final/ model yet; it is written when the run completes"
                if path == run_dir else "not a model folder (no config.json)")
        raise LisaftError(f"{model_dir}: {what}")
    if fmt is not None:
        if fmt not in FORMATS:
            raise LisaftError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
        return Target(model_dir, fmt, "--format")
    recipe_file = run_dir / "recipe.yaml"
    if recipe_file.is_file():
        from lisaft.recipe import load_recipe

        recipe = load_recipe(recipe_file, resolve_paths=False)
        return Target(model_dir, recipe.data.format, f"{recipe_file}: data.format", recipe.data.template)
    raise LisaftError(f"{model_dir}: no recipe.yaml beside it to say how prompts were formatted; "
                      "pass --format instruction|chat|text")


def read_prompts(prompt: str | None, input_text: str | None, input_file: Path | None,
                 fmt: str, limit: int | None) -> list[dict]:
    """Rows in the training format of `fmt`. A row may carry its expected answer (`output`, or a
    final assistant message), which is then compared with the generation."""
    if (prompt is None) == (input_file is None):
        raise LisaftError("give --prompt TEXT or --input-file FILE.jsonl (one of them)")
    if prompt is not None:
        if fmt == "instruction":
            return [{"instruction": prompt, "input": input_text}]
        if fmt == "chat":
            return [{"messages": [{"role": "user", "content": prompt}]}]
        return [{"text": prompt}]
    from lisaft.rows import read_rows

    rows = read_rows(str(input_file), "--input-file").rows
    return rows[:limit] if limit else rows


def prompt_and_reference(tokenizer, fmt: str, row: dict, where: str,
                         template: str | None = None) -> tuple[list[int], str | None]:
    """The prompt's token ids, as training laid them out, and the expected answer if any."""
    from lisaft.data import prompt_prefix, render_instruction_prompt

    try:
        if fmt == "instruction":
            text = render_instruction_prompt(row["instruction"], row.get("input"), template)
            return prompt_prefix(tokenizer) + _encode(tokenizer, text), row.get("output")
        if fmt == "chat":
            messages = list(row["messages"])
            reference = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The rendered text carries the template's own BOS, as in training.
            return _encode(tokenizer, text), reference
        return prompt_prefix(tokenizer) + _encode(tokenizer, row["text"]), None
    except (KeyError, TypeError, IndexError) as e:
        raise LisaftError(f"{where}: not a {fmt} row ({type(e).__name__}: {e}); see docs/data.md") from None


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_command(path: Path, prompt: str | None = None, input_text: str | None = None,
                     input_file: Path | None = None, fmt: str | None = None, limit: int | None = None,
                     max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0, json_out: bool = False) -> int:
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1 or (limit is not None and limit < 1):
        raise LisaftError("--temperature must be >= 0, --top-p in (0, 1], --max-new-tokens and --limit >= 1")
    target = resolve_target(path, fmt)
    rows = read_prompts(prompt, input_text, input_file, target.format, limit)
    model, tokenizer = _load(target.model_dir)
    encoded = [prompt_and_reference(tokenizer, target.format, row, f"--input-file: row {i + 1}",
                                    target.template) for i, row in enumerate(rows)]
    if not json_out:
        print(f"{target.model_dir}: {target.format} prompts ({target.source}); "
              + ("greedy" if temperature == 0 else f"sampled, temperature {temperature}, top-p {top_p}"),
              flush=True)
    exact = 0
    for row, (ids, reference) in zip(rows, encoded):
        output = _generate(model, tokenizer, ids, max_new_tokens, temperature, top_p, seed)
        hit = None if reference is None else output.strip() == reference.strip()
        exact += bool(hit)
        _show(row, output, reference, hit, json_out)
    with_ref = sum(ref is not None for _, ref in encoded)
    if with_ref and not json_out:
        print(f"exact match: {exact}/{with_ref} ({exact / with_ref:.0%})")
    return 0


def _load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise LisaftError(f"{model_dir}: cannot load the tokenizer: {str(e).splitlines()[0]}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    except (OSError, ValueError) as e:
        raise LisaftError(f"{model_dir}: cannot load the model: {first_line(e)}") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval(), tokenizer


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


def _show(row: dict, output: str, reference: str | None, hit: bool | None, json_out: bool) -> None:
    if json_out:
        print(json.dumps({"prompt": row, "output": output, "reference": reference, "exact": hit}), flush=True)
        return
    if "instruction" in row:
        shown = row["instruction"] + (f": {row['input']}" if row.get("input") else "")
    elif "messages" in row:
        shown = row["messages"][-1]["content"] if reference is None else row["messages"][-2]["content"]
    else:
        shown = row.get("text", "")
    mark = "" if hit is None else ("  [exact]" if hit else f"  [expected {reference!r}]")
    print(f"> {shown}\n{output}{mark}", flush=True)
