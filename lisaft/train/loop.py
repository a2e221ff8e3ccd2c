"""The loop: steps, logging, evaluation, checkpoints, stopping on a signal, the final export."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lisaft.checkpoint.checkpointer import Checkpointer
from lisaft.distributed import dist
from lisaft.metrics.display import Display
from lisaft.metrics.log import RunLog
from lisaft.metrics.measure import memory_counters
from lisaft.run_folder import clean_write_failures, remove_temporaries
from lisaft.train import export, nonfinite, report
from lisaft.train.evaluate import evaluate
from lisaft.train.session import Session
from lisaft.train.step import StepResult, train_step
from lisaft.train.stop import StopRequest

_EMPTY_WINDOW = {"loss_sum": 0.0, "steps": 0, "tokens": 0, "padding": 0}


def _train_record(session: Session, result: StepResult, window: dict, elapsed: float) -> dict:
    dev_state, off_state = session.optimizers.state_bytes()
    session.peaks.state_bytes = max(session.peaks.state_bytes, dev_state)
    return {
        "step": session.progress.step,
        "loss": window["loss_sum"] / window["steps"],
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": window["tokens"] / max(elapsed, 1e-9),
        "padding_positions": window["padding"],
        "active_layers": session.controller.active_layers,
        "trainable_params": session.controller.trainable_params(),
        "grad_bytes": result.grad_bytes,
        "optimizer_state_bytes": dev_state,
        "offloaded_state_bytes": off_state,
        **memory_counters(session.device),
        **({"skipped_steps": session.progress.skipped_steps}
           if session.recipe.training.on_nonfinite == "skip" else {}),
        # The objective's own figures (rewards, ...), mean over the window's steps as the loss.
        **{k: v / window["steps"] for k, v in window.items() if k not in _EMPTY_WINDOW},
    }


def _add(window: dict, result: StepResult) -> None:
    window["loss_sum"] += result.loss
    window["steps"] += 1
    window["tokens"] += result.tokens
    window["padding"] += result.padding
    for k, v in result.figures.items():
        window[k] = window.get(k, 0.0) + v


def _record_peaks(session: Session, result: StepResult) -> None:
    peaks = session.peaks
    peaks.grad_bytes = max(peaks.grad_bytes, result.grad_bytes)
    if result.activation_bytes is not None:
        peaks.activation_bytes = result.activation_bytes
        peaks.activation_seq_len = result.activation_seq_len


def _save(session: Session, checkpointer: Checkpointer, base: Path | None) -> Path:
    # A failed write leaves the older checkpoints untouched; run()'s guard reports it.
    session.optimizers.wait()  # the weights read here are the last step's
    nonfinite.check_weights(session, session.progress.step, base)
    return checkpointer.save(session.progress.step, base)


def _evaluate(session: Session, metrics: RunLog, display: Display) -> None:
    rec = {"step": session.progress.step, **evaluate(session)}
    metrics.write(rec)
    display.eval(rec)


@clean_write_failures
def run(session: Session, base: Path | None, show: bool, stop_at: int | None,
        recipe_file: Path | None = None) -> int:
    """Train from session.progress to training.max_steps; returns the exit code. `base` is the
    checkpoint the run continues from (None for a new run); `stop_at` (tests) stops as a signal
    would after that many optimizer steps; `recipe_file` is the recipe a failure before the first
    checkpoint says to start over with (default: the run's own copy)."""
    t = session.recipe.training
    assert t.max_steps is not None  # build_session resolves training.epochs into it
    progress = session.progress
    checkpointer = session.checkpointer()
    if dist.is_main():
        remove_temporaries(session.run_dir)  # what a killed run left half written
    window = {**_EMPTY_WINDOW, **progress.window}
    window_t0 = time.perf_counter()
    dead = nonfinite.DeadRun(session)
    with StopRequest() as stop, Display(t.max_steps, progress.step, enabled=show) as display, \
            RunLog(session.run_dir, session.recipe, progress.step) as metrics:
        report.announce(session, display)
        if progress.step == 0 and session.eval_examples and t.eval_every:
            _evaluate(session, metrics, display)  # the untrained model's score: where the curve starts
        while progress.step < t.max_steps:
            step = progress.step
            logs = (step + 1) % t.log_every == 0 or step + 1 == t.max_steps
            try:
                # Measured again whenever a batch is longer than any before: the end-of-run table
                # compares the estimate with the run's largest shape, where its peak comes from.
                result = train_step(session, step, measure_norm=logs, measure_activations=True,
                                    longer_than=session.peaks.activation_seq_len)
            except torch.OutOfMemoryError:
                raise report.out_of_memory(session, step, base) from None
            nonfinite.check_step(session, step, result, base)
            dead.see(step, result)
            _record_peaks(session, result)
            progress.step += 1
            progress.tokens_seen += result.tokens
            _add(window, result)
            if logs:
                rec = _train_record(session, result, window, time.perf_counter() - window_t0)
                metrics.write(rec)
                display.train(rec if session.recipe.lisa.enabled else {**rec, "active_layers": None})  # `all`
                window, window_t0 = dict(_EMPTY_WINDOW), time.perf_counter()
            if session.eval_examples and (
                (t.eval_every and progress.step % t.eval_every == 0) or progress.step == t.max_steps
            ):
                _evaluate(session, metrics, display)
            stopping = dist.any_rank(stop.requested or (stop_at is not None and progress.step >= stop_at))
            if (t.save_every and progress.step % t.save_every == 0) or stopping or progress.step == t.max_steps:
                progress.window = window
                base = _save(session, checkpointer, base)
            if stopping and progress.step < t.max_steps:
                assert base is not None  # saved just above: a stop always checkpoints
                display.print(stop.message(progress.step, base.name, session.parallel.resume_command(session.run_dir),
                                           asked=stop_at is not None))
                return 128 + stop.signum if stop.signum else 3

        _finish(session, base, metrics, display, dead, show)
    return 0


def _finish(session: Session, base: Path | None, metrics: RunLog, display: Display, dead: nonfinite.DeadRun,
            show: bool) -> None:
    """The final export, of finite weights only, and what the run says as it ends."""
    session.optimizers.wait()
    nonfinite.check_weights(session, session.progress.step, base)
    export.save_final(session)
    if dist.is_main():
        nonfinite.say_skipped_tail(session)
    dead.at_end()
    if dist.is_main() and show:
        report.memory_report(session, metrics)
        display.print(f"done: {session.progress.step} steps; model saved to {session.run_dir / 'final'}")
