"""`lisaft data RECIPE`: the data audit before training. The recipe is read with its --set
overrides and the splits are built by lisaft/data/examples.py's `data_splits`, the path
`lisaft train` takes (tokenization, data.max_seq_len's cut, the masks and the refusals), so what
is shown is what trains; lisaft/data/audit.py counts. This module renders: a few examples with
their loss-carrying tokens marked, and each split's counts, as text or as JSON (docs/data.md
lists the fields)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from lisaft.config.schema import Recipe, load_recipe
from lisaft.data.audit import marked
from lisaft.data.examples import Split, data_splits
from lisaft.data.formats.base import IGNORE_INDEX
from lisaft.data.formats.preference import prompt_length
from lisaft.data.packing import pack_examples

# Around the tokens that carry loss in the text view.
LOSS_OPEN, LOSS_CLOSE = "[[", "]]"
# Tokens shown each side of a pair's prompt/answer split.
SPLIT_TOKENS = 3


# A stage's own audit (lisaft/grpo/audit.py, from the layer above): its JSON, None when the recipe
# is not of that stage, and its lines.
StageAudit = Callable[[Recipe, list[Split]], tuple[dict | None, list[str]]]


def data_command(recipe_path: Path, overrides: list[str], json_out: bool = False, shown: int = 3,
                 stage_audit: StageAudit | None = None) -> int:
    """Audit the recipe's data as `lisaft train` would build it; returns the exit code (a split
    that would train on nothing raises LisaftError). `stage_audit`: GRPO's, which the cli hands in."""
    from lisaft.model.load import load_tokenizer

    recipe = load_recipe(recipe_path, overrides)
    tokenizer = load_tokenizer(recipe.model)
    splits = [s for s in data_splits(recipe.data, tokenizer, recipe.training.seed) if s is not None]
    report = {
        "recipe": str(recipe_path), "format": recipe.data.format, "max_seq_len": recipe.data.max_seq_len,
        "tokenizer": {"eos": tokenizer.eos_token, "unk": tokenizer.unk_token},
        "splits": [s.audit.as_json() for s in splits],
        "packing": _packing(recipe, splits[0]),
        "examples": [_example(splits[0], i, tokenizer) for i in range(min(shown, len(splits[0].examples)))],
    }
    stage, stage_lines = stage_audit(recipe, splits) if stage_audit is not None else (None, [])
    if stage is not None:
        report["grpo"] = stage
    print(json.dumps(report, indent=1) if json_out else render(report, stage_lines), flush=True)
    return 0


def _packing(recipe, train: Split) -> dict | None:
    """data.packing's rows, as `lisaft train` packs the train examples (eval is never packed)."""
    if not recipe.data.packing:
        return None
    packing = pack_examples(train.fit.kept, recipe.data.max_seq_len, recipe.training.seed)
    return {"examples": packing.n_examples, "rows": len(packing.rows), "fill": packing.fill}


def _sequence(example: dict, raw: dict, tokenizer, start: int = 0) -> dict:
    labels = example["labels"]
    return {"tokens": len(labels), "loss_tokens": sum(label != IGNORE_INDEX for label in labels[1:]),
            "truncated": len(labels) < len(raw["labels"]),
            "segments": [{"text": text, "loss": loss} for text, loss in marked(example, tokenizer, start)]}


def _example(split: Split, i: int, tokenizer) -> dict:
    rows, cut, raw = split.rows, split.fit.cut[i], split.examples[i]
    head = {"split": rows.key, "row": f"{rows.unit} {rows.numbers[i]}", "dropped": i in split.fit.dropped}
    if "desirable" in cut:
        head["desirable"] = cut["desirable"]
    if "chosen" not in cut:
        return {**head, **_sequence(cut, raw, tokenizer)}
    p = prompt_length(cut["chosen"])
    prompt = tokenizer.decode(cut["chosen"]["input_ids"][:p], skip_special_tokens=False,
                              clean_up_tokenization_spaces=False)
    # The tokens either side of where the prompt ends, as the tokenizer spells them: the prompt and
    # the answers are tokenized apart, so a space or a word cut there shows here.
    boundary = {"prompt": tokenizer.convert_ids_to_tokens(cut["chosen"]["input_ids"][max(p - SPLIT_TOKENS, 0):p]),
                **{k: tokenizer.convert_ids_to_tokens(cut[k]["input_ids"][p:p + SPLIT_TOKENS])
                   for k in ("chosen", "rejected")}}
    return {**head, "prompt": prompt, "boundary": boundary,
            **{k: _sequence(cut[k], raw[k], tokenizer, start=p) for k in ("chosen", "rejected")}}


