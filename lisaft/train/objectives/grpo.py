"""GRPO: online RL on verifiable rewards (data.format prompts, the grpo section).

The schedule is TRL 1.16's, counted in micro-batches m = step x grad_accum_steps + i: a generation
batch is sampled when m is a multiple of steps_per_generation x num_iterations and feeds
micro-batch m its slice m mod steps_per_generation. Its prompts are the examples the data order
hands that micro-batch over every rank, then the ones after it; rank r samples the r-th share
(batch_size x steps_per_generation / G of them), as one process at the global batch would give it.
Sampling is seeded by the generation's index and each group's index over every rank
(lisaft/grpo/generation.py), so two ranks equal one process at twice the batch, and a run that
generates at every step resumes with no sampling state; where a generation outlives its step
(num_iterations > 1, or steps_per_generation beyond grad_accum_steps) the rollout is kept in each
rank's checkpoint (`grpo_rollout`) and the generation-time log-probs are kept with it, as TRL
keeps them, so the ratio moves away from 1.

Each micro-batch's loss comes already divided as its loss type says (lisaft/grpo/loss.py
Normaliser), so the step's normaliser is 1: each rank gives 1 / ranks.
"""

from __future__ import annotations

import copy
import json
import time
from typing import TYPE_CHECKING, Any

import torch

from lisaft.checkpoint.components import OptionalComponent, PerRank
from lisaft.config.grpo import generation_shape
from lisaft.config.schema import Recipe
from lisaft.console import warn
from lisaft.distributed import dist
from lisaft.errors import LisaftError
from lisaft.grpo.generation import sampling_seed
from lisaft.grpo.loss import Clip, Normaliser, completion_logps, token_losses
from lisaft.grpo.rewards import load_rewards
from lisaft.grpo.rollout import Policy, Rollout, figures, generate
from lisaft.train.objectives.base import Objective, StepBatches

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from lisaft.train.parallel import Strategy


class RolloutBuffer:
    """The generation batch the next micro-batches read (a checkpoint component where it outlives
    a step)."""

    def __init__(self) -> None:
        self.rollout: Rollout | None = None

    def state_dict(self) -> dict:
        return {"rollout": self.rollout.state_dict() if self.rollout is not None else None}

    def load_state_dict(self, sd: dict) -> None:
        self.rollout = Rollout.from_state(sd["rollout"]) if sd.get("rollout") is not None else None


