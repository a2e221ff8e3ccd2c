"""What to change when an estimate does not fit, and the largest shapes that do.

Each change lisaft can make is an option in a group (at most one option per group: the
optimizer is 8-bit or not, LISA trains γ=2 or γ=1 layers). Every combination is estimated (a few
hundred at most, under a millisecond each), so the advice is exact rather than greedy: the
smallest combination that fits, and when none does, the least memory any combination reaches.
"Smallest" weighs what a change costs the run: nothing (attention kernel), time (checkpointing,
8-bit moments, offloading, smaller micro-batches), or what the run learns (LISA, fewer layers,
no gradient clipping), in that order.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from lisaft.config.compat import first_exclusion
from lisaft.config.optimizers import OPTIMIZERS, optimizer_kind
from lisaft.memory.apollo_state import is_apollo
from lisaft.memory.estimate import Estimate, compute
from lisaft.memory.settings import Settings

# The shipped recipe that trains every layer with the optimizer on the CPU.
OFFLOAD_RECIPE = "recipes/llama3.1-8b-full-24gb.yaml"
# Positions per MLP chunk offered for long context: the shipped 16k recipe's choice.
MLP_CHUNK_TOKENS = 2048
# What a change costs the run, in the order a person would give things up.
FREE, SLOWER, SLOWER_AND_HOST_MEMORY, LEARNS_LESS, CHANGES_TRAINING, LEARNS_MUCH_LESS = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True)
class Option:
    overrides: dict  # recipe keys and values, as `--set key=value` takes them
    why: str
    cost: int


@dataclass(frozen=True)
class Change:
    overrides: dict  # recipe keys and values, as `--set key=value` takes them
    why: str
    estimate: Estimate
    cost: int = 0
    options: int = 1  # how many of the options it combines
    ranks: int | None = None  # training.fsdp over this many processes (torchrun --nproc-per-node)

    @property
    def what(self) -> str:
        keys = ", ".join(f"{k}: {json.dumps(v)}" for k, v in self.overrides.items())
        return keys + (f"; torchrun --nproc-per-node {self.ranks}" if self.ranks else "")


def _lisa_options(s: Settings, layer_count: int) -> list[Option]:
    lisa = s.recipe.lisa.enabled

    def gamma(g: int, why: str, cost: int) -> Option:
        keys = {"lisa.active_layers": g} if lisa else {"lisa.enabled": True, "lisa.active_layers": g}
        return Option(keys, why, cost)

    if not lisa:
        first = min(2, layer_count)
        out = [gamma(first, f"train {first} layers at a time", LEARNS_LESS)]
    elif s.active_layers > 1:
        first = max(1, s.active_layers // 2)
        out = [gamma(first, "fewer layers' gradients and moments", LEARNS_LESS)]
    else:
        return []
    if first > 1:
        out.append(gamma(1, "train 1 layer at a time", LEARNS_MUCH_LESS))
    return out


def _step_options(s: Settings) -> list[Option]:
    """Where the optimizer step runs instead: inside backward, or on the CPU (one or the other:
    the step on the CPU replaces the step in backward). Neither runs under training.fsdp."""
    out: list[Option] = []
    opt = s.recipe.optimizer
    if s.fsdp:
        return out
    if not opt.in_backward and not opt.cpu_offload and s.recipe.training.grad_accum_steps == 1:
        out.append(Option({"optimizer.in_backward": True, "training.max_grad_norm": None},
                          "no full gradient set resident (and no clipping)", CHANGES_TRAINING))
    if not opt.cpu_offload and s.device == "cuda" and not is_apollo(opt.name):
        keys: dict[str, object] = {"optimizer.cpu_offload": True}
        if opt.in_backward:
            keys.update({"optimizer.in_backward": False, "training.max_grad_norm": 1.0})
        # {host} is the RAM of the combination this option ends up in (_combine).
        out.append(Option(keys, "moments, gradients and the step on the CPU (needs {host} of RAM; "
                          f"{OFFLOAD_RECIPE} does this)", SLOWER_AND_HOST_MEMORY))
    if opt.cpu_offload:
        out.append(Option({"optimizer.cpu_offload": False}, "moments and the step back on the GPU, no host copies",
                          FREE))
    return out


def _groups(s: Settings, layer_count: int) -> list[list[Option]]:
    r = s.recipe
    groups = []
    if not r.model.gradient_checkpointing:
        groups.append([Option({"model.gradient_checkpointing": True}, "keep one hidden state per layer", SLOWER)])
    if s.attention == "eager":
        attention = "flash_attention_2" if s.device == "cuda" else "sdpa"
        groups.append([Option({"model.attention": attention}, "no s x s score matrix", FREE)])
    kind = optimizer_kind(r.optimizer.name)
    if not (kind.paged and kind.eight_bit) and s.device == "cuda" and not s.fsdp:
        groups.append([Option(_eight_bit("paged_adamw_8bit", s), "2 B/param of moments, paged on pressure", SLOWER)])
    elif not kind.eight_bit:
        groups.append([Option(_eight_bit("adamw_8bit", s), "2 B/param of moments", SLOWER)])
    if not s.lora:  # a LoRA run's ways to train less are in the methods table (memory/methods.py)
        groups.append(_lisa_options(s, layer_count))
        groups.append(_step_options(s))
    batch = r.training.batch_size
    if batch > 1:
        accum = r.training.grad_accum_steps * batch
        keys: dict[str, object] = {"training.batch_size": 1, "training.grad_accum_steps": accum}
        if r.grpo is not None and r.grpo.steps_per_generation:  # the same sequences a generation
            keys["grpo.steps_per_generation"] = r.grpo.steps_per_generation * batch
        groups.append([Option(keys, "fewer tokens in flight, same batch", SLOWER)])
    groups.append(_generation_options(s))
    # lisaft's long-context settings (docs/memory.md): layer inputs off the GPU, MLPs in chunks.
    if s.device == "cuda" and not r.model.offload_activations:
        groups.append([Option({"model.gradient_checkpointing": True, "model.offload_activations": True},
                              "layer inputs in pinned host memory", SLOWER_AND_HOST_MEMORY)])
    if r.model.mlp_chunk_tokens is None and r.data.max_seq_len > MLP_CHUNK_TOKENS:
        groups.append([Option({"model.mlp_chunk_tokens": MLP_CHUNK_TOKENS},
                              f"MLP intermediates for {MLP_CHUNK_TOKENS} positions at a time", SLOWER)])
    return [g for g in groups if g]


def _generation_options(s: Settings) -> list[Option]:
    """GRPO: one group sampled at a time, a smaller KV cache (memory/generation.py), where the
    generation batch holds more and a group is whole micro-batches."""
    g, t = s.recipe.grpo, s.recipe.training
    if g is None or g.num_generations % t.batch_size:
        return []
    if t.batch_size * (g.steps_per_generation or t.grad_accum_steps) <= g.num_generations:
        return []
    return [Option({"grpo.steps_per_generation": g.num_generations // t.batch_size},
                   f"one group of {g.num_generations} sampled at a time: a smaller KV cache", SLOWER)]


def _eight_bit(name: str, s: Settings) -> dict:
    """optimizer.name `name`, and float32 moments where the recipe had bfloat16 ones (adamw_32bit's
    own setting, which the 8-bit optimizers refuse)."""
    keys: dict[str, object] = {"optimizer.name": name}
    if s.recipe.optimizer.moments_dtype != "float32":
        keys["optimizer.moments_dtype"] = "float32"
    return keys


def _combine(s: Settings, options: tuple[Option, ...]) -> Change:
    overrides: dict = {}
    for o in options:
        overrides.update(o.overrides)
    whys = [o.why for o in options]
    name = overrides.get("optimizer.name")
    if overrides.get("optimizer.cpu_offload", s.recipe.optimizer.cpu_offload) and name is not None \
            and optimizer_kind(name).paged:
        # Paging is CUDA unified memory; with the step on the CPU the 8-bit moments live in host RAM.
        overrides["optimizer.name"] = optimizer_kind(name).unpaged
        whys = [w.replace("paged on pressure", "in host memory") for w in whys]
    est = compute(s.with_keys(overrides))
    whys = [w.replace("{host}", f"{est.host_bytes / 1024**3:.1f} GiB") for w in whys]
    why = "together: " + "; ".join(whys) if len(options) > 1 else whys[0]
    return Change(overrides, why, est, sum(o.cost for o in options), len(options))


def allowed(s: Settings, overrides: dict) -> bool:
    """Whether the recipe with `overrides` is one config/compat.py accepts: advice never offers a
    combination `lisaft train` would refuse (the options are estimated without validation)."""
    return first_exclusion(s.with_keys(overrides).recipe) is None


def combinations(s: Settings, layer_count: int) -> list[Change]:
    """Every non-empty combination of the options, one per group at most, that compat accepts, estimated."""
    groups = [[None, *g] for g in _groups(s, layer_count)]
    made = (_combine(s, tuple(o for o in pick if o is not None)) for pick in itertools.product(*groups) if any(pick))
    return [c for c in made if allowed(s, c.overrides)]


def _smallest(changes: list[Change]) -> Change:
    return min(changes, key=lambda c: (c.cost, c.options, c.estimate.total_bytes))


def leanest(s: Settings, layer_count: int) -> Change:
    """The least memory any combination reaches: what this model needs at the very least."""
    every = combinations(s, layer_count)
    if not every:  # every change lisaft has is made already
        return Change({}, "the settings as given", compute(s))
    lean = min(every, key=lambda c: (c.estimate.total_bytes, c.cost))
    return Change(lean.overrides, "the least memory lisaft can train this model in", lean.estimate, lean.cost,
                  lean.options)


def host_is_the_limit(est: Estimate) -> bool:
    """The GPU holds the run, but optimizer.cpu_offload's host memory exceeds the RAM."""
    return est.total_bytes <= est.budget_bytes and not est.fits_host and bool(est.host_components)


