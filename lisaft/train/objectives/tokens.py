"""SFT: the token loss on the label tokens, normalised by the global count of label tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lisaft.data.collate import IGNORE_INDEX, collate, real_positions, to_device
from lisaft.distributed import dist
from lisaft.model.attention import varlen_attention
from lisaft.train.objectives.base import Objective, StepBatches

if TYPE_CHECKING:
    from torch import nn


class Tokens(Objective):
    """Next-token loss on the examples' label tokens (text, instruction, chat)."""

    def step_batches(self, model: nn.Module, step: int, examples: list[list[dict]]) -> StepBatches:
        # With a varlen attention kernel a micro-batch is one row of documents, no padding at all.
        flatten = varlen_attention(model)
        batches = [collate(ex, self.pad_id, flatten) for ex in examples]
        # Summed as tensors, not read: the host reads nothing until the step ends.
        labels = sum((b["labels"][:, 1:] != IGNORE_INDEX).sum() for b in batches)
        return StepBatches(batches, torch.as_tensor(labels, dtype=torch.float64),
                           sum(real_positions(ex) for ex in examples))

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.strategy.token_loss(model, batch)

    def evaluate(self, model: nn.Module, examples: list[dict], batches: list[list[int]], counted: int) -> dict:
        """eval_loss and teacher-forced argmax accuracy on response tokens."""
        totals = torch.zeros(3, dtype=torch.float64)
        for n, idx in enumerate(batches):
            batch = to_device(collate([examples[i] for i in idx], self.pad_id, varlen_attention(model)), self.device)
            loss_sum, n_tokens, n_correct = self.strategy.eval_sums(model, batch)
            if n < counted:
                totals += torch.tensor([loss_sum, n_tokens, n_correct], dtype=torch.float64)
        totals = dist.all_reduce_sum(totals.to(self.device)).cpu()
        tokens = max(totals[1].item(), 1.0)
        return {"eval_loss": totals[0].item() / tokens, "eval_token_accuracy": totals[2].item() / tokens}