class Grpo(Objective):
    """Groups of sampled completions scored by the reward functions, TRL's clipped surrogate."""

    unit = "prompts"
    sees_global_batch = True

    def __init__(self, recipe: Recipe, strategy: Strategy, tokenizer, device: torch.device,
                 run_dir: Path | None = None) -> None:
        super().__init__(strategy, tokenizer.pad_token_id, device)
        assert recipe.grpo is not None  # objectives/__init__.py chose GRPO for its section
        self.recipe, self.grpo, self.run_dir = recipe, recipe.grpo, run_dir
        t = recipe.training
        self.spg = generation_shape(self.grpo, t.batch_size, t.grad_accum_steps).steps_per_generation
        self.every = self.spg * self.grpo.num_iterations  # micro-batches between generations
        # A generation that outlives its step: the weights move before its last micro-batch.
        self.outlives_step = t.grad_accum_steps % self.every != 0
        eos = tokenizer.eos_token_id
        self.policy = Policy(self.grpo, load_rewards(self.grpo), tokenizer, [eos] if isinstance(eos, int) else eos)
        self.buffer = RolloutBuffer()
        # Kept only where a generation outlives its step; the same object every call.
        self._kept = OptionalComponent(PerRank(self.buffer), warning="no GRPO rollout in the checkpoint: sampling "
                                       "anew") if self.outlives_step else None
        self.reference: nn.Module | None = None  # β > 0 without LoRA: a frozen copy of the initial policy
        self._sums: dict[str, torch.Tensor] = {}
        self._generation: dict[str, float] = {}
        self._step_began = 0.0  # perf_counter when the step's batches began: generation_share's divisor
        self._sampling_s = 0.0  # this step's seconds sampling (0 where it trains on an earlier generation)
        self._step = 0
        self._warned_flat = False

    def describe(self) -> str:
        return f"GRPO G={self.grpo.num_generations} {self.grpo.loss_type} β={self.grpo.beta:g}; "

    def before_model(self, train: list[dict], evals: list[dict] | None, resuming: bool) -> None:
        """Prompts that leave no room for a whole completion, and shipped rewards without the
        column they read, said before the model loads."""
        limit = self.recipe.data.max_seq_len - self.grpo.max_completion_length
        for examples in (train, evals or []):
            longest = max(examples, key=lambda ex: len(ex["input_ids"]), default=None)
            if longest is not None and len(longest["input_ids"]) > limit:
                raise LisaftError(
                    f"{longest['where']}: a prompt of {len(longest['input_ids'])} tokens plus "
                    f"grpo.max_completion_length {self.grpo.max_completion_length} is over data.max_seq_len "
                    f"{self.recipe.data.max_seq_len}; raise data.max_seq_len to at least "
                    f"{len(longest['input_ids']) + self.grpo.max_completion_length}, or shorten the prompt")
        if "exact_match" in self.grpo.reward_funcs and not any("answer" in ex["columns"] for ex in train):
            warn("grpo.reward_funcs: exact_match compares with each row's `answer`, and no train row has one: it "
                 "scores nothing (data.columns renames a column to answer)")

    def with_model(self, model: nn.Module, train: list[dict], evals: list[dict] | None, resuming: bool) -> None:
        if self.grpo.beta > 0 and not self.recipe.lora.enabled:
            # Under LoRA the reference is the base with the adapters off; a full-weight method
            # keeps the initial weights. A resume calls this before the checkpoint's weights are
            # read, with the model as loaded: the same initial weights.
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    def checkpoint_components(self, train: list[dict], evals: list[dict] | None) -> dict[str, Any]:
        return {"grpo_rollout": self._kept} if self._kept is not None else {}

    # -- the step -------------------------------------------------------------------------------

    def step_batches(self, model: nn.Module, step: int, examples: list[list[dict]]) -> StepBatches:
        # Every rank is handed the global micro-batches (sees_global_batch) and takes its share of
        # the prompts one process at the global batch would sample: ranks equal that process.
        accum, ranks = len(examples), dist.world_size()
        batch_size = len(examples[0]) // ranks
        self._step, self._step_began, self._sampling_s = step, time.perf_counter(), 0.0
        flat = [ex for micro in examples for ex in micro]
        prompts_per_generation = batch_size * self.spg // self.grpo.num_generations  # this rank's groups
        batches: list[dict] = []
        used: list[Rollout] = []
        for i in range(accum):
            m = step * accum + i
            if m % self.every == 0 or self.buffer.rollout is None:
                first = i * batch_size * ranks + dist.rank() * prompts_per_generation
                prompts = [flat[(first + j) % len(flat)] for j in range(prompts_per_generation)]
                self._sample(model, m // self.every, step, prompts, batch_size, dist.rank() * prompts_per_generation)
            rollout = self.buffer.rollout
            assert rollout is not None  # sampled just above when missing
            if not any(r is rollout for r in used):
                used.append(rollout)
            batches.append(rollout.batches[m % self.spg])
        # Every generation the step trains on counts in its figures (sums and counts: they add),
        # not only the first: a step of several generations logs all its completions.
        self._generation = {k: sum(r.sums[k] for r in used) for k in used[0].sums}
        self._generation["generation_s"] = self._sampling_s
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        return StepBatches(batches, torch.tensor(1.0 / ranks, dtype=torch.float64), real)

    def _sample(self, model: nn.Module, generation: int, step: int, prompts: list[dict], batch_size: int,
                first_group: int) -> None:
        seeds = [sampling_seed(self.recipe.training.seed, generation, first_group + k) for k in range(len(prompts))]
        keep = (self.outlives_step, self.grpo.beta > 0)
        rollout = generate(model, self.policy, prompts, batch_size, seeds, step, keep, self.strategy.sharded_forward,
                           self.reference)
        self.buffer.rollout = rollout
        self._sampling_s += rollout.sums["generation_s"]
        t = self.recipe.training
        if self.run_dir is not None and dist.is_main() and ((step + 1) % t.log_every == 0 or step + 1 == t.max_steps):
            folder = self.run_dir / "completions"
            folder.mkdir(exist_ok=True)
            with (folder / f"step-{step + 1:06d}.jsonl").open("w") as f:
                for row in rollout.samples:
                    f.write(json.dumps(row) + "\n")

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        g, t = self.grpo, self.recipe.training
        mask = batch["completion_mask"].float()
        logps = completion_logps(model, batch["input_ids"], batch["attention_mask"], mask.size(1), g.temperature,
                                 self.strategy.sharded_forward)
        losses = token_losses(logps, batch.get("old_logps"), batch["advantages"], Clip(g.epsilon, g.clip_high),
                              g.beta, batch.get("ref_logps"), g.use_bias_correction_kl)
        normaliser = Normaliser(g.loss_type, t.grad_accum_steps, dist.world_size(), self.spg,
                                g.max_completion_length, int(batch["generation_tokens"]))
        self._add("clipped_tokens", (losses.clipped * mask).sum())
        self._add("loss_tokens", mask.sum())
        if losses.kl is not None:
            self._add("kl_sum", (losses.kl.detach() * mask).sum())
        return normaliser.micro_batch_loss(losses.loss, mask)

    def _add(self, name: str, value: torch.Tensor) -> None:
        v = value.detach().double()
        self._sums[name] = self._sums[name] + v if name in self._sums else v

    def step_sums(self) -> dict[str, torch.Tensor]:
        sums = {k: torch.tensor(v, dtype=torch.float64, device=self.device) for k, v in self._generation.items()}
        sums.update(self._sums)
        sums.setdefault("kl_sum", torch.zeros((), dtype=torch.float64, device=self.device))
        self._sums = {}
        return sums

    def step_figures(self, read: dict[str, float]) -> dict[str, float]:
        out = figures(read, self.policy.rewards, self.grpo.beta)
        # Read after the step's global sums: every rank has finished its update.
        out["generation_share"] = out["generation_s"] / max(time.perf_counter() - self._step_began, 1e-9)
        if out["frac_reward_zero_std"] == 1.0 and not self._warned_flat and dist.is_main():
            self._warned_flat = True
            warn(f"grpo: at step {self._step + 1} every group's completions scored the same (frac_reward_zero_std "
                 "1), so the advantages are all 0 and the step taught nothing; if it lasts, the task is too hard "
                 "or too easy for the model as it is: raise grpo.num_generations or grpo.temperature, or start "
                 "from a short SFT (said once a run; docs/grpo.md)")
        return out

    # -- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[dict], batches: list[list[int]], counted: int) -> dict:
        """eval_reward and eval_reward_std: G completions of each eval prompt, sampled as in training
        from a seed of their own, scored by the same rewards."""
        totals = torch.zeros(3, dtype=torch.float64)
        for n, idx in enumerate(batches):
            prompts = [examples[i] for i in idx]
            seeds = [sampling_seed(self.recipe.training.seed, -1, i) for i in idx]  # whoever evaluates it
            rollout = generate(model, self.policy, prompts, len(prompts) * self.grpo.num_generations, seeds,
                               -1, (False, False), self.strategy.sharded_forward)
            if n < counted:
                s = rollout.sums
                totals += torch.tensor([s["reward_sum"], s["reward_sq"], s["reward_n"]], dtype=torch.float64)
        total, sq, count = dist.all_reduce_sum(totals.to(self.device)).cpu().tolist()
        n = max(count, 1.0)
        var = (sq - total ** 2 / n) / max(n - 1, 1.0)
        return {"eval_reward": total / n, "eval_reward_std": max(var, 0.0) ** 0.5}
