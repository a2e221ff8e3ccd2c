"""The layer-major backward of optimizer.cpu_offload (optimizer.offload_accumulation: device;
lisaft/train/layer_major.py): its memory, its group size, and its transfers.

A group's micro-batches keep every decoder layer's input in host memory (pinned on CUDA) from
the forward until that layer's backward: layers x tokens x hidden x the dtype's bytes per
micro-batch, 16 MiB a layer for Llama-3.1-8B at 2,048 tokens. The group is the most micro-batches
whose inputs the host RAM holds beside everything else the run keeps there; each further group
ships and adds each gradient once more on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lisaft.config.schema import Recipe
    from lisaft.memory.activations import Shape
    from lisaft.memory.counts import ParamCounts
    from lisaft.memory.estimate import Estimate
    from lisaft.memory.settings import Settings
    from lisaft.memory.step_terms import Backward, Resident


# The share of the RAM the run may fill with saved layer inputs, beside what it holds anyway: the
# rest is the system's and the page cache's.
HOST_RAM_SHARE = 0.9


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


@dataclass(frozen=True)
class LayerMajorTerms:
    """The layer-major backward's sizes for one recipe on one machine."""

    group: int           # micro-batches per group
    groups: int          # groups per step: groups - 1 host additions of each gradient
    saved_inputs: int    # one micro-batch's layer inputs, in host memory
    boundary: int        # one micro-batch's gradient at a layer boundary, on the device

    @property
    def host_bytes(self) -> int:
        return self.group * self.saved_inputs


def layer_major_terms(s: Settings, shape: Shape, dt: int, free_host_bytes: int | None) -> LayerMajorTerms:
    rec = s.recipe
    tokens = s.sequences * rec.data.max_seq_len
    per = saved_input_bytes(shape.layers, tokens, shape.hidden, dt)
    accum = rec.training.grad_accum_steps
    size = group_size(accum, per, free_host_bytes, rec.optimizer.offload_group_size)
    return LayerMajorTerms(group=size, groups=groups(accum, size), saved_inputs=per,
                           boundary=tokens * shape.hidden * dt)


def device_phases(phases: dict[str, dict[str, int]], s: Settings, counts: ParamCounts, dt: int, r: Resident,
                  b: Backward, t: LayerMajorTerms) -> dict[str, dict[str, int]]:
    """The moments of a layer-major step on the training device. Each holds the group's boundary
    gradients (one per micro-batch, moved down a layer at a time) and the arguments each layer
    was called with (a packed batch's mask, per micro-batch); no layer keeps a graph between
    micro-batches. The head's gradient is summed over the group at the loss's backward; one
    layer's at a time below it, beside that layer's recompute for one micro-batch (its fetched
    input and full activations); the embeddings' last. On a CPU device the saved inputs are in
    the memory that counts too."""
    held = t.group * (t.boundary + b.act.packed_mask) + (t.host_bytes if s.device == "cpu" else 0)
    recompute = b.act.one_layer_full if s.recipe.model.gradient_checkpointing else 0
    layer_grad = max((sum(layer) for layer in r.local.layers), default=0) * dt
    embeddings = sum(r.local.embeddings) * dt - r.sparse_saving if s.embeddings_train else 0
    out = dict(phases)
    loss, layer = phases["loss_backward"], phases["layer_backward"]
    out["loss_backward"] = {**loss, "gradients": b.head_grad, "activations": held + b.act.outside_layers}
    out["layer_backward"] = {**layer, "gradients": layer_grad,
                             "activations": held + t.boundary + b.act.one_layer_full,
                             "transient": b.layer_transient - recompute}
    out["embedding_backward"] = {**layer, "gradients": embeddings, "activations": held + b.act.outside_layers,
                                 "transient": 0}
    return out


def run_group_size(recipe: Recipe, device: str) -> int:
    """The group size of a run about to start on this machine, as its estimate chooses it (all of
    the step's micro-batches for an architecture the estimator does not model, unless set)."""
    from lisaft.errors import LisaftError
    from lisaft.memory.command import estimate_for_recipe, host_ram_bytes

    t = recipe.training
    try:
        est = estimate_for_recipe(recipe, device=device, budget_bytes=host_ram_bytes() if device == "cpu" else None)
    except LisaftError:
        return group_size(t.grad_accum_steps, 0, None, recipe.optimizer.offload_group_size)
    assert est.layer_major is not None, "offload_accumulation resolves to device"
    return est.layer_major.group


@dataclass(frozen=True)
class Machine:
    """What a step's time is worked out from: the card's bf16 matmul rate at a sustained share,
    the link's bytes per second each way, the host memory's, and the CPU step's seconds per
    parameter."""

    name: str
    matmul_flops_per_s: float
    link_bytes_per_s: float
    host_bytes_per_s: float
    cpu_step_s_per_param: float