def advice(est: Estimate, layer_count: int) -> list[Change]:
    """Single changes that each lower the total, smallest total first; when none fits alone,
    the smallest combination that fits (by what it costs the run); then, if the sequence is what
    does not fit, the longest that does."""
    s = est.settings
    every = combinations(s, layer_count)
    if host_is_the_limit(est):
        # The GPU holds it: only what lowers the host memory helps, fitting ones first.
        changes = sorted((c for c in every if c.options == 1 and c.estimate.host_bytes < est.host_bytes),
                         key=lambda c: (not c.estimate.fits, c.cost, c.estimate.host_bytes))
    else:
        changes = sorted((c for c in every if c.options == 1 and c.estimate.total_bytes < est.total_bytes),
                         key=lambda c: c.estimate.total_bytes)
    if not any(c.estimate.fits for c in changes):
        fitting = [c for c in every if c.estimate.fits]
        if fitting:
            changes.append(_smallest(fitting))
    every_weight = _every_weight(s)
    if not est.fits and every_weight is not None and every_weight.estimate.fits:
        changes.append(every_weight)
    seq = largest_fitting(s, "data.max_seq_len")
    if not est.fits and seq and seq < s.recipe.data.max_seq_len and not host_is_the_limit(est):
        changes.append(Change({"data.max_seq_len": seq}, "largest sequence length that fits",
                              compute(s.with_keys({"data.max_seq_len": seq}))))
    return [c for c in changes if allowed(s, c.overrides)]


