"""What a run says besides its progress: the banner, the end-of-run memory report, and the
out-of-memory message."""

from __future__ import annotations

from pathlib import Path

from lisaft.config.optimizers import optimizer_kind
from lisaft.config.schema import Recipe
from lisaft.console import first_line, warn
from lisaft.errors import LisaftError, RunFailed
from lisaft.metrics.display import Display
from lisaft.metrics.log import RunLog
from lisaft.train.session import Session


def announce(session: Session, display: Display) -> None:
    r = session.recipe
    n_params = sum(p.numel() for p in session.model.parameters())
    lisa = (f"LISA γ={r.lisa.active_layers} of {len(session.parts.layers)} layers every "
            f"{r.lisa.interval_steps} steps, {r.lisa.sampling}, state {r.lisa.state_policy}"
            if r.lisa.enabled else _adapters(r) if r.lora.enabled else "full fine-tuning")
    if session.auto_layers is not None:
        display.print(f"lisa.active_layers auto chose the largest γ that fits the {session.device.type} memory "
                      f"at its estimated peak: {session.auto_layers.line()}")
    display.print(
        f"lisaft: {n_params / 1e6:.1f}M parameters on {session.device}, {r.model.dtype}, "
        f"{lisa}, {r.optimizer.name}{' in backward' if r.optimizer.in_backward else ''}"
        f"{' on the CPU' if r.optimizer.cpu_offload else ''}; "
        + session.objective.describe()
        + f"{len(session.train_examples)} train {'rows' if session.packing else session.objective.unit}"
        + (f", {len(session.eval_examples)} eval" if session.eval_examples else "")
        + f"; steps {session.progress.step}->{r.training.max_steps}; run {session.run_dir}"
    )
    if session.packing is not None:
        display.print(session.packing.summary())


def _adapters(r: Recipe) -> str:
    kind = "DoRA" if r.lora.dora else "LoRA"
    base = f" on a 4-bit {r.model.quantize} base (Q{kind})" if r.model.quantize else " on a frozen base"
    return f"{kind} rank {r.lora.rank}{base}"


def memory_report(session: Session, metrics: RunLog) -> None:
    """The run's own memory, measured, beside what `lisaft estimate-memory` predicts for it."""
    from rich.console import Console

    from lisaft.memory.command import estimate_for_recipe
    from lisaft.memory.render import estimated_vs_measured_table
    from lisaft.metrics.measure import peak_memory

    recipe = session.recipe
    peaks = session.peaks
    seq_len = peaks.activation_seq_len or recipe.data.max_seq_len
    if seq_len != recipe.data.max_seq_len:
        # Rows are padded to the longest in the batch, not to max_seq_len: compare like with like.
        recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_seq_len": seq_len})})
    try:
        estimate = estimate_for_recipe(recipe, device=session.device.type)
    except LisaftError as e:  # e.g. an architecture the estimator does not model
        warn(f"memory estimate unavailable: {first_line(e)}")
        return
    dev_state, off_state = session.optimizers.state_bytes()
    if session.device.type == "cpu" and session.recipe.lisa.state_policy == "offload_cpu":
        # Offloaded moments sit in the CPU device's own memory, where the estimate counts them.
        dev_state += off_state
    peaks.state_bytes = max(peaks.state_bytes, dev_state)
    peak = peak_memory(session.device)
    if session.device.type == "cuda":
        # Paged optimizer state lives in unified memory, outside the allocator's counters.
        paged = peaks.state_bytes if optimizer_kind(session.recipe.optimizer.name).paged else 0
        assert peak.cuda_reserved_bytes is not None  # measured on CUDA
        peak_bytes = peak.cuda_reserved_bytes + paged
    else:
        peak_bytes = peak.rss_bytes
    measured = {
        "weights_bytes": session.parallel.weights_bytes(session.model),
        "grad_bytes": peaks.grad_bytes,
        "optimizer_state_bytes": peaks.state_bytes,
        "activation_bytes": peaks.activation_bytes,
        "peak_bytes": peak_bytes,
    }
    measured = session.parallel.held(measured, session.device)
    metrics.memory(estimate, measured)
    console = Console(highlight=False, soft_wrap=True)
    console.print(estimated_vs_measured_table(estimate, measured, session.parallel.host_rows(estimate)))
    console.print(f"(estimated for the run's longest batch, {recipe.training.batch_size} x {seq_len} tokens, "
                  f"where its activations were measured; data.max_seq_len is {session.recipe.data.max_seq_len})",
                  markup=False)


def out_of_memory(session: Session, step: int, base: Path | None) -> RunFailed:
    """What a user needs after an OOM: where the run stands and what to change."""
    recipe_file = session.run_dir / "recipe.yaml"
    if base is None:
        where = f"no checkpoint was written yet; start over with `lisaft train {recipe_file} --overwrite`"
    elif not session.recipe.model.gradient_checkpointing:
        where = (f"continue from {base.name} with checkpointing on: `lisaft resume {session.run_dir} "
                 "--set model.gradient_checkpointing=true`")
    else:
        where = (f"the newest checkpoint is {base.name}; other changes alter the run: start over with "
                 f"`lisaft train {recipe_file} --overwrite`")
    return RunFailed(
        f"out of memory in step {step + 1} on {session.device}; `lisaft estimate-memory {recipe_file}` "
        f"shows where the memory goes and what brings it under (gradient checkpointing, paged_adamw_8bit, "
        f"a smaller lisa.active_layers or data.max_seq_len); {where}")
