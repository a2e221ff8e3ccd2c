"""`lisaft estimate-memory`: parse the recipe and flags into Settings, compute, render."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lisaft.config.optimizers import OPTIMIZERS, optimizer_kind
from lisaft.config.schema import Recipe, load_recipe
from lisaft.env.allocator import expandable_segments
from lisaft.errors import LisaftError
from lisaft.memory.advice import (
    AUTO_MARGIN,
    Change,
    advice,
    fewest_ranks,
    largest_fitting,
    largest_fitting_layers,
    leanest,
    optimizer_grid,
)
from lisaft.memory.apollo_state import is_apollo
from lisaft.memory.catalogue import catalogue_names, resolve_model
from lisaft.memory.counts import param_counts
from lisaft.memory.estimate import DTYPE_BYTES, Estimate, GiB, Settings, compute
from lisaft.memory.gpus import explain_budget, gpu, parse_bytes, smallest_gpu
from lisaft.memory.lora import lora_settings
from lisaft.memory.methods import methods
from lisaft.optim.apollo import ApolloSettings

_ATTENTION = ("auto", "flash_attention_2", "sdpa", "eager")
DEFAULT_BUDGET = "24GiB"


@dataclass(frozen=True)
class Budget:
    bytes: int
    given: str  # "24GB", "24GiB", or "--gpu rtx-4090"
    source: str | None = None  # where a GPU's figure comes from

    def explained(self) -> str:
        line = explain_budget(self.bytes, self.given)
        return line + (f"; {self.source}" if self.source else "")


def parse_budget(budget: str | None, gpu_name: str | None) -> Budget:
    if budget is not None and gpu_name is not None:
        raise LisaftError("--budget and --gpu both set the memory budget; give one")
    if gpu_name is not None:
        card = gpu(gpu_name)
        return Budget(card.usable_bytes, f"--gpu {card.name}", card.source)
    text = budget if budget is not None else DEFAULT_BUDGET
    return Budget(parse_bytes(text), text.strip())


def _recipe_device(recipe: Recipe, device: str | None) -> str:
    """--device, else the recipe's training.device; `auto` estimates for CUDA, the device the
    estimate exists for."""
    if device is not None:
        return device
    return "cpu" if recipe.training.device == "cpu" else "cuda"


def _attention_for(choice: str, device: str, dtype: str) -> str:
    # FlashAttention and SDPA keep the same tensors (q, k, v, output, log-sum-exp), so "auto"
    # needs no knowledge of whether flash-attn is installed to be estimated right.
    if choice == "auto":
        return "flash_attention_2" if device == "cuda" and dtype != "float32" else "sdpa"
    return choice


def _model_ref(recipe: Recipe) -> tuple[str, str]:
    if recipe.model.config is not None:
        return recipe.model.config, "model.config"
    assert recipe.model.name_or_path is not None  # the schema asks for exactly one of the two
    return recipe.model.name_or_path, "model.name_or_path"


def _ranks(recipe: Recipe, ranks: int | None) -> int:
    """Per-rank figures under training.fsdp: for `ranks`, else this process group's size."""
    if ranks is not None or not recipe.training.fsdp:
        return ranks or 1
    from lisaft.distributed import dist

    return dist.world_size()


def settings_from_recipe(recipe: Recipe, device: str = "cuda", budget_bytes: int = 24 * GiB,
                         model: str | None = None, ranks: int | None = None) -> Settings:
    ref, key = (model, "--model") if model else _model_ref(recipe)
    config, label = resolve_model(ref, key)
    return Settings(
        model_label=label, config=config, layers_path=recipe.model.layers_path, dtype=recipe.model.dtype,
        attention=_attention_for(recipe.model.attention, device, recipe.model.dtype),
        gradient_checkpointing=recipe.model.gradient_checkpointing,
        offload_activations=recipe.model.offload_activations,
        mlp_chunk_tokens=recipe.model.mlp_chunk_tokens,
        optimizer=recipe.optimizer.name, apollo_rank=ApolloSettings.of(recipe.optimizer).rank,
        in_backward=recipe.optimizer.in_backward,
        cpu_offload=recipe.optimizer.cpu_offload, host_budget_bytes=host_ram_bytes(),
        bf16_update=recipe.optimizer.bf16_update, moments_dtype=recipe.optimizer.moments_dtype,
        sparse_embedding_grad=recipe.model.sparse_embedding_grad,
        expandable_segments=expandable_segments(),
        lisa=recipe.lisa.enabled, active_layers_auto=recipe.lisa.active_layers == "auto",
        # auto's placeholder; the choice needs the rest of the settings (choose_active_layers).
        active_layers=1 if recipe.lisa.active_layers == "auto" else recipe.lisa.active_layers,
        train_embeddings=recipe.lisa.train_embeddings, train_head=recipe.lisa.train_head,
        state_policy=recipe.lisa.state_policy, batch_size=recipe.training.batch_size,
        seq_len=recipe.data.max_seq_len, packing=recipe.data.packing, padded_rows=not recipe.data.packing,
        grad_accum_steps=recipe.training.grad_accum_steps,
        clipping=recipe.training.max_grad_norm is not None, device=device,
        budget_bytes=budget_bytes, fsdp=recipe.training.fsdp, ranks=_ranks(recipe, ranks),
        model_from_config=recipe.model.config is not None, lora=lora_settings(recipe),
    )


