"""Before a run with the optimizer on the CPU loads anything: its host memory must fit the RAM.

optimizer.cpu_offload keeps the moments, a copy of the weights and the gradient accumulators in
host memory, most of it pinned (page-locked, never swapped). A run whose estimate exceeds the
machine's RAM would load the model for minutes and then be killed by the kernel, or swap the
whole machine to a halt; it is refused at start in one line instead."""

from __future__ import annotations

from lisaft.config.schema import Recipe
from lisaft.errors import LisaftError


def check_host_memory(recipe: Recipe, recipe_file: str, device: str | None = None) -> None:
    """Refuse a cpu_offload run whose estimated host memory exceeds the machine's RAM (on a CPU
    device everything the run holds is host memory)."""
    if not recipe.optimizer.cpu_offload:
        return
    from lisaft.distributed.dist import resolve_device
    from lisaft.memory.command import estimate_for_recipe, host_ram_bytes
    from lisaft.memory.host import pinned_bytes
    from lisaft.memory.render import human

    device = device or resolve_device(recipe.training.device).type
    ram = host_ram_bytes()
    if ram is None:
        return
    try:
        est = estimate_for_recipe(recipe, device=device, budget_bytes=ram if device == "cpu" else None)
    except LisaftError:
        return  # an architecture the estimator does not model: the run reports its own memory
    host = est.host_bytes if device != "cpu" else est.total_bytes
    if host <= ram:
        return
    pinned = f" ({human(pinned_bytes(est.host_components))} of it pinned, which cannot be swapped out)" \
        if est.host_components else ""
    # On a CPU device the whole run is host memory: the command that quotes the same figure is the
    # estimate for that device.
    command = f"lisaft estimate-memory {recipe_file}" + (" --device cpu" if device == "cpu" else "")
    raise LisaftError(
        f"optimizer.cpu_offload: this run needs an estimated {human(host)} of host memory{pinned}, and this "
        f"machine has {human(ram)} of RAM; `{command}` says what lowers it "
        "(optimizer.name: adamw_8bit, LISA) or what fits without it (optimizer.cpu_offload: false)")
