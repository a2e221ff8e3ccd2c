"""`lisaft estimate-memory`: the recipe and flags into Settings, compute, render.

Each flag is a recipe key (`FLAG_KEYS`): the recipe file is read, then --set, then the flags, and
the result is validated as `lisaft train` validates a recipe, so a flag refused there is refused
here in the same words, and `--model` combines with --set and every flag alike.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lisaft.config.compat import check_world
from lisaft.config.optimizers import OPTIMIZERS
from lisaft.config.overrides import Override, flag_override
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
from lisaft.memory.catalogue import catalogue_names, resolve_model
from lisaft.memory.counts import param_counts
from lisaft.memory.estimate import Estimate, compute
from lisaft.memory.gpus import explain_budget, gpu, parse_bytes, smallest_gpu
from lisaft.memory.grpo import grpo_summary
from lisaft.memory.methods import methods
from lisaft.memory.preference import preference_summary
from lisaft.memory.settings import GiB, Settings, recipe_for_model

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


def _recipe_device(recipe: Recipe) -> str:
    """The recipe's training.device; `auto` estimates for CUDA, the device the estimate exists for."""
    return "cpu" if recipe.training.device == "cpu" else "cuda"


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
                         ranks: int | None = None, model_key: str | None = None) -> Settings:
    """The recipe on `device` with `budget_bytes`; `model_key` names what set the model in messages."""
    ref, key = _model_ref(recipe)
    config, label = resolve_model(ref, model_key or key)
    return Settings(recipe, config, label, device=device, budget_bytes=budget_bytes,
                    host_budget_bytes=host_ram_bytes(), ranks=_ranks(recipe, ranks),
                    expandable_segments=expandable_segments())


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


# The flags that are recipe keys: (EstimateFlags field, the flag, its key). A true/false flag is
# typed --flag or --no-flag.
FLAG_KEYS = (
    ("optimizer", "--optimizer", "optimizer.name"),
    ("batch_size", "--batch-size", "training.batch_size"),
    ("seq_len", "--seq-len", "data.max_seq_len"),
    ("gradient_checkpointing", "--gradient-checkpointing", "model.gradient_checkpointing"),
    ("attention", "--attention", "model.attention"),
    ("dtype", "--dtype", "model.dtype"),
    ("in_backward", "--in-backward", "optimizer.in_backward"),
    ("cpu_offload", "--cpu-offload", "optimizer.cpu_offload"),
    ("device", "--device", "training.device"),
    ("fsdp", "--fsdp", "training.fsdp"),
)


# A flag whose key another key must follow (config/compat.py refuses the pair otherwise) sets that
# key too, and the output says so: (EstimateFlags field, the flag's value, the companion key, its
# value, why). Only where the recipe refuses the flag alone; every other refused combination is
# refused here in `lisaft train`'s words.
COMPANIONS = (
    ("in_backward", True, "training.max_grad_norm", None,
     "the total norm is known only after every update ran, so a step in backward cannot clip"),
    ("gradient_checkpointing", False, "model.offload_activations", False,
     "only checkpointed layer inputs are offloaded"),
)

_FLAGS = {name: flag for name, flag, _ in FLAG_KEYS}


def _typed(flag: str, value: Any) -> str:
    if isinstance(value, bool):
        return flag if value else flag.replace("--", "--no-", 1)
    return f"{flag} {value}"


def flag_overrides(f: EstimateFlags, companions: tuple = ()) -> list[Override]:
    """The recipe keys the flags given set, each naming its flag, and the `companions` (rows of
    COMPANIONS) they carry; they apply after --set."""
    out = []
    if f.model is not None and f.recipe is not None:  # the model replaces the recipe's, whichever key named it
        out += [flag_override(f"--model {f.model}", "model.name_or_path", f.model),
                flag_override(f"--model {f.model}", "model.config", None)]
    for name, flag, key in FLAG_KEYS:
        value = getattr(f, name)
        if value is not None:
            out.append(flag_override(_typed(flag, value), key, value))
    for name, value, key, companion, _ in companions:
        out.append(flag_override(_typed(_FLAGS[name], value), key, companion))
    if f.no_lisa:
        out.append(flag_override("--no-lisa", "lisa.enabled", False))
    if f.lisa_layers is not None:
        out += [flag_override(f"--lisa-layers {f.lisa_layers}", "lisa.enabled", True),
                flag_override(f"--lisa-layers {f.lisa_layers}", "lisa.active_layers", f.lisa_layers)]
    return out


def carried(f: EstimateFlags) -> tuple:
    """The COMPANIONS the flags given carry: those of a flag given, when the recipe refuses the flags
    without them."""
    wanted = tuple(c for c in COMPANIONS if getattr(f, c[0]) == c[1])
    if wanted:
        try:
            _load(f, flag_overrides(f))
        except LisaftError:
            return wanted
    return ()


def companion_notes(f: EstimateFlags) -> list[str]:
    """One line per companion key the flags given carry, and the `--set` items `lisaft train` takes
    for the same recipe."""
    notes = [f"{_typed(_FLAGS[name], value)} also sets {key}: {json.dumps(companion)} ({why})"
             for name, value, key, companion, why in carried(f)]
    if notes:
        notes.append("the same recipe for `lisaft train`: " + train_sets(f))
    return notes


def train_sets(f: EstimateFlags) -> str:
    """The flags given as `--set key=value` items, the way `lisaft train RECIPE` takes them."""
    return " ".join("--set " + shlex.quote(f"{o.key}={_as_yaml(o.value)}") for o in flag_overrides(f, carried(f)))


