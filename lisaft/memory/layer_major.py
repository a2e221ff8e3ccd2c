"""The layer-major backward of optimizer.cpu_offload (optimizer.offload_accumulation: device;
lisaft/train/layer_major.py): its memory, its group size, and its transfers.

A group's micro-batches keep every decoder layer's input in host memory (pinned on CUDA) from
the forward until that layer's backward: layers x tokens x hidden x the dtype's bytes per
micro-batch, 16 MiB a layer for Llama-3.1-8B at 2,048 tokens. The group is the most micro-batches
whose inputs the host RAM holds beside everything else the run keeps there; each further group
ships and adds each gradient once more on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lisaft.config.schema import Recipe


def saved_input_bytes(layers: int, tokens: int, hidden: int, dt: int) -> int:
    """One micro-batch of `tokens` positions: each decoder layer's input, kept on the host."""
    return layers * tokens * hidden * dt


def group_size(grad_accum_steps: int, per_micro_batch: int, free_host_bytes: int | None,
               asked: int | None = None) -> int:
    """Micro-batches per group: optimizer.offload_group_size when set, else as many as
    `free_host_bytes` holds (all of the step's where the RAM is not known), at least one."""
    if asked is not None:
        return min(asked, grad_accum_steps)
    if free_host_bytes is None or per_micro_batch <= 0:
        return grad_accum_steps
    return max(1, min(grad_accum_steps, free_host_bytes // per_micro_batch))


def groups(grad_accum_steps: int, size: int) -> int:
    return -(-grad_accum_steps // size)


def run_group_size(recipe: Recipe, device: str, layers: int, hidden: int, dt: int) -> int:
    """The group size of a run about to start on this machine: the host RAM less the estimate of
    everything else the run keeps in host memory, over one micro-batch's saved inputs."""
    from lisaft.errors import LisaftError
    from lisaft.memory.command import estimate_for_recipe, host_ram_bytes

    t, o = recipe.training, recipe.optimizer
    per = saved_input_bytes(layers, t.batch_size * recipe.data.max_seq_len, hidden, dt)
    ram = host_ram_bytes()
    if o.offload_group_size is not None or ram is None:
        return group_size(t.grad_accum_steps, per, None, o.offload_group_size)
    try:
        est = estimate_for_recipe(recipe, device=device, budget_bytes=ram)
    except LisaftError:
        return group_size(t.grad_accum_steps, per, None)
    held = est.total_bytes if device == "cpu" else est.host_bytes
    held -= est.host_components.get("layer_inputs", 0)
    return group_size(t.grad_accum_steps, per, ram - held)
