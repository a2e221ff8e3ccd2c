"""GRPO's reward functions: found from the recipe before the model loads, called as TRL 1.16
calls them, and held to what they return.

The call is TRL's: f(prompts=[...], completions=[...], completion_ids=[...], **kwargs), one entry
per completion (a prompt repeated once per completion of its group). Completions are strings for
string prompts and [{"role": "assistant", "content": text}] for message prompts. kwargs hold every
other column of the data row, one value per completion, plus `step` (the optimizer step being
trained) and `trainer_state` (an object whose global_step is the same, for rewards written
against TRL). A reward returns one float or None per completion; None leaves that reward out for
that completion, as TRL does.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from lisaft.config.grpo import GrpoSection
from lisaft.console import first_line
from lisaft.errors import LisaftError, RunFailed

RewardFunc = Callable[..., Sequence[float | None]]


def completion_text(completion: str | list[dict]) -> str:
    """A completion's text, whether a string or the assistant message TRL passes for chat prompts."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def normalise_answer(text: Any) -> str:
    """What exact_match compares: surrounding whitespace and one trailing period dropped, runs of
    whitespace made one space, case folded."""
    return " ".join(str(text).split()).removesuffix(".").strip().casefold()


def exact_match(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 where the completion, normalised, equals the row's `answer`, normalised; else 0.0;
    None for a row without an answer."""
    answers = answer if answer is not None else [None] * len(completions)
    return [None if a is None else float(normalise_answer(completion_text(c)) == normalise_answer(a))
            for c, a in zip(completions, answers, strict=True)]


def regex_reward(pattern: str) -> RewardFunc:
    """1.0 where `pattern` is found in the completion, else 0.0."""
    compiled = re.compile(pattern)

    def regex(prompts, completions, **kwargs) -> list[float | None]:
        return [float(compiled.search(completion_text(c)) is not None) for c in completions]

    return regex


@dataclass(frozen=True)
class Reward:
    name: str       # as metrics and messages name it: the function's own name
    func: RewardFunc
    weight: float


def load_rewards(grpo: GrpoSection) -> list[Reward]:
    """Every grpo.reward_funcs entry as a callable, or one line naming the entry that cannot be
    found; called before the model loads."""
    return [Reward(_name(spec), _load(spec, grpo), w) for spec, w in zip(grpo.reward_funcs, grpo.weights,
                                                                     strict=True)]


def _name(spec: str) -> str:
    return spec.rpartition(":")[2] or spec


def _load(spec: str, grpo: GrpoSection) -> RewardFunc:
    if spec == "exact_match":
        return exact_match
    if spec == "regex":
        assert grpo.regex is not None, "the schema requires grpo.regex with the regex reward"
        return regex_reward(grpo.regex)
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise LisaftError(f"grpo.reward_funcs: {spec!r} is not FILE.py:FUNCTION, package.module:FUNCTION, "
                          "exact_match or regex")
    module = _module_from_file(spec, Path(where)) if where.endswith(".py") else _module(spec, where)
    func = getattr(module, name, None)
    if not callable(func):
        raise LisaftError(f"grpo.reward_funcs: {spec}: {where} has no function {name!r}")
    return func


def _module_from_file(spec: str, path: Path) -> Any:
    if not path.is_file():
        raise LisaftError(f"grpo.reward_funcs: {spec}: file not found: {path}")
    name = f"lisaft_reward_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None, "a .py file always has a loader"
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's module: any error in it is theirs to fix
        del sys.modules[name]
        raise LisaftError(f"grpo.reward_funcs: {spec}: importing {path} failed: {type(e).__name__}: "
                          f"{first_line(e)}") from None
    return module


def _module(spec: str, dotted: str) -> Any:
    try:
        return importlib.import_module(dotted)
    except Exception as e:  # ModuleNotFoundError, or any error the module raises on import
        raise LisaftError(f"grpo.reward_funcs: {spec}: cannot import {dotted}: {type(e).__name__}: "
                          f"{first_line(e)}") from None


@dataclass(frozen=True)
class Scored:
    """One generation batch's rewards: per function [completions, functions] with NaN where a
    function returned None, and the weighted sum [completions], NaN where every function did."""

    per_func: torch.Tensor
    total: torch.Tensor


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: list[dict], where: list[str], step: int) -> Scored:
    """Every reward of every completion, or RunFailed naming the function and the data row of the
    first completion it failed on (`where`: each completion's row, as messages name it)."""
    n = len(completions)
    keys = sorted({k for c in columns for k in c})
    kwargs = {k: [c.get(k) for c in columns] for k in keys}
    per_func = torch.empty(n, len(rewards), dtype=torch.float64)
    for j, r in enumerate(rewards):
        try:
            out = r.func(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs,
                         step=step, trainer_state=SimpleNamespace(global_step=step))
        except Exception as e:  # the user's function: name it and its row rather than show a traceback
            row = _failing_row(r, prompts, completions, completion_ids, kwargs, step)
            at = f" on {where[row]}" if row is not None else ""
            raise RunFailed(f"grpo reward {r.name} raised{at}: {type(e).__name__}: {first_line(e)}") from None
        per_func[:, j] = _checked(r, out, n, where)
    weights = torch.tensor([r.weight for r in rewards], dtype=torch.float64)
    total = (per_func * weights).nansum(dim=1)
    total[per_func.isnan().all(dim=1)] = math.nan
    return Scored(per_func.float(), total.float())


def _checked(r: Reward, out: Any, n: int, where: list[str]) -> torch.Tensor:
    try:
        values = list(out)
    except TypeError:
        raise RunFailed(f"grpo reward {r.name} returned {type(out).__name__}, not a list of {n} "
                        "numbers (one per completion)") from None
    if len(values) != n:
        raise RunFailed(f"grpo reward {r.name} returned {len(values)} rewards for {n} completions (one per "
                        f"completion, {where[0]} first)")
    column = torch.empty(n, dtype=torch.float64)
    for i, v in enumerate(values):
        if v is None:
            column[i] = math.nan
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise RunFailed(f"grpo reward {r.name} returned {v!r} on {where[i]} (completion {i}); a reward "
                            "is a finite number, or None to leave it out")
        column[i] = float(v)
    return column


def _failing_row(r: Reward, prompts, completions, completion_ids, kwargs, step) -> int | None:
    """The first completion the function raises on when called on it alone, to name its row."""
    for i in range(len(completions)):
        one = {k: v[i:i + 1] for k, v in kwargs.items()}
        try:
            r.func(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                   completion_ids=completion_ids[i:i + 1], **one, step=step,
                   trainer_state=SimpleNamespace(global_step=step))
        except Exception:  # the one that fails is the one to name
            return i
    return None