def host_ram_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _device_budget(device: str) -> int:
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        return 24 * GiB
    return host_ram_bytes() or 16 * GiB


def estimate_for_recipe(recipe: Recipe, device: str = "cuda", budget_bytes: int | None = None) -> Estimate:
    """The estimate for a run of `recipe` on `device` ("cuda", "cpu", or a torch.device); the
    budget defaults to the device's memory (GPU total memory, or physical RAM). Under
    training.fsdp it is one rank's, for this process group's number of ranks."""
    device = getattr(device, "type", device)
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise LisaftError(f"memory estimate: unsupported device {device!r} (cuda or cpu)")
    budget = budget_bytes if budget_bytes is not None else _device_budget(device)
    s = settings_from_recipe(recipe, device=device, budget_bytes=budget)
    return compute(s.with_(datasets_imported="datasets" in sys.modules))


def _check_choice(key: str, value: str | None, allowed) -> None:
    if value is not None and value not in allowed:
        raise LisaftError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class EstimateFlags:
    """What `lisaft estimate-memory` was given: the recipe, --set, and each flag (None: not given,
    so the recipe's value or the default holds)."""

    recipe: Path | None = None
    model: str | None = None
    optimizer: str | None = None
    lisa_layers: int | None = None
    no_lisa: bool = False
    batch_size: int | None = None
    seq_len: int | None = None
    gradient_checkpointing: bool | None = None
    attention: str | None = None
    dtype: str | None = None
    in_backward: bool | None = None
    cpu_offload: bool | None = None
    host_ram: str | None = None
    budget: str | None = None
    gpu: str | None = None
    device: str | None = None
    fsdp: bool | None = None
    ranks: int | None = None
    overrides: tuple[str, ...] = ()
    json_out: bool = False
    explain: bool = False


def build_settings(f: EstimateFlags, budget_bytes: int) -> Settings:
    """Recipe values (after --set) first, each flag given on the command line overriding its key."""
    _check_flags(f)
    s = _base_settings(f, budget_bytes)
    s = s.with_(**_flag_changes(f, s))
    check_ranks(s, f.ranks)
    _check_step_place(s, f.cpu_offload, f.in_backward)
    layers = param_counts(s.config, s.layers_path).layer_count
    if s.lisa and s.active_layers_auto:
        chosen = largest_fitting_layers(s, layers, AUTO_MARGIN)
        s = s.with_(active_layers=chosen.settings.active_layers if chosen else 1)
    if s.lisa and s.active_layers > layers:
        key = "--lisa-layers" if f.lisa_layers is not None else "lisa.active_layers"
        raise LisaftError(f"{key}: {s.active_layers} is more than the model's {layers} layers")
    return s


def _check_flags(f: EstimateFlags) -> None:
    _check_choice("--device", f.device, ("cuda", "cpu"))
    _check_choice("--optimizer", f.optimizer, OPTIMIZERS)
    _check_choice("--attention", f.attention, _ATTENTION)
    _check_choice("--dtype", f.dtype, tuple(DTYPE_BYTES))
    if f.lisa_layers is not None and f.no_lisa:
        raise LisaftError("--lisa-layers and --no-lisa contradict each other; give one")
    for key, v in (("--lisa-layers", f.lisa_layers), ("--batch-size", f.batch_size), ("--seq-len", f.seq_len),
                   ("--ranks", f.ranks)):
        if v is not None and v < 1:
            raise LisaftError(f"{key}: must be at least 1, got {v}")
    if f.overrides and f.recipe is None:
        raise LisaftError("--set changes a recipe's keys: give a RECIPE, or use the flags with --model")


