"""Preference objectives (DPO, SimPO, ORPO) on pairs: one forward over a micro-batch's chosen and
rejected sequences together, each sequence's log-prob of its answer from the chunked token loss.

For pair i, logp_c/logp_r are the summed log-probs of the chosen/rejected answer's tokens (EOS
included), n_c/n_r their token counts and ref_c/ref_r the reference's sums (DPO only, computed
once before step 1: lisaft/train/preference.py). With β = preference.beta:

- dpo:   −log σ(β((logp_c − ref_c) − (logp_r − ref_r)))                 (Rafailov et al. 2023)
         rewards β(logp_c − ref_c), β(logp_r − ref_r).
- simpo: −log σ(β(logp_c/n_c − logp_r/n_r) − γ)                          (Meng et al. 2024)
         rewards β·logp_c/n_c, β·logp_r/n_r.
- orpo:  −logp_c/n_c − β·log σ(log odds_c − log odds_r), odds = p/(1 − p) with p = exp(logp/n), the
         answer's mean per-token probability                             (Hong et al. 2024)
         rewards β·logp_c/n_c, β·logp_r/n_r (TRL's).
         The NLL term is each chosen answer's mean over its tokens, then the mean over pairs (TRL
         averages over all chosen tokens of a batch instead), so every pair weighs the same.

A step's loss is the sum of its pairs' losses divided by the global number of pairs (every
micro-batch of every rank), as SFT divides by the global number of label tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lisaft.config.preference_losses import preference_loss
from lisaft.config.schema import PreferenceSection
from lisaft.data.collate import IGNORE_INDEX, collate
from lisaft.model.loss import token_nll

# What a step reports of its pairs, summed over them (divided by the pairs when logged).
METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected")


def collate_pairs(pairs: list[dict], pad_id: int) -> dict:
    """One padded batch of the pairs' chosen sequences, then their rejected ones (2 x pairs rows),
    with the reference's log-probs [pairs, 2] when the pairs carry them."""
    batch = collate([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], pad_id)
    if all("ref" in p for p in pairs):
        batch["ref"] = torch.tensor([p["ref"] for p in pairs], dtype=torch.float32)
    return batch


def pair_positions(pairs: list[dict]) -> int:
    """Real (not padding) positions of the pairs' two sequences."""
    return sum(len(p[k]["input_ids"]) for p in pairs for k in ("chosen", "rejected"))


def sequence_logps(model, batch: dict, sharded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-prob of its scored tokens (float32) and how many it has (`sharded`:
    model/loss.py token_loss_sum's)."""
    nll = token_nll(model, batch, sharded)
    return -nll.sum(1), (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1)


def _log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    # log(p / (1 - p)) with log(1 - p) = log(-expm1(log p)), exact near p = 1 where log1p(-exp) is not.
    return mean_logp - torch.log(-torch.expm1(mean_logp))


def pair_losses(section: PreferenceSection, logps: torch.Tensor, counts: torch.Tensor,
                ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the rewards of chosen and rejected, from logps and counts [2, pairs]
    (row 0 chosen, row 1 rejected) and the reference's [2, pairs] (a loss with a reference), as
    the loss's row in config/preference_losses.py says."""
    kind = preference_loss(section.loss)
    beta = section.beta
    scores = logps
    if kind.reference:
        assert ref is not None, "the reference log-probs are computed before step 1"
        scores = logps - ref
    if kind.per_token:
        scores = scores / counts.clamp(min=1)
    rewards = beta * scores
    if kind.form == "odds_ratio":
        odds_ratio = F.logsigmoid(_log_odds(scores[0]) - _log_odds(scores[1]))
        return -scores[0] - beta * odds_ratio, rewards[0], rewards[1]
    h = scores[0] - scores[1]
    if kind.form == "squared":
        return (h - 1 / (2 * beta)) ** 2, rewards[0], rewards[1]
    margin = section.gamma if "gamma" in kind.keys else 0.0
    return -F.logsigmoid(rewards[0] - rewards[1] - margin), rewards[0], rewards[1]


class PairObjective:
    """The step's preference loss: loss_sum(model, batch) for a collated batch of pairs, summing
    METRICS of the pairs it saw (detached, on the device) until `take_sums`."""

    def __init__(self, section: PreferenceSection, sharded: bool = False):
        self.section = section
        self.sharded = sharded  # the parallel strategy's sharded_forward
        self._sums: torch.Tensor | None = None

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        losses, sums = self.losses(model, batch)
        self._sums = sums if self._sums is None else self._sums + sums
        return losses.sum()

    def losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss, and METRICS summed over the batch's pairs."""
        logps, counts = sequence_logps(model, batch, self.sharded)
        pairs = logps.size(0) // 2
        logps, counts = logps.view(2, pairs), counts.view(2, pairs)
        ref = batch["ref"].t().to(logps.device) if "ref" in batch else None
        losses, chosen, rejected = pair_losses(self.section, logps, counts, ref)
        with torch.no_grad():
            sums = torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                                (chosen > rejected).float().sum(), logps[0].sum(), logps[1].sum()])
        return losses, sums.double()

    def take_sums(self, device) -> torch.Tensor:
        """METRICS summed since the last call (zeros when no pair was seen)."""
        sums = self._sums if self._sums is not None else torch.zeros(len(METRICS), dtype=torch.float64)
        self._sums = None
        return sums.to(device)
