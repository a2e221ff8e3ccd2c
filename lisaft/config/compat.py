"""Which features run together: one table of the recipe's impossible combinations, and one check
of the rules that depend on how many processes were launched.

The recipe's schema refuses a row of `EXCLUSIONS` when it validates (so `lisaft train` writes
nothing for it); `check_world` runs once at set-up, when the number of ranks and the training
device are known, before the model loads. Nothing else refuses a combination.
docs/distributed.md says why each FSDP row exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lisaft.config.optimizers import OptimizerKind, names_where, optimizer_kind
from lisaft.config.preference_losses import DATA, losses_where, preference_loss
from lisaft.errors import LisaftError

if TYPE_CHECKING:
    from lisaft.config.schema import Recipe


@dataclass(frozen=True)
class Exclusion:
    when: Callable[[Recipe], bool]
    message: Callable[[Recipe], str]


def _fixed(text: str) -> Callable[[Recipe], str]:
    return lambda r: text


def _kind(r: Recipe) -> OptimizerKind:
    return optimizer_kind(r.optimizer.name)


def _loss(r: Recipe) -> str | None:
    """preference.loss, or None for an SFT recipe."""
    return r.preference.loss if r.preference is not None else None


def _layer_major_blocker(r: Recipe) -> str | None:
    """What keeps optimizer.offload_accumulation from being device, and the way that applies."""
    if not r.optimizer.cpu_offload:
        return "it sums gradients for optimizer.cpu_offload; set cpu_offload true or offload_accumulation null"
    if r.lisa.enabled:
        return "the layer-major backward is full fine-tuning's; LISA trains γ layers: use host"
    if r.preference is not None:
        return "the layer-major backward runs the token loss; a preference loss runs its own forward: use host"
    if r.model.offload_activations:
        return ("the layer-major backward keeps each layer's input in host memory itself; set "
                "model.offload_activations false, or use host")
    return None


def offload_accumulation(r: Recipe) -> str | None:
    """optimizer.offload_accumulation resolved: device where the layer-major backward applies and
    more than one micro-batch makes a step (null's default), host elsewhere; None without cpu_offload."""
    if not r.optimizer.cpu_offload:
        return None
    if r.optimizer.offload_accumulation is not None:
        return r.optimizer.offload_accumulation
    return "device" if _layer_major_blocker(r) is None and r.training.grad_accum_steps > 1 else "host"


# The model's and the optimizer's own rules first, then LoRA's, then the rest: the first row hit
# is the message.
EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion(lambda r: r.model.offload_activations and not r.model.gradient_checkpointing, _fixed(
        "model.offload_activations offloads checkpointed layer inputs: set model.gradient_checkpointing: true "
        "as well")),
    Exclusion(lambda r: _kind(r).rank is not None and r.optimizer.rank not in (None, _kind(r).rank), lambda r: (
        f"optimizer.rank: {r.optimizer.name} is rank {_kind(r).rank} by definition; for another rank use "
        f"optimizer.name {names_where(lambda k: k.projected and k.rank is None)[0]}")),
    Exclusion(lambda r: _kind(r).scale_type is not None and r.optimizer.scale_type not in (None, _kind(r).scale_type),
              lambda r: (
        f"optimizer.scale_type: {r.optimizer.name} scales each matrix by one factor ({_kind(r).scale_type}); for "
        f"{r.optimizer.scale_type} scaling use optimizer.name "
        f"{names_where(lambda k: k.projected and k.scale_type is None)[0]}")),
    # LoRA's (config/lora.py): adapters train on a frozen base, which only they can train on in 4-bit.
    Exclusion(lambda r: r.model.quantize is not None and not r.lora.enabled, lambda r: (
        f"model.quantize: {r.model.quantize} freezes the base in 4-bit, which only adapters can train on; set "
        "lora.enabled: true (QLoRA) or model.quantize: null")),
    Exclusion(lambda r: r.lora.enabled and r.lora.export == "adapter" and r.lora.train_embeddings, _fixed(
        "lora.export: adapter holds the adapters only, not the embeddings and head that lora.train_embeddings "
        "trains; use lora.export: merged")),
    Exclusion(lambda r: r.lora.enabled and r.lisa.enabled, _fixed(
        "lora.enabled and lisa.enabled are two ways to choose what trains; enable one")),
    Exclusion(lambda r: r.lora.enabled and r.training.fsdp, _fixed(
        "lora.enabled with training.fsdp is not supported (the adapters of an 8B model fit one card; the frozen "
        "base could be sharded, lisaft does not); use data parallel (training.fsdp: false)")),
    Exclusion(lambda r: r.lora.enabled and r.optimizer.cpu_offload, _fixed(
        "lora.enabled with optimizer.cpu_offload: the adapters' moments are a few MiB, moving them to the CPU "
        "saves nothing; set optimizer.cpu_offload: false")),
    Exclusion(lambda r: r.lora.enabled and r.model.quantize is not None and r.model.config is not None, _fixed(
        "model.quantize needs pretrained weights (model.name_or_path) to quantize; a random init from "
        "model.config has nothing worth freezing in 4-bit")),
    Exclusion(lambda r: r.optimizer.cpu_offload and r.optimizer.in_backward, _fixed(
        "optimizer.cpu_offload cannot be combined with optimizer.in_backward: with the step on the CPU no "
        "gradient stays on the device anyway; set in_backward false")),
    Exclusion(lambda r: r.optimizer.offload_accumulation is not None and not r.optimizer.cpu_offload, lambda r: (
        f"optimizer.offload_accumulation: {r.optimizer.offload_accumulation}: {_layer_major_blocker(r)}")),
    Exclusion(lambda r: r.optimizer.offload_accumulation == "device" and _layer_major_blocker(r) is not None,
              lambda r: f"optimizer.offload_accumulation: device: {_layer_major_blocker(r)}"),
    Exclusion(lambda r: r.optimizer.offload_group_size is not None and offload_accumulation(r) != "device", _fixed(
        "optimizer.offload_group_size groups the micro-batches of the layer-major backward "
        "(optimizer.offload_accumulation: device, with cpu_offload); set it null")),
    Exclusion(lambda r: r.optimizer.moments_dtype == "bfloat16" and not _kind(r).own_adamw, lambda r: (
        f"optimizer.moments_dtype bfloat16 is for {', '.join(names_where(lambda k: k.own_adamw))}; "
        f"{r.optimizer.name} keeps its own moments (8-bit "
        "ones: adamw_8bit); set moments_dtype float32")),
    Exclusion(lambda r: _kind(r).projected and r.optimizer.cpu_offload, lambda r: (
        f"optimizer.name {r.optimizer.name} cannot be combined with optimizer.cpu_offload: its state is a few MiB "
        "and steps on the GPU; set cpu_offload false")),
    Exclusion(lambda r: _kind(r).projected and r.training.fsdp, lambda r: (
        f"optimizer.name {r.optimizer.name} cannot be combined with training.fsdp: the projection needs each "
        "matrix's whole gradient and a rank holds a slice; use data parallel")),
    Exclusion(lambda r: r.training.on_nonfinite == "skip" and r.optimizer.in_backward, _fixed(
        "training.on_nonfinite: skip cannot be combined with optimizer.in_backward: each update runs in "
        "backward, before the norm is known; use stop")),
    Exclusion(lambda r: r.optimizer.in_backward and r.training.grad_accum_steps > 1, _fixed(
        "optimizer.in_backward cannot be combined with training.grad_accum_steps > 1: the update runs before "
        "the next micro-batch could add its gradient")),
    Exclusion(lambda r: r.optimizer.in_backward and r.training.max_grad_norm is not None, _fixed(
        "optimizer.in_backward cannot be combined with training.max_grad_norm: the total norm is known only "
        "after every parameter was already updated; set training.max_grad_norm: null")),
    Exclusion(lambda r: r.training.fsdp and _kind(r).paged, lambda r: (
        f"optimizer.name {r.optimizer.name} is not supported with training.fsdp (paging of one rank's slices "
        f"is untested on CUDA); use {_kind(r).unpaged}")),
    Exclusion(lambda r: r.training.fsdp and r.optimizer.in_backward, _fixed(
        "optimizer.in_backward cannot run with training.fsdp: the update would run before the gradient "
        "reduce-scatter; set it false")),
    Exclusion(lambda r: r.training.fsdp and r.optimizer.cpu_offload, _fixed(
        "optimizer.cpu_offload runs on one device and cannot be combined with training.fsdp; set one of them "
        "false")),
    Exclusion(lambda r: r.training.fsdp and r.training.shard_optimizer_state, _fixed(
        "training.shard_optimizer_state is data parallel's sharding; training.fsdp already shards the "
        "optimizer state: set one of them false")),
    Exclusion(lambda r: r.training.fsdp and r.training.compile, _fixed(
        "training.compile is not supported with training.fsdp yet; set it false")),
    Exclusion(lambda r: r.grpo is not None and r.preference is not None, _fixed(
        "a recipe trains one stage: remove the preference section or the grpo section")),
    Exclusion(lambda r: r.preference is not None and r.data.format != preference_loss(r.preference.loss).data_format,
              lambda r: (
        f"preference.loss {_loss(r)} trains on {DATA[preference_loss(str(_loss(r))).data_format]}, "
        f"or remove the preference section for SFT on data.format {r.data.format}")),
    Exclusion(lambda r: r.preference is None and r.data.format in DATA, lambda r: (
        f"data.format {r.data.format} needs a preference section: preference.loss "
        + ", ".join(losses_where(lambda k: k.data_format == r.data.format)))),
    Exclusion(lambda r: r.preference is not None and r.preference.reference is not None
              and not preference_loss(r.preference.loss).reference, lambda r: (
        f"preference.reference is the reference model of {', '.join(losses_where(lambda k: k.reference))}; "
        f"{_loss(r)} uses none: set preference.reference: null")),
    # A pair's two sequences are scored against each other, so they stay two rows of one batch.
    Exclusion(lambda r: r.preference is not None and r.data.packing, _fixed(
        "data.packing cannot be combined with a preference section: each pair's chosen and rejected "
        "sequences (an answer and its KL sequence for kto) go through the forward as rows of one batch; set "
        "data.packing false")),
    # GRPO (config/grpo.py): prompts in, groups of sampled completions out.
    Exclusion(lambda r: r.grpo is not None and r.data.format != "prompts", lambda r: (
        f"a grpo section samples completions of prompts: set data.format: prompts (rows with a prompt), or "
        f"remove the grpo section to train on data.format {r.data.format}")),
    Exclusion(lambda r: r.grpo is None and r.data.format == "prompts", _fixed(
        "data.format prompts needs a grpo section naming its reward functions (grpo.reward_funcs)")),
    Exclusion(lambda r: r.grpo is not None and r.data.packing, _fixed(
        "data.packing cannot be combined with a grpo section: each completion is one row scored against its "
        "group; set data.packing false")),
    Exclusion(lambda r: r.grpo is not None and _generation_refusal(r) is not None,
              lambda r: _generation_refusal(r) or ""),
)


