"""One GRPO generation: sample G completions of each prompt on the policy, score them, turn the
rewards into advantages and cut the result into the micro-batches it feeds.

A generation batch holds batch_size x steps_per_generation completions on each rank: whole groups
on every rank, so a group's advantage needs nothing from another rank (TRL's groups may span
ranks; the advantages are the same, only batch scaling's std is then this rank's). The micro-batches
keep the groups in order (TRL shuffles them; the step's gradient is the same for dapo and
dr_grpo, and for grpo and bnpo at one micro-batch per generation).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from lisaft.config.grpo import GrpoSection
from lisaft.distributed import dist
from lisaft.grpo.advantages import advantages
from lisaft.grpo.generation import sample
from lisaft.grpo.loss import completion_logps, completion_mask
from lisaft.grpo.rewards import Reward, score
from lisaft.model.lora import adapters_off


@dataclass
class Rollout:
    """A generation batch: its micro-batches (host tensors), its figures summed on this rank, and
    a few of its completions to show."""

    batches: list[dict]
    sums: dict[str, float]
    samples: list[dict] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"batches": self.batches, "sums": self.sums}

    @classmethod
    def from_state(cls, sd: dict) -> Rollout:
        return cls(list(sd["batches"]), dict(sd["sums"]))


@dataclass(frozen=True)
class Policy:
    """What sampling and scoring need besides the model."""

    grpo: GrpoSection
    rewards: list[Reward]
    tokenizer: object
    eos_ids: list[int]


def _texts(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[str], list[list[int]]]:
    kept = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    return tokenizer.batch_decode(kept, skip_special_tokens=True), kept


def generate(model, policy: Policy, prompts: list[dict], batch_size: int, seeds: list[int], step: int,
             scored_logps: tuple[bool, bool], sharded: bool, reference=None) -> Rollout:
    """The rollout of `prompts` (each an example of data.format prompts), G completions each drawn
    from the prompt's seed in `seeds`, cut into micro-batches of `batch_size`; `scored_logps`:
    whether to keep the old policy's log-probs (the ratio moves away from 1 before the next
    generation) and the reference's (β > 0): of `reference`, a frozen copy, or with None the policy
    with its LoRA adapters off."""
    g = policy.grpo
    t0 = time.perf_counter()
    repeated = [p for p in prompts for _ in range(g.num_generations)]
    pad = policy.tokenizer.pad_token_id  # type: ignore[attr-defined]
    drawn = sample(model, [p["input_ids"] for p in repeated], g, pad, policy.eos_ids, seeds)
    ended = completion_mask(drawn.completion_ids, policy.eos_ids, False)
    truncated = ~torch.isin(drawn.completion_ids, torch.tensor(policy.eos_ids, device=ended.device)).any(dim=1)
    mask = completion_mask(drawn.completion_ids, policy.eos_ids, g.mask_truncated_completions)
    generation_s = time.perf_counter() - t0
    texts, ids = _texts(policy.tokenizer, drawn.completion_ids.cpu(), ended.cpu())
    completions = [[{"role": "assistant", "content": t}] if isinstance(p["prompt"], list) else t
                   for p, t in zip(repeated, texts, strict=True)]
    scored = score(policy.rewards, [p["prompt"] for p in repeated], completions, ids,
                   [p["columns"] for p in repeated], [p["where"] for p in repeated], step)
    adv = advantages(scored.total, g.num_generations, g.scale_rewards, drawn.completion_ids.device)
    input_ids = torch.cat([drawn.prompt_ids, drawn.completion_ids], dim=1)
    attention = torch.cat([drawn.prompt_mask, mask], dim=1)
    extra = _scored_logps(model, policy, input_ids, attention, mask.size(1), scored_logps, sharded, reference)
    tokens = dist.all_reduce_sum(mask.sum().double()).item()  # dapo's count, over every rank
    batches = []
    for i in range(0, len(repeated), batch_size):
        rows = slice(i, i + batch_size)
        batches.append({"input_ids": input_ids[rows].cpu(), "attention_mask": attention[rows].cpu(),
                        "completion_mask": mask[rows].cpu(), "advantages": adv.values[rows].cpu(),
                        "generation_tokens": tokens,
                        **{k: v[rows].cpu() for k, v in extra.items()}})
    sums = _figures(policy, scored.per_func, scored.total, adv.zero_std, ended, truncated, generation_s)
    shown = [{"prompt": p["prompt"], "completion": c, "reward": r, "advantage": a}
             for p, c, r, a in zip(repeated, completions, _floats(scored.total), adv.values.tolist(), strict=True)]
    return Rollout(batches, sums, shown[:g.num_generations * 2])


def _floats(t: torch.Tensor) -> list[float | None]:
    return [None if math.isnan(v) else v for v in t.tolist()]


@torch.no_grad()
def _scored_logps(model, policy: Policy, input_ids, attention, width: int, which: tuple[bool, bool],
                  sharded: bool, reference) -> dict[str, torch.Tensor]:
    old, ref = which
    t = policy.grpo.temperature
    out = {}
    if old:
        out["old_logps"] = completion_logps(model, input_ids, attention, width, t, sharded)
    if ref and reference is not None:
        out["ref_logps"] = completion_logps(reference, input_ids, attention, width, t)
    elif ref:
        with adapters_off(model):
            out["ref_logps"] = completion_logps(model, input_ids, attention, width, t, sharded)
    return {k: v.float() for k, v in out.items()}


def _figures(policy: Policy, per_func: torch.Tensor, total: torch.Tensor, zero_std: torch.Tensor,
             ended: torch.Tensor, truncated: torch.Tensor, generation_s: float) -> dict[str, float]:
    """The generation's figures as sums and counts, so ranks add them before dividing."""
    kept = total[~total.isnan()]
    sums = {"reward_sum": kept.sum().item(), "reward_sq": kept.pow(2).sum().item(), "reward_n": float(kept.numel()),
            "completions": float(total.numel()), "zero_std": float(zero_std.sum().item()),
            "completion_tokens": float(ended.sum().item()), "truncated": float(truncated.sum().item()),
            "generation_s": generation_s}
    for j, r in enumerate(policy.rewards):
        col = per_func[:, j]
        col = col[~col.isnan()]
        sums[f"reward_{r.name}_sum"] = col.sum().item()
        sums[f"reward_{r.name}_n"] = float(col.numel())
    return sums


def figures(read: dict[str, float], rewards: list[Reward], beta: float) -> dict[str, float]:
    """Train record fields from the step's global sums (docs/grpo.md lists them)."""
    n, completions = max(read["reward_n"], 1.0), max(read["completions"], 1.0)
    var = (read["reward_sq"] - read["reward_sum"] ** 2 / n) / max(n - 1, 1.0)
    out = {"reward": read["reward_sum"] / n, "reward_std": math.sqrt(max(var, 0.0)),
           **{f"reward_{r.name}": read[f"reward_{r.name}_sum"] / max(read[f"reward_{r.name}_n"], 1.0)
              for r in rewards},
           "frac_reward_zero_std": read["zero_std"] / completions,
           "completion_length": read["completion_tokens"] / completions,
           "completion_truncated": read["truncated"] / completions,
           "clip_ratio": read["clipped_tokens"] / max(read["loss_tokens"], 1.0),
           "generation_s": read["generation_s"] / max(dist.world_size(), 1)}
    if beta:
        out["kl"] = read["kl_sum"] / max(read["loss_tokens"], 1.0)
    return out
