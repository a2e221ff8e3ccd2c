"""Preference pairs (DPO, SimPO, ORPO, ...): one forward over a micro-batch's chosen and rejected
sequences together, the loss of model/preference.py, normalised by the global number of pairs;
with a reference, its log-probs computed once before step 1 (train/preference.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lisaft.config.preference_losses import preference_loss
from lisaft.config.schema import Recipe
from lisaft.data.collate import to_device
from lisaft.distributed import dist
from lisaft.model.preference import METRICS, PairObjective, collate_pairs, pair_positions, sequence_logps
from lisaft.train.objectives.base import StepBatches
from lisaft.train.objectives.referenced import Referenced

if TYPE_CHECKING:
    from torch import nn

    from lisaft.train.parallel import Strategy


class Pairs(Referenced):
    """data.format preference under a pair loss of config/preference_losses.py."""

    unit = "pairs"

    def __init__(self, recipe: Recipe, strategy: Strategy, pad_id: int, device: torch.device) -> None:
        assert recipe.preference is not None  # objectives/__init__.py chose pairs for its section
        super().__init__(recipe, strategy, pad_id, device, preference_loss(recipe.preference.loss).reference)
        self.loss = PairObjective(self.section, strategy.sharded_forward)

    def describe(self) -> str:
        return f"{self.section.loss} β={self.section.beta:g}; "

    def _logps(self, model: nn.Module, pairs: list[dict]) -> torch.Tensor:
        batch = to_device(collate_pairs(pairs, self.pad_id), self.device)
        return sequence_logps(model, batch, self.strategy.sharded_forward)[0].view(2, len(pairs)).t()

    # -- the step -------------------------------------------------------------------------------

    def step_batches(self, model: nn.Module, step: int, examples: list[list[dict]]) -> StepBatches:
        return StepBatches([collate_pairs(ex, self.pad_id) for ex in examples],
                           torch.tensor(float(sum(len(ex) for ex in examples)), dtype=torch.float64),
                           sum(pair_positions(ex) for ex in examples))

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.loss.loss_sum(model, batch)

    def step_sums(self) -> dict[str, torch.Tensor]:
        return dict(zip(METRICS, self.loss.take_sums(self.device)))

    def step_figures(self, read: dict[str, float]) -> dict[str, float]:
        """The rewards and log-probs, mean over the step's pairs."""
        pairs = max(read["normaliser"], 1.0)
        return {m: read[m] / pairs for m in METRICS}

    # -- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[dict], batches: list[list[int]], counted: int) -> dict:
        return evaluate_pairs(self.loss, model, examples, batches, counted, self.pad_id, self.device)


@torch.no_grad()
def evaluate_pairs(objective: PairObjective, model, pairs: list[dict], batches: list[list[int]],
                   counted: int, pad_id: int, device: torch.device) -> dict:
    """eval_loss (the preference loss), eval_reward_accuracy, eval_reward_ties and eval_reward_margin,
    mean over pairs."""
    totals = torch.zeros(1 + len(METRICS), dtype=torch.float64)
    pairs_seen = 0
    for n, idx in enumerate(batches):
        batch = to_device(collate_pairs([pairs[i] for i in idx], pad_id), device)
        losses, sums = objective.losses(model, batch)
        if n < counted:
            totals += torch.cat([losses.double().sum()[None], sums]).cpu()
            pairs_seen += len(idx)
    totals = dist.all_reduce_sum(torch.cat([totals, torch.tensor([float(pairs_seen)], dtype=torch.float64)])
                                 .to(device)).cpu()
    n_pairs = max(totals[-1].item(), 1.0)
    named = dict(zip(METRICS, (totals[1:-1] / n_pairs).tolist()))
    return {"eval_loss": totals[0].item() / n_pairs, "eval_reward_accuracy": named["reward_accuracy"],
            "eval_reward_ties": named["reward_ties"], "eval_reward_margin": named["reward_margin"]}
