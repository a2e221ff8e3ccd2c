"""`lisaft data` on a GRPO recipe: each split's prompts against the room a completion needs, and
the columns the reward functions read against the rows that hold them.

- Room: a prompt plus grpo.max_completion_length must fit data.max_seq_len; `lisaft train`
  refuses a longer prompt before the model loads (train/objectives/grpo.py), so the audit names
  every one and the data.max_seq_len the longest needs.
- Columns: a reward function's named parameters past TRL's own (prompts, completions,
  completion_ids, step, trainer_state) are the columns it reads, passed one value per completion;
  a row without one passes None (exact_match then scores nothing for that row's completions). A
  function that takes only **kwargs says nothing of what it reads: the audit lists the columns
  the rows hold instead.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from lisaft.config.schema import Recipe
from lisaft.data.examples import Split
from lisaft.data.formats.base import numbers
from lisaft.grpo.rewards import Reward, load_rewards

# What TRL's call passes besides the data's columns (grpo/rewards.py `score`).
CALL_ARGUMENTS = ("prompts", "completions", "completion_ids", "step", "trainer_state")


@dataclass(frozen=True)
class Reads:
    """The columns one reward function names, and whether it also takes **kwargs."""

    required: list[str]  # named without a default: every call passes them
    optional: list[str]
    any_column: bool


def reads(reward: Reward) -> Reads:
    try:
        params = inspect.signature(reward.func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return Reads([], [], True)
    named = [p for p in params if p.name not in CALL_ARGUMENTS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return Reads([p.name for p in named if p.default is p.empty], [p.name for p in named if p.default is not p.empty],
                 any(p.kind is p.VAR_KEYWORD for p in params))


def grpo_audit(recipe: Recipe, splits: list[Split]) -> dict | None:
    """The GRPO part of `lisaft data --json` (None without a grpo section): `prompt_limit`, and per
    split the prompts over it; per reward function the columns it reads and the rows without each."""
    g = recipe.grpo
    if g is None:
        return None
    limit = recipe.data.max_seq_len - g.max_completion_length
    out_splits = []
    for split in splits:
        lengths = [len(ex["input_ids"]) for ex in split.examples]
        over = [i for i, n in enumerate(lengths) if n > limit]
        out_splits.append({"key": split.rows.key, "rows": len(lengths), "longest": max(lengths, default=0),
                           "over_limit": len(over), "over_rows": [split.rows.numbers[i] for i in over],
                           "over_where": numbers(split.rows, over) if over else None,
                           "columns": sorted({k for ex in split.examples for k in ex["columns"]})})
    train = splits[0]
    rewards = []
    for r in load_rewards(g):
        said = reads(r)
        missing = {c: [i for i, ex in enumerate(train.examples) if ex["columns"].get(c) is None]
                   for c in said.required + said.optional}
        rewards.append({"name": r.name, "required": said.required, "optional": said.optional,
                        "any_column": said.any_column,
                        "missing": {c: {"rows": len(m), "where": numbers(train.rows, m) if m else None}
                                    for c, m in missing.items()}})
    return {"max_completion_length": g.max_completion_length, "prompt_limit": limit, "splits": out_splits,
            "rewards": rewards}


def grpo_lines(audit: dict | None, max_seq_len: int) -> list[str]:
    """The GRPO audit as text: the room for prompts, each split's, each reward's columns."""
    if audit is None:
        return []
    limit, c = audit["prompt_limit"], audit["max_completion_length"]
    lines = [f"grpo: data.max_seq_len {max_seq_len:,} - grpo.max_completion_length {c:,} leaves {limit:,} tokens "
             "for a prompt"]
    for s in audit["splits"]:
        if s["over_limit"]:
            lines.append(f"  {s['key']}: {s['over_limit']:,} of {s['rows']:,} prompts are longer ({s['over_where']}), "
                         f"the longest {s['longest']:,} tokens: `lisaft train` refuses them; raise data.max_seq_len "
                         f"to at least {s['longest'] + c:,}, or shorten them")
        else:
            lines.append(f"  {s['key']}: every prompt fits, the longest {s['longest']:,} tokens")
    train = audit["splits"][0]
    for r in audit["rewards"]:
        named = r["required"] + r["optional"]
        if not named:
            held = ", ".join(train["columns"]) or "none"
            lines.append(f"  reward {r['name']}: names no column" + (
                f"; it takes **kwargs, so it may read any (the train rows hold: {held})" if r["any_column"] else ""))
            continue
        for col in named:
            lines.append(f"  reward {r['name']} reads `{col}`: " + _missing(r["missing"][col], train["rows"],
                                                                          col in r["required"]))
    return lines


def _missing(m: dict, rows: int, required: bool) -> str:
    if not m["rows"]:
        return "every train row has it"
    if m["rows"] == rows and required:
        return ("no train row has it, and the function names it without a default: every call fails "
                "(data.columns renames a column)")
    return (f"{m['rows']:,} of {rows:,} train rows have none ({m['where']}); it gets None for their completions"
            + (" (data.columns renames a column)" if m["rows"] == rows else ""))


def data_audit(recipe: Recipe, splits: list[Split]) -> tuple[dict | None, list[str]]:
    """What `lisaft data` adds for a GRPO recipe: its JSON (None without a grpo section) and lines."""
    audit = grpo_audit(recipe, splits)
    return audit, grpo_lines(audit, recipe.data.max_seq_len)