def _base_settings(f: EstimateFlags, budget_bytes: int) -> Settings:
    """The recipe's settings (after --set), or the defaults for --model alone."""
    if f.recipe is not None:
        r = load_recipe(f.recipe, list(f.overrides))
        return settings_from_recipe(r, _recipe_device(r, f.device), budget_bytes, f.model)
    if f.model is None:
        raise LisaftError("give a RECIPE or --model NAME (catalogue: " + ", ".join(catalogue_names()) + ")")
    device = f.device or "cuda"
    config, label = resolve_model(f.model)
    return Settings(model_label=label, config=config, device=device, budget_bytes=budget_bytes,
                    host_budget_bytes=host_ram_bytes(), expandable_segments=expandable_segments(),
                    attention=_attention_for("auto", device, f.dtype or "bfloat16"))


def _flag_changes(f: EstimateFlags, s: Settings) -> dict:
    """The fields the flags given on the command line change."""
    plain = {"optimizer": f.optimizer, "batch_size": f.batch_size, "seq_len": f.seq_len, "dtype": f.dtype,
             "gradient_checkpointing": f.gradient_checkpointing, "in_backward": f.in_backward,
             "cpu_offload": f.cpu_offload, "fsdp": f.fsdp}
    changes: dict = {k: v for k, v in plain.items() if v is not None}
    if f.no_lisa:
        changes["lisa"] = False
    if f.lisa_layers is not None:
        changes.update(lisa=True, active_layers=f.lisa_layers, active_layers_auto=False)
    if f.attention is not None:
        changes["attention"] = _attention_for(f.attention, s.device, f.dtype or s.dtype)
    if f.in_backward:
        changes["clipping"] = False  # in-backward steps cannot clip by the total norm
    if f.host_ram is not None:
        changes["host_budget_bytes"] = parse_bytes(f.host_ram, "--host-ram")
    changes["ranks"] = f.ranks or 1
    return changes


def _check_step_place(s: Settings, cpu_offload: bool | None, in_backward: bool | None) -> None:
    """Where the step runs, each refusal naming what the user typed: a flag, or the recipe's key."""
    if s.cpu_offload and s.in_backward:
        why = "with the step on the CPU no gradient stays on the device anyway"
        if in_backward and cpu_offload:
            raise LisaftError(f"--in-backward cannot be combined with --cpu-offload: {why}; give one")
        if in_backward:
            raise LisaftError(f"--in-backward cannot be combined with the recipe's optimizer.cpu_offload: {why}; "
                              "add --no-cpu-offload, or drop --in-backward")
        raise LisaftError(f"--cpu-offload cannot be combined with the recipe's optimizer.in_backward: {why}; "
                          "add --no-in-backward")
    if s.in_backward and s.grad_accum_steps > 1:
        inb = "--in-backward" if in_backward else "optimizer.in_backward"
        raise LisaftError(f"{inb} cannot be combined with training.grad_accum_steps > 1")
    if s.cpu_offload and is_apollo(s.optimizer):
        raise LisaftError(f"--cpu-offload cannot be combined with optimizer.name {s.optimizer}: its state is a few "
                          "MiB and steps on the GPU")


def check_ranks(s: Settings, ranks: int | None) -> None:
    """--ranks and training.fsdp as `lisaft train` under torchrun would take them (the recipe
    refuses the same combinations, lisaft/config/compat.py), each refusal one line."""
    if not s.fsdp:
        if s.ranks > 1:
            raise LisaftError(f"--ranks {s.ranks}: without training.fsdp every rank holds the whole model (data "
                              "parallel), so each rank's figure is the estimate without --ranks; add --fsdp (or "
                              "--set training.fsdp=true) for sharded per-rank figures")
        return
    if ranks is None:
        raise LisaftError("training.fsdp: give --ranks N, the number of processes (torchrun --nproc-per-node N): "
                          "the estimate is one rank's")
    if is_apollo(s.optimizer):
        raise LisaftError(f"optimizer.name {s.optimizer} cannot be combined with training.fsdp: the projection "
                          "needs each matrix's whole gradient and a rank holds a slice")
    if optimizer_kind(s.optimizer).paged:
        raise LisaftError(f"optimizer.name {s.optimizer} is not supported with training.fsdp; use "
                          f"--optimizer {optimizer_kind(s.optimizer).unpaged} (or adamw_32bit)")
    for on, key in ((s.in_backward, "optimizer.in_backward"), (s.cpu_offload, "optimizer.cpu_offload")):
        if on:
            raise LisaftError(f"{key} cannot be combined with training.fsdp (docs/distributed.md); set it false")


