"""One objective per training stage (docs/code.md, "Objectives"): the trainer calls the one
`choose` returns and never asks which stage runs.

    base.py     Objective (the interface and its defaults), StepBatches
    tokens.py   Tokens: SFT, the token loss over label tokens
    referenced.py  Referenced: the preference stages' reference pass, kept in checkpoints
    pairs.py    Pairs: DPO, SimPO, ORPO, IPO on preference pairs (a reference pass where the loss has one)
    feedback.py Feedback: KTO on unpaired feedback (the reference pass, the KL estimate)
    grpo.py     Grpo: online RL on verifiable rewards (its parts below the trainer: lisaft/grpo/)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lisaft.train.objectives.base import Objective, StepBatches

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from lisaft.config.schema import Recipe
    from lisaft.train.parallel import Strategy

__all__ = ["Objective", "StepBatches", "choose"]


def choose(recipe: Recipe, strategy: Strategy, tokenizer, device: torch.device,
           run_dir: Path | None = None) -> Objective:
    """The stage the recipe asks for: a new stage is one line here and one module beside it.
    `tokenizer`: anything with pad_token_id (GRPO's decodes its completions with it); `run_dir`:
    where GRPO writes its completions."""
    from lisaft.config.preference_losses import preference_loss
    from lisaft.train.objectives.feedback import Feedback
    from lisaft.train.objectives.grpo import Grpo
    from lisaft.train.objectives.pairs import Pairs
    from lisaft.train.objectives.tokens import Tokens

    pad_id = tokenizer.pad_token_id
    if recipe.grpo is not None:
        return Grpo(recipe, strategy, tokenizer, device, run_dir)
    if recipe.preference is not None:
        unpaired = preference_loss(recipe.preference.loss).data_format == "feedback"
        return (Feedback if unpaired else Pairs)(recipe, strategy, pad_id, device)
    return Tokens(strategy, pad_id, device)
