"""The recipe's `grpo` section (online RL on verifiable rewards, data.format prompts) and the
shape of a generation batch. Names and defaults are TRL 1.16's GRPOConfig's, which users know;
docs/grpo.md lists where lisaft differs (it keeps a subset: no vLLM, no tools, no loss types past
the four below). Kept beside the schema so schema.py stays one section per concern.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from lisaft.config.fields import Bool, Float, Int, Section
from lisaft.errors import LisaftError

GrpoLoss = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]


class GrpoSection(Section):
    reward_funcs: list[str] = Field(
        ..., min_length=1, description="The reward functions, summed with reward_weights: each `FILE.py:FUNCTION` "
        "(relative to the recipe's folder), `package.module:FUNCTION`, or one lisaft ships (exact_match: the "
        "completion against the row's `answer`; regex: grpo.regex found in the completion). Called as TRL calls "
        "them: f(prompts, completions, completion_ids, **columns) -> list[float | None]. docs/grpo.md")
    reward_weights: list[Float] | None = Field(
        None, description="One weight per reward function; null: 1.0 each (TRL's default).")
    regex: str | None = Field(
        None, description="The pattern the shipped `regex` reward looks for (Python re, searched anywhere in the "
        "completion): 1.0 where found, else 0.0.")
    num_generations: Int = Field(
        8, ge=2, description="G: completions sampled per prompt, one group; advantages compare a completion "
        "with its group (TRL's default 8; at least 2, else there is nothing to compare).")
    max_completion_length: Int = Field(
        512, ge=1, description="Tokens generated per completion at most; one cut there counts as truncated "
        "(TRL's default 512).")
    temperature: Float = Field(
        1.0, gt=0.0, description="Sampling temperature; the training log-probs divide the logits by it too, "
        "as TRL does, so the ratio compares like with like.")
    top_p: Float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set of tokens "
                         "whose probability reaches top_p (1.0: all).")
    top_k: Int = Field(0, ge=0, description="Keep the k most likely tokens when sampling (0: all).")
    beta: Float = Field(
        0.0, ge=0.0, description="β, the weight of the k3 KL estimate to the reference model; 0 (TRL's default): "
        "no reference is kept or computed.")
    use_bias_correction_kl: Bool = Field(
        True, description="With β > 0, multiply the KL term by the ratio, which makes its gradient the unbiased "
        "reverse-KL gradient (TRL 1.16's default, from the DeepSeek-V3.2 paper); it changes the gradient even at "
        "ratio 1.")
    epsilon: Float = Field(0.2, gt=0.0, description="ε_low: the ratio is clipped below at 1 − ε (TRL's 0.2).")
    epsilon_high: Float | None = Field(
        None, gt=0.0, description="ε_high: the ratio is clipped above at 1 + ε_high; null: epsilon (DAPO's "
        "paper recommends 0.28).")
    num_iterations: Int = Field(
        1, ge=1, description="μ: optimizer passes over each generation batch before the next is sampled; above 1 "
        "the generation-time log-probs are kept and the ratio moves away from 1.")
    steps_per_generation: Int | None = Field(
        None, ge=1, description="Micro-batches one generation batch feeds; null: training.grad_accum_steps "
        "(one generation per optimizer step). batch_size x ranks x steps_per_generation must be whole groups "
        "of num_generations.")
    loss_type: GrpoLoss = Field(
        "dapo", description="How the token losses are summed and divided: grpo: mean over each completion's "
        "tokens, then over completions; bnpo: over the micro-batch's active tokens; dr_grpo: by completions x "
        "max_completion_length; dapo (TRL's default): by the active tokens of the whole generation batch, "
        "across ranks.")
    scale_rewards: ScaleRewards = Field(
        "group", description="Advantage (r − group mean) divided by: group: the group's std + 1e-4; batch: the "
        "whole batch's std + 1e-4; none: nothing (the Dr. GRPO paper's choice).")
    mask_truncated_completions: Bool = Field(
        False, description="Completions cut at max_completion_length carry no loss (DAPO's advice); they are "
        "still scored and counted in their group.")

    @field_validator("regex")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        import re

        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _weights_and_pattern(self) -> GrpoSection:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} reward_funcs; give one per function, or null")
        if "regex" in self.reward_funcs and self.regex is None:
            raise ValueError("reward_funcs has regex: set grpo.regex to the pattern it looks for")
        return self

    @property
    def weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)

    @property
    def clip_high(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon


@dataclass(frozen=True)
class GenerationShape:
    """How many completions one generation samples on each rank and how it feeds the micro-batches."""

    batch_size: int            # completions per micro-batch, per rank (training.batch_size)
    steps_per_generation: int  # micro-batches each generation batch feeds
    num_generations: int       # G

    @property
    def completions(self) -> int:
        """Completions sampled at once on each rank."""
        return self.batch_size * self.steps_per_generation

    @property
    def prompts(self) -> int:
        return self.completions // self.num_generations


def generation_shape(grpo: GrpoSection, batch_size: int, grad_accum_steps: int) -> GenerationShape:
    """The generation batch of each rank, or one line that shows why it is not whole groups and the
    nearest training.batch_size values that are. Each rank samples whole groups, so no group waits
    on another rank (TRL counts the groups over every rank's batch together)."""
    spg = grpo.steps_per_generation or grad_accum_steps
    shape = GenerationShape(batch_size, spg, grpo.num_generations)
    g = grpo.num_generations
    if shape.completions % g == 0:
        return shape
    lower = next((b for b in range(batch_size - 1, 0, -1) if b * spg % g == 0), None)
    upper = next(b for b in range(batch_size + 1, batch_size + g + 1) if b * spg % g == 0)
    nearest = " or ".join(str(b) for b in (lower, upper) if b is not None)
    spg_source = "grpo.steps_per_generation" if grpo.steps_per_generation else \
        "steps_per_generation (= training.grad_accum_steps)"
    groups = [d for d in range(2, shape.completions + 1) if shape.completions % d == 0]
    other_g = f", or grpo.num_generations to {' or '.join(map(str, groups[:4]))}" if groups else ""
    raise LisaftError(
        f"grpo: each rank's generation batch must be whole groups of grpo.num_generations={g} completions, but "
        f"training.batch_size {batch_size} x {spg_source} {spg} = {shape.completions}, not a multiple of {g}; "
        f"set training.batch_size to {nearest}{other_g}")


def resolve_reward_paths(data: dict, base: Path) -> None:
    """grpo.reward_funcs' `FILE.py:FUNCTION` entries made absolute against `base` (the recipe's
    folder, or the current directory for --set), as the recipe's other paths are, so the run's
    own recipe.yaml still finds them on resume."""
    grpo = data.get("grpo")
    if not isinstance(grpo, dict) or not isinstance(grpo.get("reward_funcs"), list):
        return
    funcs = grpo["reward_funcs"]
    out = []
    for spec in funcs:
        file, sep, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
        if sep and file.endswith(".py") and not Path(file).expanduser().is_absolute():
            spec = f"{(base / Path(file).expanduser()).resolve()}:{name}"
        out.append(spec)
    grpo["reward_funcs"] = out