def _every_weight(s: Settings) -> Change | None:
    """Full fine-tuning that does not fit as asked: every weight still trains, on the device, with
    APOLLO-Mini's rank-1 moments and the step in backward (recipes/llama3.1-8b-apollo-24gb.yaml's
    way). Not under LISA (the user chose to train some layers), nor under training.fsdp."""
    r = s.recipe
    if r.lisa.enabled or s.fsdp or is_apollo(r.optimizer.name):
        return None
    keys = {"optimizer.name": "apollo_mini", "optimizer.in_backward": True, "training.max_grad_norm": None}
    if r.optimizer.cpu_offload:
        keys["optimizer.cpu_offload"] = False
    if r.optimizer.moments_dtype != "float32":
        keys["optimizer.moments_dtype"] = "float32"
    if r.training.grad_accum_steps > 1:  # in backward, each micro-batch is a step
        keys["training.grad_accum_steps"] = 1
    if not r.model.gradient_checkpointing:
        keys["model.gradient_checkpointing"] = True
    why = ("every weight trains, on the GPU: APOLLO-Mini's rank-1 moments, the step in backward "
           "(recipes/llama3.1-8b-apollo-24gb.yaml; docs/optimizers.md)")
    return Change(keys, why, compute(s.with_keys(keys)), CHANGES_TRAINING)


# Process counts offered for training.fsdp, fewest first.
RANKS = (2, 4, 8, 16, 32, 64)


def fsdp_ready(s: Settings) -> tuple[Settings, dict]:
    """`s` as training.fsdp runs it, and the recipe keys that says: paged optimizers become their
    unpaged kind, the step in backward or on the CPU goes back to the optimizer step (each refused
    under FSDP, lisaft/config/compat.py)."""
    opt = s.recipe.optimizer
    keys: dict[str, object] = {"training.fsdp": True}
    if optimizer_kind(opt.name).paged:
        keys["optimizer.name"] = optimizer_kind(opt.name).unpaged
    if opt.in_backward:
        keys.update({"optimizer.in_backward": False, "training.max_grad_norm": 1.0})
    if opt.cpu_offload:
        keys["optimizer.cpu_offload"] = False
    return s.with_keys(keys), keys


