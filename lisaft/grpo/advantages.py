"""GRPO's advantages: each completion's reward against its group's, as TRL 1.16 computes them
(the sum-then-normalise aggregation).

A group is G consecutive completions of one prompt. The advantage is r − mean(group), divided by
std + 1e-4 where std is the group's (scale_rewards group) or the whole global batch's, every
rank's completions together (batch), or left undivided (none). Means and stds skip NaN (a
completion every reward returned None for), the std with Bessel's correction; such a completion
gets advantage 0. A group whose rewards are all equal gives advantage 0 to each of its completions
and no gradient: `zero_std` marks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lisaft.config.grpo import ScaleRewards
from lisaft.distributed import dist

STD_FLOOR = 1e-4  # TRL's: keeps a near-equal group from blowing up


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaN, with Bessel's correction; NaN with fewer than 2 values."""
    mean = x.nanmean() if dim is None else x.nanmean(dim=dim, keepdim=True)
    sq = (x - mean).pow(2)
    var = sq.nanmean() if dim is None else sq.nanmean(dim=dim)
    count = (~x.isnan()).sum() if dim is None else (~x.isnan()).sum(dim=dim)
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.full_like(var, float("nan")))
    return var.sqrt()


def global_nanstd(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """nanstd of every rank's `x` together: the mean from every rank's sum and count, then every
    rank's squared deviations from it (two all-reduces, in float64 so that the ranks' order of
    addition stays below float32's rounding); the same two passes as nanstd in one process."""
    kept = ~x.isnan()
    v = x.double().to(device)
    count_sum = dist.all_reduce_sum(torch.stack([kept.sum().double().to(device), v.nansum()]))
    mean = count_sum[1] / count_sum[0].clamp(min=1)
    sq = dist.all_reduce_sum(torch.where(kept.to(device), (v - mean).pow(2), 0.0).sum())
    n = count_sum[0]  # fewer than 2 values: NaN, as nanstd, without reading n back to the host
    std = torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), float("nan"))
    return std.to(x.device, x.dtype)


@dataclass(frozen=True)
class Advantages:
    values: torch.Tensor    # [completions]
    zero_std: torch.Tensor  # [completions] bool: the group's (or batch's) rewards do not spread


def advantages(rewards: torch.Tensor, num_generations: int, scale: ScaleRewards,
               device: torch.device | None = None) -> Advantages:
    """The advantage of each of this rank's `rewards` [completions] (groups of `num_generations`
    in a row); `device`: where the ranks add up the batch's spread (the collective's device)."""
    groups = rewards.view(-1, num_generations)
    mean = groups.nanmean(dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = global_nanstd(rewards, device or rewards.device).expand_as(rewards)
    else:  # "none" divides by nothing, but its groups' spread is still what says they taught nothing
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    values = rewards - mean
    if scale != "none":
        values = values / (std + STD_FLOOR)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(values, nan=0.0), zero_std)