def _text(sequence: dict) -> str:
    return "".join(f"{LOSS_OPEN}{s['text']}{LOSS_CLOSE}" if s["loss"] else s["text"] for s in sequence["segments"])


def render(report: dict, stage_lines: list[str] | None = None) -> str:
    """The report as text: the counts of each split (and `stage_lines`: a stage's own), then the
    examples."""
    lines = [f"{report['recipe']}: data.format {report['format']}, data.max_seq_len {report['max_seq_len']}"]
    for split in report["splits"]:
        line = (f"{split['key']}: {split['source']}: {split['rows']:,} rows, {split['dropped']:,} dropped "
                "with no loss token")
        if len(split["sequences"]) > 1:  # pairs: a pair is cut when either answer is
            line += (f", {split['truncated']:,} pairs cut ({split['truncated_share']:.1%}), "
                     f"{split['same_answers']:,} with the same chosen and rejected tokens once cut")
        if split["desirable"] is not None:  # unpaired feedback: how the labels split the rows that train
            trains = split["rows"] - split["dropped"]
            line += f"; {split['desirable']:,} desirable, {trains - split['desirable']:,} undesirable"
        lines.append(line)
        for name, seq in split["sequences"].items():
            lines += [f"  {'' if name == 'examples' else name + ' '}{line}" for line in _counts(seq, report)]
    if report["packing"]:
        p = report["packing"]
        lines.append(f"data.packing: {p['examples']:,} train examples in {p['rows']:,} rows, "
                     f"{p['fill']:.1%} of positions real")
    lines += stage_lines or []
    shown = len(report["examples"])
    if shown:
        as_trained = f"{shown} train examples as they train" if shown != 1 else "1 train example as it trains"
        lines.append(f"\n{as_trained}; the tokens that carry loss are between {LOSS_OPEN} and {LOSS_CLOSE}:")
    for ex in report["examples"]:
        lines.append("")
        if "prompt" in ex:
            lines.append(f"--- {ex['row']}, prompt:")
            lines.append(ex["prompt"])
            lines.append(_boundary_line(ex["boundary"]))
            for k in ("chosen", "rejected"):
                lines.append(f"--- {k}: {_about(ex[k])}")
                lines.append(_text(ex[k]))
        else:
            label = {True: ", desirable", False: ", undesirable"}.get(ex.get("desirable"), "")
            dropped = ", dropped: no loss token" if ex["dropped"] else ""
            lines.append(f"--- {ex['row']}: {_about(ex)}{label}{dropped}")
            lines.append(_text(ex))
    return "\n".join(lines)


def _boundary_line(boundary: dict) -> str:
    tokens = {k: " ".join(map(repr, v)) for k, v in boundary.items()}
    return (f"--- the split as tokens: {tokens['prompt']} | chosen {tokens['chosen']} | "
            f"rejected {tokens['rejected']}")


def _about(seq: dict) -> str:
    return f"{seq['tokens']} tokens, {seq['loss_tokens']} carry loss" + (", cut" if seq["truncated"] else "")


def _counts(seq: dict, report: dict) -> list[str]:
    unk = ("the tokenizer has no unknown token" if seq["unk_tokens"] is None else
           f"{seq['unk_tokens']:,} of them {report['tokenizer']['unk']} ({seq['unk_share']:.2%})")
    trains = seq["count"] - seq["no_loss"]
    return [f"length in tokens: p50 {seq['tokens_p50']:,}, p95 {seq['tokens_p95']:,}, max {seq['tokens_max']:,}; "
            f"{seq['truncated']:,} cut to {report['max_seq_len']:,} ({seq['truncated_share']:.1%})",
            f"loss on {seq['loss_tokens']:,} of {seq['trained_tokens']:,} tokens ({seq['loss_share']:.1%}), {unk}; "
            f"EOS or a turn end carries loss in {seq['stop_examples']:,} of {trains:,} ({seq['stop_share']:.1%})"]