def fewest_ranks(s: Settings, layer_count: int) -> Change | None:
    """The fewest ranks (of RANKS, more than `s` runs on) over which training.fsdp fits the run
    as given; failing that at every count, the fewest with the cheapest change that fits there.
    None when not even 64 do, or when the optimizer projects its gradients (a rank holds a slice of
    each matrix, and the projection needs the whole: config/compat.py refuses it)."""
    if optimizer_kind(s.recipe.optimizer.name).projected:
        return None
    base, keys = fsdp_ready(s)
    counts = [n for n in RANKS if n > s.ranks]
    for n in counts:
        est = compute(base.with_(ranks=n))
        if est.fits:
            return Change(keys, f"each of {n} GPUs holds 1/{n} of the weights, gradients and moments "
                          "(training.fsdp)", est, ranks=n)
    for n in counts:
        fitting = [c for c in combinations(base.with_(ranks=n), layer_count) if c.estimate.fits]
        if fitting:
            best = _smallest(fitting)
            return Change({**keys, **best.overrides}, f"training.fsdp over {n} GPUs, with: {best.why}",
                          best.estimate, best.cost, best.options + 1, ranks=n)
    return None


def largest_fitting(s: Settings, key: str, limit: int | None = None) -> int | None:
    """Largest value of recipe `key` (data.max_seq_len or training.batch_size) whose estimate fits
    with nothing paged; None if even 1 does not. Memory grows with both, so a binary search is
    exact. Sequences stop at the model's context length; a GRPO batch is one whose generations
    are whole groups (config/compat.py refuses the others)."""
    largest = _largest(s, key, limit)
    if largest is None or key != "training.batch_size" or s.recipe.grpo is None:
        return largest
    return next((v for v in range(largest, 0, -1) if allowed(s, {key: v})), None)


def _largest(s: Settings, key: str, limit: int | None) -> int | None:
    from lisaft.model.load import context_length

    if limit is None:
        limit = (context_length(s.config) if key == "data.max_seq_len" else None) or 1 << 20

    def fits(v: int) -> bool:
        return compute(s.with_keys({key: v})).fits

    if not fits(1):
        return None
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= limit:
        if fits(limit):
            return limit
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def optimizer_grid(s: Settings, gamma: int) -> dict[tuple[str, str], Estimate]:
    """The four optimizers x (full fine-tuning, LISA γ), everything else as in `s`. Columns are
    keyed "full" and "lisa_<γ>". Under training.fsdp the paged ones, which it refuses, are left out."""
    grid: dict[tuple[str, str], Estimate] = {}
    no_lora = {"lora.enabled": False, "model.quantize": None}
    for opt in OPTIMIZERS:
        if optimizer_kind(opt).projected or (s.fsdp and optimizer_kind(opt).paged):
            continue  # APOLLO's estimate is its own advice row (_apollo_option)
        name = {"optimizer.name": opt}
        grid[(opt, "full")] = compute(s.with_keys({**name, **no_lora, "lisa.enabled": False}))
        grid[(opt, f"lisa_{gamma}")] = compute(s.with_keys({**name, **no_lora, "lisa.enabled": True,
                                                            "lisa.active_layers": gamma}))
        if s.lora:  # the run's own adapters beside the other two
            grid[(opt, "lora")] = compute(s.with_keys(name))
    return grid


# lisa.active_layers: auto keeps this share of the budget free: the estimate was within 3% of
# three NVML measurements (docs/memory.md), and a desktop's other processes may grow after start.
AUTO_MARGIN = 0.05


def largest_fitting_layers(s: Settings, layer_count: int, margin: float = 0.0) -> Estimate | None:
    """The LISA estimate at the largest γ (1..layer_count) that fits with nothing paged, within
    (1 - margin) of the budget; None if even γ=1 does not. Memory grows with γ, so a binary
    search is exact. The estimate returned is judged against the whole budget."""
    limit = s.with_(budget_bytes=int(s.budget_bytes * (1 - margin)))

    def estimate(gamma: int) -> Estimate:
        return compute(limit.with_keys({"lisa.enabled": True, "lisa.active_layers": gamma}))

    lo, hi = 0, layer_count + 1  # estimate(lo) fits (or lo is 0), estimate(hi) does not (or hi is past the top)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if estimate(mid).fits else (lo, mid)
    return compute(s.with_keys({"lisa.enabled": True, "lisa.active_layers": lo})) if lo else None
