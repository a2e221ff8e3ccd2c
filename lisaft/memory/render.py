"""Rendering estimates: rich tables for people, a JSON object for scripts."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from lisaft.memory.advice import AUTO_MARGIN, RANKS, host_is_the_limit
from lisaft.memory.estimate import SETUP_PHASES, Estimate
from lisaft.memory.grpo import generation_peak_phase, grpo_lines, training_peak_phase
from lisaft.memory.layer_major import layer_major_lines
from lisaft.memory.methods import shared_settings
from lisaft.memory.preference import preference_lines
from lisaft.memory.tables import HOST_RAM_NO, advice_table, fit_mark, grid_table, human, human_pair, methods_table

_DESCRIPTIONS = {
    "weights": "all parameters and buffers, model dtype",
    "gradients": "trainable set, model dtype",
    "optimizer_states": "moments (+ absmax, qmaps, step) of the trainable set",
    "activations": "saved for backward by layers, norms, head input",
    "logits_loss": "float32 log-probs + their gradients, vocab x tokens",
    "transient": "step temporaries, checkpoint recompute, backward buffers",
    "cublas_workspace": "cuBLAS workspaces: forward and backward threads, 32 MiB each",
    "allocator_overhead": "caching allocator reserve (2% expandable segments, 9% default)",
    "cuda_context": "CUDA context before any kernel ran",
    "cuda_kernels": "kernel images loaded lazily, library state (fitted to NVML)",
    "process_baseline": "Python + torch + transformers resident set",
    "host_weight_copies": "cpu_offload's copy of the weights the CPU step updates",
    "gathered_units": "whole weights of the units gathered now (root, head, layers)",
    "gradient_reduce": "a unit's whole gradient and its float32 reduce-scatter buffers",
    "unsharded_load": "the whole model, built from model.config on every rank before it is sharded",
    "kv_cache": "GRPO's generation: keys and values of every sampled sequence",
    "sampling_logits": "GRPO's generation: each sequence's next-token logits and probabilities",
    "reference_weights": "GRPO with beta > 0: a frozen copy of the initial weights",
}
# training.fsdp: what the resident components are per rank.
_FSDP_DESCRIPTIONS = {
    "weights": "this rank's slices of all parameters (dim 0), + buffers",
    "gradients": "this rank's slices of the trainable set's gradients",
    "optimizer_states": "moments of this rank's trainable slices",
}
_HOST_DESCRIPTIONS = {
    "moments": "optimizer state of the trainable set, never paged",
    "host_weights": "a copy of every parameter, model dtype (pinned)",
    "gradient_accumulators": "trainable set, model dtype (pinned)",
    "staging": "later micro-batches' gradients before they are added (pinned)",
    "step_temporaries": "the CPU step's float32 chunk buffers, clipping norms",
    "activation_checkpoints": "offloaded layer inputs (pinned)",
    "layer_inputs": "the layer-major backward's saved layer inputs, one group (pinned)",
    "process_baseline": "Python + torch + transformers resident set",
}

PAGED_EXPLANATION = (
    "Paged optimizers keep their large moment buffers in CUDA unified memory. The driver moves "
    "those pages between GPU and host on demand: they stay on the GPU while there is room and "
    "are evicted to host memory under pressure (then fetched back at each step, which is slow). "
    "PyTorch's allocator does not see them: torch.cuda.max_memory_allocated/reserved leave them "
    "out, nvidia-smi/NVML count whatever is resident. That is why paged 8-bit can show more GPU "
    "memory than paged 32-bit: (1) in torch's counters, 8-bit's absmax and the state of small "
    "tensors are ordinary allocations while almost all 32-bit state is invisible; (2) in nvidia-smi, "
    "8-bit's state is a quarter the size, so it fits and stays resident, while 32-bit's is pushed "
    "out to host and does not show, at the price of migrating it every step."
)


def settings_line(est: Estimate) -> str:
    s = est.settings
    r = s.recipe
    gamma = f"auto → {s.active_layers}" if s.auto else s.active_layers
    lisa = f"LISA γ={gamma} ({r.lisa.state_policy})" if r.lisa.enabled else "full fine-tuning"
    if r.lora.enabled:
        four_bit = r.model.quantize is not None
        lisa = (f"{'QLoRA' if four_bit else 'LoRA'} r{r.lora.rank}{' DoRA' if r.lora.dora else ''}"
                f"{' on a 4-bit base' if four_bit else ''}")
    accum = r.training.grad_accum_steps
    return (
        f"{s.model_label}: {est.total_params:,} params, {est.trainable_params:,} trainable; "
        f"{lisa}; {r.optimizer.name}{' in backward' if r.optimizer.in_backward else ''}"
        f"{' on the CPU (cpu_offload)' if r.optimizer.cpu_offload else ''}; {r.model.dtype}; "
        f"{s.attention}; checkpointing {'on' if r.model.gradient_checkpointing else 'off'}; "
        f"{f'GRPO G={r.grpo.num_generations} beta={r.grpo.beta:g}; ' if r.grpo is not None else ''}"
        f"batch {r.training.batch_size}{' pairs (2 sequences each)' if r.preference is not None else ''} x seq "
        f"{r.data.max_seq_len}"
        f"{f' x accum {accum}' if accum > 1 else ''}; device {s.device}"
        f"{f'; training.fsdp, per rank of {s.ranks}' if s.fsdp else ''}"
    )


def components_table(est: Estimate, phase: str | None = None) -> Table:
    """The components at the peak, or at `phase` (a key of est.phases)."""
    phase = phase or est.peak_phase
    other = "GRPO's other peak" if est.generation is not None else "step's peak"
    title = f"Memory at the {'peak' if phase == est.peak_phase else other}"
    t = Table(title=f"{title} ({phase.replace('_', ' ')})", title_justify="left")
    t.add_column("component")
    t.add_column("at peak", justify="right")
    t.add_column("full size", justify="right")
    t.add_column("what", style="dim")
    described = {**_DESCRIPTIONS, **(_FSDP_DESCRIPTIONS if est.settings.fsdp else {})}
    for name, value in est.phase_components[phase].items():
        t.add_row(name, human(value), human(est.sizes.get(name, value)), described.get(name, ""))
    t.add_row("[bold]total[/]", f"[bold]{human(est.phases[phase])}[/]", "", f"budget {human(est.budget_bytes)}")
    return t


def step_peak_phase(est: Estimate) -> str:
    """The training step's own peak moment, apart from the set-up's (SETUP_PHASES)."""
    return max((p for p in est.phases if p not in SETUP_PHASES), key=lambda p: est.phases[p])


def host_table(est: Estimate) -> Table:
    from lisaft.memory.host import pinned_bytes

    budget = est.settings.host_budget_bytes
    t = Table(title="Host memory (cpu_offload)", title_justify="left")
    t.add_column("component")
    t.add_column("bytes", justify="right")
    t.add_column("what", style="dim")
    for name, value in est.host_components.items():
        if value:
            t.add_row(name, human(value), _HOST_DESCRIPTIONS.get(name, ""))
    t.add_row("[bold]total[/]", f"[bold]{human(est.host_bytes)}[/]",
              f"{human(pinned_bytes(est.host_components))} pinned; RAM {human(budget)}")
    return t


def verdict(est: Estimate) -> Text:
    if not est.fits_host and not est.host_components:
        return Text(f"Does not fit in host memory: model.offload_activations pins {human(est.host_bytes)} of layer "
                    f"inputs in host memory, the machine has {human(est.settings.host_budget_bytes)} of RAM (the "
                    f"GPU needs {human(est.total_bytes)} of {human(est.budget_bytes)}).", style="bold red")
    if not est.fits_host:
        return Text(f"Does not fit in host memory: cpu_offload needs {human(est.host_bytes)} of RAM, the "
                    f"machine has {human(est.settings.host_budget_bytes)} (the GPU needs "
                    f"{human(est.total_bytes)} of {human(est.budget_bytes)}).", style="bold red")
    if est.fits and est.host_components:
        return Text(f"Fits: {human(est.total_bytes)} of {human(est.budget_bytes)} on the GPU, and "
                    f"{human(est.host_bytes)} of host memory (RAM {human(est.settings.host_budget_bytes)}).",
                    style="bold green")
    if est.fits:
        need, budget = human_pair(est.total_bytes, est.budget_bytes)
        return Text(f"Fits: {need} of {budget}, everything resident.", style="bold green")
    need, budget = human_pair(est.total_bytes, est.budget_bytes)
    if est.paged_state_bytes and est.fits_with_paging:
        return Text(
            f"Runs, but paged: {human(est.paged_host_bytes)} of optimizer state is paged to host "
            f"memory each step (needs {need} resident, budget {budget}).",
            style="bold yellow")
    return Text(f"Does not fit: {need} > {budget} (over by {human(est.total_bytes - est.budget_bytes)}).",
                style="bold red")


def paged_lines(est: Estimate, explain: bool = False) -> Text | None:
    """One line on paged state; the explanation of paging when asked, or when pages do move to
    host (then the user's measurements will disagree with torch's counters)."""
    if not est.paged_state_bytes:
        return None
    line = (f"Paged optimizer state: {human(est.paged_state_bytes)}; stays on GPU: "
            f"{human(est.paged_gpu_bytes)}; paged to host: {human(est.paged_host_bytes)}.")
    if explain or est.paged_host_bytes:
        return Text(line + "\n" + PAGED_EXPLANATION)
    return Text(line + " (--explain: how paged memory is counted)")


NOTHING_PAGED = (
    "Nothing is paged with {optimizer}: every component above is an ordinary allocation on the "
    "GPU, so torch's counters (max_memory_reserved) and nvidia-smi agree on it, except "
    "cuda_context and cuda_kernels, which only nvidia-smi counts. Paging applies to "
    "paged_adamw_32bit and paged_adamw_8bit (--optimizer) only."
)
CPU_OFFLOAD_COUNTED = (
    "Nothing is paged with optimizer.cpu_offload: the GPU rows are ordinary allocations (torch's "
    "max_memory_reserved and nvidia-smi agree on them, except cuda_context and cuda_kernels, which only "
    "nvidia-smi counts), and the host table's rows are ordinary host memory, most of it pinned (page-locked: "
    "never swapped, so it must fit in RAM), which the process's resident set (RSS, `ps`) counts. The "
    "moments and gradients the run's metrics call offloaded_state_bytes are that host memory; the run's "
    "end-of-run table shows the host rows beside the GPU's."
)
NOTHING_PAGED_CPU = (
    "Nothing is paged on CPU: the estimate is the process's peak resident set (RSS), as "
    "`ps` and metrics.jsonl's peak_memory_bytes count it; paging needs CUDA unified memory."
)
LISA_RECIPE = "recipes/llama3.1-8b-lisa-24gb.yaml"
# What lisaft offers when one card cannot hold a model.
SEVERAL_GPUS = ("it needs several GPUs with the model sharded across them by FSDP2: training.fsdp under "
                "torchrun (docs/distributed.md)")


def explain_lines(est: Estimate) -> Text:
    """--explain when nothing is paged: say so, and what a measurement will count."""
    if est.settings.device == "cpu":
        return Text(NOTHING_PAGED_CPU)
    if est.host_components:
        return Text(CPU_OFFLOAD_COUNTED)
    return Text(NOTHING_PAGED.format(optimizer=est.settings.recipe.optimizer.name))


def _no_budget_fits(report) -> Text:
    """When nothing offered fits: say so, and name what would."""
    est, lean = report.estimate, report.leanest
    head = (f"Even the weights ({human(est.weights_bytes)}) do not fit in {human(est.budget_bytes)}: "
            "no setting trains this model on this budget."
            if not report.weights_fit else
            f"No change lisaft offers fits it in {human(est.budget_bytes)}.")
    where = (f"the smallest GPU that could: --gpu {report.smallest_gpu}" if report.smallest_gpu else
             f"more than any GPU in the catalogue: {SEVERAL_GPUS}")
    setup = f"The leanest setup ({lean.what})" if lean.overrides else "These settings are the leanest lisaft has:"
    ranks = report.ranks
    whole = est.weights_bytes + est.sizes.get("unsharded_load", 0)
    # Only a random init from model.config is built whole; name_or_path is read shard by shard.
    loads_whole = (f": each rank first builds the whole model from model.config ({human(whole)} of weights) "
                   "and only then shards it (lisaft/model/load.py)"
                   if est.settings.recipe.model.config is not None and whole > est.budget_bytes else "")
    shard = (f" Sharded with training.fsdp, {ranks.ranks} GPUs of this budget hold it: "
             f"{human(ranks.estimate.total_bytes)} per rank (last row above)." if ranks else
             f" Not even {RANKS[-1]} GPUs of this budget hold it with training.fsdp{loads_whole}.")
    return Text(f"{head} {setup} needs {human(lean.estimate.total_bytes)}; {where}.{shard}", style="bold red")


def _as_is_line(report) -> Text:
    """The card a buyer would need for the run exactly as given."""
    total = human(report.estimate.total_bytes)
    if report.smallest_gpu_as_is:
        return Text(f"As it is, it needs {total}: the smallest catalogue GPU that fits it is "
                    f"--gpu {report.smallest_gpu_as_is}.")
    return Text(f"As it is, it needs {total}: more than any GPU in the catalogue.")


def _host_limit_line(est: Estimate) -> Text:
    """When the GPU holds the run and the RAM does not: a bigger GPU would not help."""
    return Text(
        f"Host RAM is the limit, not the GPU: optimizer.cpu_offload keeps the moments, the gradient "
        f"accumulators and a copy of the weights in {human(est.host_bytes)} of host memory. What else trains "
        f"this model: optimizer.cpu_offload: false puts moments and the step back on the GPU (full fine-tuning, "
        f"if the GPU holds it: the rows below say); LISA ({LISA_RECIPE} for Llama-3.1-8B) trains a few layers at "
        "a time with little host memory, and learned less than full fine-tuning on the learning benchmark "
        "(docs/learning.md).")


def _largest_line(report) -> Text:
    s = report.estimate.settings
    seq = report.largest_seq_len
    seq_text = "none" if seq is None else str(seq)
    if seq is not None and seq == report.context_length:
        seq_text += " (the model's context length)"
    batch = "none" if report.largest_batch_size is None else str(report.largest_batch_size)
    unit = " pairs" if s.recipe.preference is not None else ""
    return Text(f"Largest sequence length that fits at batch {s.recipe.training.batch_size}{unit}: {seq_text}; "
                f"largest batch at seq {s.recipe.data.max_seq_len}: {batch}{unit}.")


def render(report, explain: bool = False) -> Group:
    """The text of `lisaft estimate-memory` for a lisaft.memory.command.Report."""
    est = report.estimate
    parts: list = [Text(settings_line(est), style="bold"), Text(f"Budget: {report.budget.explained()}")]
    parts += [Text(line) for line in report.flag_notes]
    if est.settings.auto:
        parts.append(_auto_line(est))
    parts.append(components_table(est))
    if est.generation is not None:  # GRPO: the other of its two peaks
        other = training_peak_phase(est) if est.peak_phase == generation_peak_phase(est) else \
            generation_peak_phase(est)
        parts.append(components_table(est, other))
    elif est.peak_phase in SETUP_PHASES:
        parts.append(components_table(est, step_peak_phase(est)))
    if est.host_components:
        parts.append(host_table(est))
    parts.append(verdict(est))
    if est.layer_major is not None:
        parts.append(Text(layer_major_lines(est, explain)))
    paged = paged_lines(est, explain)
    if paged is not None:
        parts.append(paged)
    elif explain:
        parts.append(explain_lines(est))
    if host_is_the_limit(est):
        parts.append(_host_limit_line(est))
    elif not est.fits and est.settings.device == "cuda":
        parts.append(_as_is_line(report))
    if est.activation_host_bytes and not est.host_components:
        parts.append(Text(f"Host memory for offloaded activation checkpoints: {human(est.activation_host_bytes)} "
                          f"pinned (model.offload_activations), of {human(est.settings.host_budget_bytes)} of RAM."))
    elif report.host_ram is not None and not est.host_bytes:
        parts.append(Text(f"--host-ram {report.host_ram}: these settings keep nothing in host memory beyond the "
                          "process; the RAM decides with optimizer.cpu_offload or model.offload_activations, as in "
                          "the rows below that use them."))
    if not host_is_the_limit(est):
        parts.append(_largest_line(report))
    if report.advice:
        parts.append(advice_table(report.advice, host=host_is_the_limit(est)))
    if report.leanest is not None:
        parts.append(_no_budget_fits(report))
    parts.append(grid_table(report.grid, est.budget_bytes))
    if report.methods:
        parts.append(methods_table(report.methods, est.budget_bytes, shared_settings(est.settings)))
    marks = [fit_mark(e) for e in (*report.grid.values(), *(c.estimate for c in report.advice))]
    if "no (host RAM)" in marks:
        parts.append(Text(HOST_RAM_NO, style="dim"))
    parts += [Text(line) for line in preference_lines(est)]
    parts += [Text(line) for line in grpo_lines(est, explain)]
    for note in est.notes:
        parts.append(Text(f"note: {note}", style="dim"))
    return Group(*parts)


def _auto_line(est: Estimate) -> Text:
    if est.fits:
        return Text(f"lisa.active_layers: auto picks γ={est.settings.active_layers}: "
                    f"{est.total_bytes / 1024**3:.1f} of {est.budget_bytes / 1024**3:.1f} GiB, the largest γ that "
                    f"fits with {AUTO_MARGIN:.0%} kept free (a run on a device of this budget picks the same)")
    return Text("lisa.active_layers: auto: not even γ=1 fits this budget (shown at γ=1); a run would stop "
                "with this message", style="bold red")


def _pct(est: int | None, meas: int | None) -> str:
    if est is None or meas is None or meas == 0:
        return "-"
    return f"{(est - meas) / meas:+.1%}"


def estimated_vs_measured_rows(estimate: Estimate, measured: dict) -> list[tuple[str, int | None, int | None]]:
    """(quantity, estimated, measured) per row. `measured` holds weights_bytes, grad_bytes,
    optimizer_state_bytes, activation_bytes, peak_bytes; any may be None. peak_bytes is the
    process peak RSS on CPU; on CUDA torch.cuda.max_memory_reserved() plus the paged optimizer
    state's bytes (the estimate's CUDA context is left out of this row)."""
    return [
        ("weights", estimate.weights_bytes, measured.get("weights_bytes")),
        ("gradients", estimate.grad_bytes, measured.get("grad_bytes")),
        ("optimizer states", estimate.optimizer_state_bytes, measured.get("optimizer_state_bytes")),
        ("activations (saved)", estimate.saved_activation_bytes, measured.get("activation_bytes")),
        ("peak (allocator reserved + paged state)" if estimate.settings.device == "cuda" else "peak (RSS)",
         estimate.comparable_peak_bytes, measured.get("peak_bytes")),
    ]


def estimated_vs_measured_table(estimate: Estimate, measured: dict, extra_rows: list | None = None) -> Table:
    """A row per quantity: estimated, measured, difference (see estimated_vs_measured_rows), then
    `extra_rows` (name, estimated, measured): a cpu_offload run's host memory."""
    t = Table(title="Memory: estimated vs measured", title_justify="left")
    t.add_column("")
    t.add_column("estimated", justify="right")
    t.add_column("measured", justify="right")
    t.add_column("difference", justify="right")
    for name, est, meas in [*estimated_vs_measured_rows(estimate, measured), *(extra_rows or [])]:
        t.add_row(name, human(est), human(meas), _pct(est, meas))
    return t