def _as_yaml(value: Any) -> str:
    """`value` as --set reads it back (YAML): null, true, 2, paged_adamw_8bit."""
    text = json.dumps(value)
    return value if isinstance(value, str) and yaml.safe_load(value) == value else text


def _load(f: EstimateFlags, flags: list[Override]) -> Recipe:
    """The recipe file (or --model's defaults), then --set, then `flags`; validated."""
    overrides: list[str | Override] = [*f.overrides, *flags]
    if f.recipe is not None:
        return load_recipe(f.recipe, overrides)
    if f.model is None:
        raise LisaftError("give a RECIPE or --model NAME (catalogue: " + ", ".join(catalogue_names()) + ")")
    return recipe_for_model(f.model, overrides)


def estimate_recipe(f: EstimateFlags) -> Recipe:
    """The recipe file (or --model's defaults), then --set, then the flags and the companions they
    carry; validated."""
    return _load(f, flag_overrides(f, carried(f)))


def build_settings(f: EstimateFlags, budget_bytes: int) -> Settings:
    """The estimate's settings: the recipe with every flag given applied, on the machine the
    flags describe."""
    if f.lisa_layers is not None and f.no_lisa:
        raise LisaftError("--lisa-layers and --no-lisa contradict each other; give one")
    if f.ranks is not None and f.ranks < 1:
        raise LisaftError(f"--ranks: must be at least 1, got {f.ranks}")
    recipe = estimate_recipe(f)
    s = settings_from_recipe(recipe, _recipe_device(recipe), budget_bytes, f.ranks or 1,
                             "--model" if f.model is not None else None)
    if f.host_ram is not None:
        s = s.with_(host_budget_bytes=parse_bytes(f.host_ram, "--host-ram"))
    check_ranks(s, f.ranks)
    # What `lisaft train` refuses at set-up, before the model loads, for this device and ranks.
    check_world(recipe, s.ranks, launched=True, device=s.device)
    layers = param_counts(s.config, recipe.model.layers_path).layer_count
    if s.auto:
        chosen = largest_fitting_layers(s, layers, AUTO_MARGIN)
        s = s.with_keys({"lisa.active_layers": chosen.settings.active_layers if chosen else 1})
        s = s.with_(active_layers_auto=True)
    if recipe.lisa.enabled and s.active_layers > layers:
        key = f"--lisa-layers {f.lisa_layers}" if f.lisa_layers is not None else "lisa.active_layers"
        raise LisaftError(f"{key}: {s.active_layers} is more than the model's {layers} layers")
    return s


def check_ranks(s: Settings, ranks: int | None) -> None:
    """--ranks against training.fsdp, as `lisaft train` under torchrun would take them (the rest of
    FSDP's refusals are the recipe's, lisaft/config/compat.py)."""
    if not s.fsdp:
        if s.ranks > 1:
            raise LisaftError(f"--ranks {s.ranks}: without training.fsdp every rank holds the whole model (data "
                              "parallel), so each rank's figure is the estimate without --ranks; add --fsdp (or "
                              "--set training.fsdp=true) for sharded per-rank figures")
        return
    if ranks is None:
        raise LisaftError("training.fsdp: give --ranks N, the number of processes (torchrun --nproc-per-node N): "
                          "the estimate is one rank's")


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
    host_ram: str | None = None  # --host-ram as given
    flag_notes: list[str] = field(default_factory=list)  # companion_notes: keys the flags set beside their own

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
            preference=preference_summary(self.estimate), grpo=grpo_summary(self.estimate),
            flag_notes=self.flag_notes,
        )
        return out

    @property
    def advice(self) -> list[Change]:
        """The advice table's rows: the changes, then the ranks that fit when nothing else does."""
        return [*self.changes, *([self.ranks] if self.ranks else [])]


def build_report(s: Settings, budget: Budget, host_ram: str | None = None) -> Report:
    from lisaft.model.load import context_length

    est = compute(s)
    layers = param_counts(s.config, s.recipe.model.layers_path).layer_count
    weights_fit = est.weights_bytes + est.components.get("cuda_context", 0) <= s.budget_bytes
    changes = advice(est, layers) if not est.fits and weights_fit else []
    lean = None
    if not est.fits and not any(c.estimate.fits for c in changes):
        lean = leanest(s, layers)
        changes = [c for c in changes if c.overrides != lean.overrides]
    gamma = s.active_layers if s.recipe.lisa.enabled else min(2, layers)
    card = smallest_gpu(lean.estimate.total_bytes) if lean else None
    as_is = smallest_gpu(est.total_bytes)
    return Report(est, budget, changes, optimizer_grid(s, gamma), largest_fitting(s, "data.max_seq_len"),
                  largest_fitting(s, "training.batch_size"), context_length(s.config), weights_fit, lean,
                  card.name if card else None, as_is.name if as_is else None,
                  fewest_ranks(s, layers) if lean or (s.fsdp and not est.fits) else None, methods(s), host_ram)


def estimate_memory_command(flags: EstimateFlags) -> int:
    b = parse_budget(flags.budget, flags.gpu)
    s = build_settings(flags, b.bytes)
    report = build_report(s, b, flags.host_ram)
    report.flag_notes = companion_notes(flags)
    if flags.json_out:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    from rich.console import Console

    from lisaft.memory.render import render

    Console().print(render(report, flags.explain))
    return 0