def _generation_refusal(recipe: Recipe) -> str | None:
    """Why a GRPO recipe's generation batch is not whole groups, or None (config/grpo.py)."""
    from lisaft.config.grpo import generation_shape

    assert recipe.grpo is not None, "asked of GRPO recipes only"
    try:
        generation_shape(recipe.grpo, recipe.training.batch_size, recipe.training.grad_accum_steps)
    except LisaftError as e:
        return str(e)
    return None


def first_exclusion(recipe: Recipe) -> str | None:
    """The message of the first row of `EXCLUSIONS` that `recipe` hits, or None."""
    return next((x.message(recipe) for x in EXCLUSIONS if x.when(recipe)), None)


def check_world(recipe: Recipe, world_size: int, launched: bool, device: str) -> None:
    """The rules that depend on the launch: `world_size` ranks, `launched` under torchrun, on the
    training `device` (its type: cpu, cuda) that training.device resolved to."""
    # One rank under torchrun is allowed (a resume of a sharded run, or a check on one GPU). A
    # resume cannot change either key, so the way out named first is the launch.
    for key, on in (("training.fsdp", recipe.training.fsdp),
                    ("training.shard_optimizer_state", recipe.training.shard_optimizer_state)):
        if on and not launched:
            raise LisaftError(f"{key} shards over torchrun's ranks: launch with torchrun --nproc-per-node N "
                              "(a resume too: `torchrun --nproc-per-node N -m lisaft resume RUN`), or, for a new "
                              f"run, set {key} false")
    if recipe.optimizer.moments_dtype == "bfloat16" and not recipe.optimizer.cpu_offload and device != "cpu":
        # The bfloat16 moments' update is the host step's (optim/host_step.py).
        raise LisaftError("optimizer.moments_dtype bfloat16 needs the step on the CPU: set optimizer.cpu_offload "
                          "true or training.device cpu")
    if recipe.training.fsdp or world_size == 1:
        return
    if recipe.optimizer.in_backward:
        raise LisaftError("optimizer.in_backward cannot run data parallel: each update would run "
                          "before the gradient all-reduce; set it false")
    if recipe.optimizer.cpu_offload:
        raise LisaftError("optimizer.cpu_offload runs on one device; for data parallel set it false "
                          "(training.shard_optimizer_state divides the moments between ranks)")
