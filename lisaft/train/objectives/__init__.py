"""One objective per training stage (docs/code.md, "Objectives"): the trainer calls the one
`choose` returns and never asks which stage runs.

    base.py     Objective (the interface and its defaults), StepBatches
    tokens.py   Tokens: SFT, the token loss over label tokens
    pairs.py    Pairs: DPO, SimPO, ORPO on preference pairs (a reference pass where the loss has one)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lisaft.train.objectives.base import Objective, StepBatches

if TYPE_CHECKING:
    import torch

    from lisaft.config.schema import Recipe
    from lisaft.train.parallel import Strategy

__all__ = ["Objective", "StepBatches", "choose"]


def choose(recipe: Recipe, strategy: Strategy, pad_id: int, device: torch.device) -> Objective:
    """The stage the recipe asks for: a new stage is one line here and one module beside it."""
    from lisaft.train.objectives.pairs import Pairs
    from lisaft.train.objectives.tokens import Tokens

    if recipe.preference is not None:
        return Pairs(recipe, strategy, pad_id, device)
    return Tokens(strategy, pad_id, device)
