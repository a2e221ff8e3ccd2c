"""`lisa.active_layers: auto`: the largest γ whose estimated peak fits the device's memory with
AUTO_MARGIN (5%) of it left free.

The device's memory is, on a GPU, what is free when the run starts plus this process's own CUDA
context (the estimate counts the context itself), so another process's memory (a desktop's
display) is not counted as the run's; where the free memory cannot be read, the GPU's total. On
CPU it is the host RAM available when the run starts (MemAvailable: what the run can take without
swapping out other processes), else the physical RAM. `lisaft estimate-memory` makes the same
choice against its budget (--budget, --gpu, or its default)."""

from __future__ import annotations

from dataclasses import dataclass

from lisaft.errors import LisaftError
from lisaft.memory.advice import AUTO_MARGIN, largest_fitting_layers
from lisaft.memory.counts import param_counts
from lisaft.memory.cuda_process import CUDA_CONTEXT_BYTES
from lisaft.memory.estimate import compute
from lisaft.memory.settings import GiB, Settings


@dataclass(frozen=True)
class LayerChoice:
    active_layers: int
    total_bytes: int
    budget_bytes: int
    layer_count: int = 0

    def line(self) -> str:
        line = (f"γ={self.active_layers}: {self.total_bytes / GiB:.1f} of {self.budget_bytes / GiB:.1f} GiB "
                f"({AUTO_MARGIN:.0%} kept free)")
        if self.active_layers == self.layer_count:
            line += "; that is every layer: full fine-tuning, LISA samples nothing"
        return line


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gpu_memory_free() -> int | None:
    """Free GPU memory plus this process's CUDA context (which reading it creates, and which the
    estimate counts itself); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return min(total, free + CUDA_CONTEXT_BYTES)


def device_memory_bytes(device: str) -> int:
    if device == "cpu":
        available = host_memory_available()
        if available is not None:
            return available
    if device == "cuda":
        free = gpu_memory_free()
        if free is not None:
            return free
    from lisaft.memory.command import _device_budget

    return _device_budget(device)


def choose_active_layers(s: Settings) -> LayerChoice:
    """The largest fitting γ; LisaftError naming lisa.active_layers when not even γ=1 fits."""
    layers = param_counts(s.config, s.recipe.model.layers_path).layer_count
    est = largest_fitting_layers(s, layers, AUTO_MARGIN)
    if est is None:
        one = compute(s.with_keys({"lisa.enabled": True, "lisa.active_layers": 1}))
        raise LisaftError(
            f"lisa.active_layers: auto: even γ=1 needs an estimated {one.total_bytes / GiB:.1f} GiB, more than "
            f"{1 - AUTO_MARGIN:.0%} of the {s.budget_bytes / GiB:.1f} GiB budget; `lisaft estimate-memory RECIPE` "
            "shows what brings it under, or set lisa.active_layers to a number")
    return LayerChoice(est.settings.active_layers, est.total_bytes, s.budget_bytes, layers)


def resolve_active_layers(recipe, device: str, budget_bytes: int | None = None) -> LayerChoice | None:
    """Replace `auto` in `recipe.lisa.active_layers` by the chosen γ (so the run's recipe.yaml
    records it and a resume trains the same layers); None when there was nothing to resolve."""
    from lisaft.memory.command import settings_from_recipe

    if not recipe.lisa.enabled or recipe.lisa.active_layers != "auto":
        return None
    budget = budget_bytes if budget_bytes is not None else device_memory_bytes(device)
    choice = choose_active_layers(settings_from_recipe(recipe, device=device, budget_bytes=budget))
    recipe.lisa.active_layers = choice.active_layers
    return choice


def resolve_for_run(recipe, device: str) -> LayerChoice | None:
    """resolve_active_layers at a run's set-up: against the smallest device memory of all
    data-parallel ranks, so that every rank trains the same γ."""
    from lisaft.distributed import dist

    if not recipe.lisa.enabled or recipe.lisa.active_layers != "auto":
        return None
    budget = dist.min_over_ranks(device_memory_bytes(device))
    try:
        return resolve_active_layers(recipe, device, budget)
    except LisaftError as e:
        if str(e).startswith("lisa.active_layers"):
            raise
        raise LisaftError(f"lisa.active_layers: auto needs the memory estimate, which failed ({e}); "
                          "set lisa.active_layers to a number") from None
