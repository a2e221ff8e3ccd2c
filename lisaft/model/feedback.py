"""KTO (Ethayarajh et al. 2024) on unpaired feedback: each answer's loss from its log-ratio to the
reference and the batch's KL estimate.

For row i, r_i = logp_i − ref_i (the policy's and the reference's summed log-probs of its
completion, EOS included) and z the KL estimate: the mean over the step's mismatched sequences
(prompt i with another row's completion) of logp − ref, clamped at 0 and detached, as TRL's
KTOTrainer computes it. With β = preference.beta:

- desirable:    desirable_weight · (1 − σ(β(r − z)))
- undesirable:  undesirable_weight · (1 − σ(β(z − r)))

rewards β·r. A step's loss is the sum of its rows' losses divided by the global number of rows.
"""

from __future__ import annotations

import torch

from lisaft.config.schema import PreferenceSection

# What a step reports of its rows, summed over them: the numerators and their counts.
SUMS = ("reward_desirable", "reward_undesirable", "logp_desirable", "logp_undesirable", "desirable",
        "undesirable", "reward_accuracy")


def kto_losses(section: PreferenceSection, logps: torch.Tensor, ref: torch.Tensor, kl: torch.Tensor,
               desirable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's weighted loss and SUMS over the rows, from the policy's and the reference's
    summed log-probs [rows], the KL estimate (a scalar, detached) and the labels [rows] (bool)."""
    beta = section.beta
    ratio = logps - ref
    value = torch.where(desirable, torch.sigmoid(beta * (ratio - kl)), torch.sigmoid(beta * (kl - ratio)))
    weight = torch.where(desirable, section.desirable_weight, section.undesirable_weight).to(value.dtype)
    losses = weight * (1 - value)
    with torch.no_grad():
        rewards, d = beta * ratio.detach(), desirable.to(ratio.dtype)
        # reward_accuracy: answers whose value is above one half, i.e. whose reward sits on the side
        # of the KL estimate their label asks for.
        sums = torch.stack([(rewards * d).sum(), (rewards * (1 - d)).sum(), (logps.detach() * d).sum(),
                            (logps.detach() * (1 - d)).sum(), d.sum(), (1 - d).sum(), (value > 0.5).sum()])
    return losses, sums.double()


def kl_estimate(sum_and_count: torch.Tensor) -> torch.Tensor:
    """z from [Σ(logp − ref) over the mismatched sequences, their count] (summed over ranks)."""
    return (sum_and_count[0] / sum_and_count[1].clamp(min=1)).clamp(min=0)


def figures(sums: dict[str, float], kl: float) -> dict[str, float]:
    """Record fields from SUMS: means over the desirable and the undesirable rows (0 where a step
    held none of a kind), their reward margin, the reward accuracy over all rows and the KL estimate."""
    d, u = sums["desirable"], sums["undesirable"]
    out = {"reward_desirable": sums["reward_desirable"] / d if d else 0.0,
           "reward_undesirable": sums["reward_undesirable"] / u if u else 0.0,
           "logp_desirable": sums["logp_desirable"] / d if d else 0.0,
           "logp_undesirable": sums["logp_undesirable"] / u if u else 0.0}
    out["reward_margin"] = out["reward_desirable"] - out["reward_undesirable"]
    out["reward_accuracy"] = sums["reward_accuracy"] / max(d + u, 1.0)
    out["kl"] = kl
    return out