@dataclass
class Report:
    """Everything estimate-memory says, for the text and the JSON renderings alike."""

    estimate: Estimate
    budget: Budget
    changes: list[Change]
    grid: dict
    largest_seq_len: int | None
    largest_batch_size: int | None
    context_length: int | None
    weights_fit: bool
    leanest: Change | None  # when nothing offered fits: the least this model trains in
    smallest_gpu: str | None  # the smallest catalogue card for the leanest setup
    smallest_gpu_as_is: str | None  # the smallest catalogue card for the settings as given
    ranks: Change | None = None  # when nothing offered fits one card: training.fsdp over the fewest ranks
    methods: list = field(default_factory=list)  # memory/methods.py: every way to train, learning order

    def to_json(self) -> dict:
        out = self.estimate.to_json()
        out.update(
            budget={"bytes": self.budget.bytes, "given": self.budget.given, "source": self.budget.source,
                    "GB": round(self.budget.bytes / 1000**3, 2), "GiB": round(self.budget.bytes / 1024**3, 2)},
            largest_seq_len=self.largest_seq_len, largest_batch_size=self.largest_batch_size,
            context_length=self.context_length, weights_fit=self.weights_fit,
            advice=[{"set": c.overrides, "why": c.why, "total_bytes": c.estimate.total_bytes,
                     "fits": c.estimate.fits, "ranks": c.ranks} for c in self.advice],
            fewest_ranks=self.ranks.ranks if self.ranks else None,
            smallest_budget_bytes=self.leanest.estimate.total_bytes if self.leanest else None,
            smallest_gpu=self.smallest_gpu, smallest_gpu_as_is=self.smallest_gpu_as_is,
            optimizers={opt: {mode: {"total_bytes": e.total_bytes, "fits": e.fits,
                                     "paged_host_bytes": e.paged_host_bytes}
                              for (o, mode), e in self.grid.items() if o == opt}
                        for opt in OPTIMIZERS if any(o == opt for o, _ in self.grid)},
            methods=[{"method": m.name, "set": m.overrides, "learned": m.learned,
                      "total_bytes": m.estimate.total_bytes, "fits": m.estimate.fits} for m in self.methods],
        )
        return out

    @property
    def advice(self) -> list[Change]:
        """The advice table's rows: the changes, then the ranks that fit when nothing else does."""
        return [*self.changes, *([self.ranks] if self.ranks else [])]


def build_report(s: Settings, budget: Budget) -> Report:
    from lisaft.model.load import context_length

    est = compute(s)
    layers = param_counts(s.config, s.layers_path).layer_count
    weights_fit = est.weights_bytes + est.components.get("cuda_context", 0) <= s.budget_bytes
    changes = advice(est, layers) if not est.fits and weights_fit else []
    lean = None
    if not est.fits and not any(c.estimate.fits for c in changes):
        lean = leanest(s, layers)
        changes = [c for c in changes if c.overrides != lean.overrides]
    gamma = s.active_layers if s.lisa else min(2, layers)
    card = smallest_gpu(lean.estimate.total_bytes) if lean else None
    as_is = smallest_gpu(est.total_bytes)
    return Report(est, budget, changes, optimizer_grid(s, gamma), largest_fitting(s, "seq_len"),
                  largest_fitting(s, "batch_size"), context_length(s.config), weights_fit, lean,
                  card.name if card else None, as_is.name if as_is else None,
                  fewest_ranks(s, layers) if lean or (s.fsdp and not est.fits) else None, methods(s))


def estimate_memory_command(flags: EstimateFlags) -> int:
    b = parse_budget(flags.budget, flags.gpu)
    s = build_settings(flags, b.bytes)
    report = build_report(s, b)
    if flags.json_out:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    from rich.console import Console

    from lisaft.memory.render import render

    Console().print(render(report, flags.explain))
    return 0