# An RTX 4090 (165 TFLOP/s dense bf16 with float32 accumulation, its datasheet; 70% sustained),
# PCIe 4.0 x16 (25 GB/s each way as measured by copies of pinned memory, of 32 nominal), dual-
# channel DDR5 (60 GB/s, a desktop's triad), and lisaft's host step at 1.61 s per 10^9
# parameters (docs/memory.md, "The CPU step at memory speed").
RTX_4090_PCIE4_DDR5 = Machine("RTX 4090, PCIe 4.0 x16, 64 GB DDR5", 0.7 * 165e12, 25e9, 60e9, 1.61e-9)


def step_seconds(params: int, grad_bytes: int, tokens: int, accum: int, machine: Machine,
                 saved_inputs: int = 0, groups: int = 0, clipping: bool = True) -> dict[str, float]:
    """One step's parts and its time. groups 0: the micro-batch-major path (`host`); else the
    layer-major one with `saved_inputs` bytes per micro-batch. The GPU computes 8 x params FLOPs
    a token either way (forward, the checkpoint's or the layer's recompute, backward). The host's
    memory carries the link's bytes and, for each addition, three gradients' (read both, write
    one). The step is given as two bounds: `step_s` with the link and the host's memory wholly
    behind the GPU, `serial_s` with nothing overlapped; the CPU step waits for the global norm
    when clipping, and then hides behind the next step's forward only (a quarter of the compute)."""
    gpu = 8 * params * tokens / machine.matmul_flops_per_s
    if groups:
        out, back, additions = groups * grad_bytes + accum * saved_inputs, accum * saved_inputs, groups - 1
    else:
        out, back, additions = accum * grad_bytes, 0, accum - 1
    back += grad_bytes  # the stepped weights, once
    link = max(out, back) / machine.link_bytes_per_s
    memory = (additions * 3 * grad_bytes + out + back) / machine.host_bytes_per_s
    cpu = params * machine.cpu_step_s_per_param
    exposed = max(0.0, cpu - gpu / 4) if clipping else 0.0
    return {"gpu_s": gpu, "link_s": link, "host_memory_s": memory, "host_additions": additions,
            "cpu_step_s": cpu, "cpu_step_exposed_s": exposed, "step_s": max(gpu, link, memory) + exposed,
            "serial_s": gpu + link + memory + exposed}


def layer_major_lines(est: Estimate, explain: bool) -> str:
    """The layer-major backward in estimate-memory's text: its group and host memory; with
    --explain, both paths' step time on the reference machine, worked out."""
    t, s = est.layer_major, est.settings
    assert t is not None
    rec = s.recipe
    accum = rec.training.grad_accum_steps
    gib = 2**30
    plural = "" if t.groups == 2 else "s"
    text = (f"optimizer.offload_accumulation device (the layer-major backward): {t.group} of {accum} micro-batches "
            f"per group, {t.groups} group{'s' if t.groups > 1 else ''} a step ({t.groups - 1} host addition{plural} "
            f"of each gradient); their layer inputs {t.host_bytes / gib:.2f} GiB of host memory "
            f"({t.saved_inputs / gib:.2f} GiB a micro-batch); {t.boundary / 2**20:.0f} MiB of boundary gradient per "
            "micro-batch of the group on the device.")
    if not explain:
        return text + " (--explain: the step's time from bandwidth)"
    m = RTX_4090_PCIE4_DDR5
    dt = 2 if rec.model.dtype != "float32" else 4
    n, tokens = est.trainable_params, s.sequences * rec.data.max_seq_len * accum
    clipping = rec.training.max_grad_norm is not None
    lines = [text, f"Step time on {m.name} ({m.matmul_flops_per_s / 1e12:.0f} TFLOP/s sustained, link "
                   f"{m.link_bytes_per_s / 1e9:.0f} GB/s each way, host {m.host_bytes_per_s / 1e9:.0f} GB/s, CPU step "
                   f"{m.cpu_step_s_per_param * 1e9:.2f} s per 10^9 parameters): GPU = 8 x {n / 1e9:.2f}e9 params x "
                   f"{tokens:,} tokens / rate; link = the larger direction / link; host memory = (3 gradients an "
                   "addition + the link's bytes) / host; step from max(GPU, link, host memory) (all overlapped) to "
                   "their sum (none), + the CPU step not hidden by the next forward"]
    for name, groups in (("device", t.groups), ("host", 0)):
        p = step_seconds(n, n * dt, tokens, accum, m, t.saved_inputs, groups, clipping)
        lines.append(f"  {name}: GPU {p['gpu_s']:.1f} s, link {p['link_s']:.1f} s, host memory "
                     f"{p['host_memory_s']:.1f} s ({p['host_additions']:.0f} additions), CPU step "
                     f"{p['cpu_step_s']:.1f} s ({p['cpu_step_exposed_s']:.1f} s exposed): step {p['step_s']:.1f} to "
                     f"{p['serial_s']:.1f} s, {p['step_s'] / p['gpu_s']:.2f}x to {p['serial_s'] / p['gpu_s']:.2f}x the "
                     "GPU's compute")
    return "\n".join(lines)
