"""GRPO's loss, as TRL 1.16's GRPOTrainer computes it for its loss types grpo, bnpo, dr_grpo
and dapo at token-level importance sampling.

Per completion token: the ratio ρ = exp(logp − logp_old) against the log-probs the completion
was sampled with, the clipped surrogate −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A), plus with
β > 0 the k3 estimate of the KL to the reference, β(exp(ref − logp) − (ref − logp) − 1). The loss
types differ only in what the masked token losses are divided by (`Normaliser`).

lisaft adds the gradients of every micro-batch of a step and every rank; TRL averages ranks' and
divides each micro-batch by the accumulation steps. `Normaliser.divisor` folds both in, so the sum
of the micro-batch losses here is TRL's loss and its gradient TRL's gradient.

Log-probs come from model/loss.py's token_nll: chunked over the vocabulary, logits divided by the
sampling temperature first (as TRL does), so no [completions x length x vocab] tensor exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lisaft.config.grpo import GrpoLoss
from lisaft.data.collate import IGNORE_INDEX
from lisaft.model.loss import token_nll


def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                     temperature: float, sharded: bool = False) -> torch.Tensor:
    """Each completion token's log-prob [rows, completion_len] under `model` at `temperature`, for
    rows of left-padded prompt then completion (the last `completion_len` positions)."""
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :-completion_len] = IGNORE_INDEX
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return -token_nll(model, batch, sharded, temperature)[:, -completion_len:]


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int], mask_truncated: bool) -> torch.Tensor:
    """1 on each completion's tokens up to and including its first EOS, 0 after it; a completion
    with no EOS was cut at max_completion_length (truncated), and with `mask_truncated` is all 0."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    width = completion_ids.size(1)
    ended = is_eos.any(dim=1)
    first = torch.where(ended, is_eos.int().argmax(dim=1), torch.full_like(ended, width, dtype=torch.long))
    mask = (torch.arange(width, device=completion_ids.device)[None] <= first[:, None]).int()
    return mask * ended[:, None].int() if mask_truncated else mask


@dataclass(frozen=True)
class Normaliser:
    """What one micro-batch's masked token-loss sum is divided by, per loss type."""

    loss_type: GrpoLoss
    grad_accum_steps: int       # micro-batches per optimizer step
    ranks: int
    steps_per_generation: int
    max_completion_length: int
    generation_tokens: int      # active completion tokens of the whole generation batch, over every rank

    def micro_batch_loss(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the step's loss."""
        masked = per_token * mask
        steps = self.grad_accum_steps * self.ranks
        if self.loss_type == "grpo":  # each completion's mean, then the mean over completions
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / steps
        if self.loss_type == "bnpo":  # the micro-batch's active tokens
            return masked.sum() / mask.sum().clamp(min=1.0) / steps
        if self.loss_type == "dr_grpo":  # a constant: completions x max_completion_length
            return masked.sum() / (per_token.size(0) * self.max_completion_length) / steps
        # dapo: the generation batch's active tokens (over ranks); TRL rescales them to one
        # accumulation window when a generation feeds another number of micro-batches.
        tokens = max(self.generation_tokens, 1) * self.grad_accum_steps / self.steps_per_generation
        return masked.sum() / tokens


@dataclass(frozen=True)
class Clip:
    low: float   # ε_low
    high: float  # ε_high


@dataclass(frozen=True)
class TokenLosses:
    loss: torch.Tensor      # [rows, length]: each token's loss, KL included
    clipped: torch.Tensor   # [rows, length] bool: the clip took the gradient away
    kl: torch.Tensor | None  # [rows, length]: the k3 estimate, with β > 0


def token_losses(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, clip: Clip,
                 beta: float = 0.0, ref_logps: torch.Tensor | None = None,
                 bias_correction: bool = True) -> TokenLosses:
    """The clipped surrogate per token (old_logps None: the current ones detached, ratio 1, as TRL
    when the completions were sampled by these very weights), plus β times the k3 KL, times the
    ratio with `bias_correction` (TRL's use_bias_correction_kl)."""
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages[:, None]
    ratio = torch.exp(logps - old)
    clipped_ratio = torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
    loss = -torch.min(ratio * adv, clipped_ratio * adv)
    clipped = ((ratio < 1 - clip.low) & (adv < 0)) | ((ratio > 1 + clip.high) & (adv > 0))
    kl = None
    if beta != 0.0:
        assert ref_logps is not None, "β > 0 needs the reference's log-probs"
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if bias_correction:
            kl = kl * ratio
        loss = loss + beta * kl
    return TokenLosses(loss, clipped, kl)
