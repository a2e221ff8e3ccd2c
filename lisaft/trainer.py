"""The training loop: set up, step, evaluate, log, save, stop cleanly.

Everything the loop depends on is either in the recipe, a pure function of the step (learning
rate, LISA's active set), or saved in a checkpoint (weights, optimizer moments, data position,
RNG states), which is what makes `lisaft resume` continue the same run rather than a similar one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lisaft import checkpoint as ckpt_mod
from lisaft import dist
from lisaft.batches import IGNORE_INDEX as IGNORE
from lisaft.checkpoint import TrainState
from lisaft.errors import LisaftError, RunFailed
from lisaft.loggers import RunLog, check_backends
from lisaft.memory.measure import memory_counters
from lisaft.metrics import Display, MetricsLog
from lisaft.optim import clip_grad_norm
from lisaft.recipe import CADENCE_KEYS, Recipe, flatten, load_recipe, path_digest, recipe_from_dict
from lisaft.runfiles import (check_output_dir, clean_write_failures, clear_run, is_write_failure,
                             make_run_dir, remove_temporaries, write_atomic, write_failed, writes_end_cleanly)
from lisaft.schedules import Plan, lr_for


@dataclass
class Session:
    """Everything set up for a run; built identically by `train` and `resume`."""

    recipe: Recipe
    run_dir: Path
    device: torch.device
    tokenizer: object
    model: torch.nn.Module
    parts: object
    layers_path: str
    optimizers: object        # units.UnitOptimizers: one optimizer per training unit
    controller: object        # lisa.LisaController: which units train
    train_examples: list
    eval_examples: list | None
    order: object
    plan: Plan = None         # the LR curve (schedules.Plan)
    grad_bytes: int = 0       # gradient bytes before the last optimizer step
    grad_norm: float | None = None  # total gradient norm before clipping, last measured step
    peak_grad_bytes: int = 0
    peak_state_bytes: int = 0
    activation_bytes: int | None = None   # saved for backward, measured on the first micro-batch
    activation_seq_len: int = 0           # that micro-batch's padded length
    lr: float = 0.0           # learning rate of the last step


class StopRequest:
    """First SIGINT/SIGTERM: finish the optimizer step, checkpoint, exit. A second one aborts at
    once (default handlers are restored after the first)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:
                pass  # not the main thread: no signal handling
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        for sig in self._previous:
            signal.signal(sig, signal.SIG_DFL)
        print(f"\n{signal.Signals(signum).name} received: finishing the current step and saving a "
              "checkpoint (send it again to abort at once)", flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def requested(self) -> bool:
        return self.signum is not None


# ---------------------------------------------------------------------------------------------
# set-up


def build_session(recipe: Recipe, run_dir: Path, tokenizer=None, train_examples: list | None = None,
                  eval_examples: list | None = None) -> Session:
    """Load tokenizer, data and model and build optimizer and LISA controller. Raises
    LisaftError for anything the user can fix; writes nothing. Benchmarks pass their own
    tokenizer (anything with pad_token_id) and tokenized examples to skip loading."""
    from lisaft.batches import DataOrder, steps_for_epochs
    from lisaft.data import load_splits
    from lisaft.lisa import LisaController
    from lisaft.models import (check_context_length, compile_layers, decoder_layers_path, load_model,
                               load_tokenizer, model_parts, resolve_device, use_sparse_embedding_grad)
    from lisaft.units import UnitOptimizers, model_units

    t = recipe.training
    if recipe.optimizer.in_backward and dist.world_size() > 1:
        raise LisaftError("optimizer.in_backward cannot run data parallel: each update would run "
                          "before the gradient all-reduce; set it false")
    device = resolve_device(t.device)
    if tokenizer is None:
        tokenizer = load_tokenizer(recipe.model)
    if train_examples is None:
        train_examples, eval_examples = load_splits(recipe.data, tokenizer, t.seed)
    if t.max_steps is None:  # training.epochs: the run's length follows from the train set
        t.max_steps = steps_for_epochs(t.epochs, len(train_examples),
                                       t.batch_size * t.grad_accum_steps * dist.world_size())
    model = load_model(recipe.model, device, seed=t.seed)
    check_context_length(model.config, recipe.data.max_seq_len)
    use_sparse_embedding_grad(model, recipe.model.sparse_embedding_grad,
                              trains=not recipe.lisa.enabled or recipe.lisa.train_embeddings,
                              tokens_per_step=t.batch_size * t.grad_accum_steps * recipe.data.max_seq_len,
                              world_size=dist.world_size())
    layers_path = decoder_layers_path(model, recipe.model.layers_path)
    parts = model_parts(model, recipe.model.layers_path)
    if t.compile:
        compile_layers(parts.layers, device)
    if t.shard_optimizer_state and dist.world_size() > 1 and recipe.optimizer.in_backward:
        raise LisaftError("training.shard_optimizer_state needs optimizer.in_backward false")
    units = model_units(parts)
    # Sharded state: each unit's owner is its index modulo the world size, stable across LISA
    # intervals, and embeddings and head land on different ranks.
    optimizers = UnitOptimizers(units, recipe.optimizer, device,
                                offload_dir=run_dir / "lisa_offload" / f"rank-{dist.rank()}", seed=t.seed,
                                shard=t.shard_optimizer_state)
    controller = LisaController(units, optimizers, recipe.lisa, seed=t.seed)
    order = DataOrder(len(train_examples), t.batch_size, t.seed, dist.rank(), dist.world_size())
    return Session(recipe, run_dir, device, tokenizer, model, parts, layers_path, optimizers, controller,
                   train_examples, eval_examples, order, plan=Plan(horizon=t.max_steps))


def _in_process_group(fn):
    """Run a command inside the torchrun process group when launched by torchrun."""

    def wrapper(*args, **kwargs):
        joined = dist.init_from_env()
        try:
            return fn(*args, **kwargs)
        finally:
            if joined:
                dist.shutdown()

    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper


@_in_process_group
def train(recipe_path: str | Path, overrides: list[str] | None = None, overwrite: bool = False,
          show: bool = True, _stop_at: int | None = None, force: bool = False) -> int:
    """`lisaft train`: returns the process exit code. `_stop_at` (tests) stops as a signal would
    after that many optimizer steps."""
    recipe = load_recipe(recipe_path, overrides or [])
    check_backends(recipe.logging)
    run_dir = Path(recipe.training.output_dir)
    check_output_dir(run_dir, overwrite, force)
    session = build_session(recipe, run_dir)
    dist.barrier()  # every rank has checked output_dir before rank 0 writes into it
    if dist.is_main():
        with writes_end_cleanly(run_dir, recipe_file=Path(recipe_path)):
            if overwrite and run_dir.is_dir():
                # recipe.yaml is replaced atomically below: when that write fails, the recipe the
                # message says to start over with (often this very file) still exists.
                clear_run(run_dir, keep=("recipe.yaml",))
            make_run_dir(run_dir)
            write_atomic(run_dir / "recipe.yaml", recipe.to_yaml())
    dist.barrier()
    session.controller.activate_for_step(0)
    state = TrainState(recipe_digest=path_digest(recipe), world_size=dist.world_size())
    return _run(session, state, base=None, show=show, stop_at=_stop_at)


def _diff(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


@_in_process_group
def resume(run_dir: str | Path, max_steps: int | None = None, overrides: list[str] | None = None,
           show: bool = True, reschedule: bool = False, _stop_at: int | None = None) -> int:
    """`lisaft resume`: continue RUN_DIR from its newest complete checkpoint. A changed
    max_steps keeps the saved LR curve unless `reschedule` re-plans it from the current step."""
    run_dir = Path(run_dir).resolve()
    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise LisaftError(f"{run_dir}: not a lisaft run (no recipe.yaml)")
    overrides = list(overrides or [])
    if max_steps is not None:
        overrides.append(f"training.max_steps={max_steps}")
    # The run lives where it is now, even if the folder was moved since.
    overrides.append(f"training.output_dir={run_dir}")
    recipe = load_recipe(recipe_file, overrides)
    check_backends(recipe.logging)
    warn = lambda m: print(f"warning: {m}", flush=True)  # noqa: E731
    candidates = ckpt_mod.complete_checkpoints(run_dir, warn=warn)
    if not candidates:
        raise LisaftError(f"{run_dir}: no complete checkpoint to resume from; start over with "
                          f"`lisaft train {recipe_file} --overwrite`")
    ckpt = candidates[0]
    saved = recipe_from_dict(json.loads((ckpt / "recipe.json").read_text()), f"{ckpt}/recipe.json")
    saved_flat = flatten(saved.model_dump(mode="json"))
    new_flat = flatten(recipe.model_dump(mode="json"))
    saved_flat["training.output_dir"] = new_flat["training.output_dir"]
    changed = _diff(saved_flat, new_flat)
    refused = [k for k in changed if k not in CADENCE_KEYS]
    if refused:
        k = refused[0]
        raise LisaftError(f"{k}: cannot change on resume (it alters the training path): checkpoint "
                          f"has {saved_flat.get(k)!r}, now {new_flat.get(k)!r}")
    state_preview = json.loads((ckpt / "state.json").read_text())
    if state_preview.get("world_size", 1) != dist.world_size():
        raise LisaftError(f"{ckpt.name} was written by {state_preview.get('world_size', 1)} processes; "
                          f"resume with the same number (now {dist.world_size()})")
    if state_preview["step"] >= recipe.training.max_steps:
        raise LisaftError(f"{run_dir}: the run is complete at step {state_preview['step']}; pass "
                          "--max-steps N to train further")
    session = build_session(recipe, run_dir)
    ckpt, state = _load_newest(session, candidates, recipe_file, warn)
    schedule_note = _continue_schedule(session, state, reschedule)
    with writes_end_cleanly(run_dir):
        dropped = MetricsLog(run_dir / "metrics.jsonl").truncate_after(state.step)
        if dist.is_main():
            write_atomic(recipe_file, recipe.to_yaml())
    if dist.is_main():
        msg = f"resuming {run_dir} from {ckpt.name} (step {state.step})"
        if changed:
            msg += "; changed: " + ", ".join(f"{k} {saved_flat.get(k)!r} -> {new_flat.get(k)!r}" for k in changed)
        if schedule_note:
            msg += "; " + schedule_note
        if dropped:
            msg += f"; dropped {dropped} metrics records logged after that checkpoint"
        print(msg, flush=True)
    return _run(session, state, base=ckpt, show=show, stop_at=_stop_at)


def _load_newest(session: Session, candidates: list[Path], recipe_file: Path, warn) -> tuple[Path, TrainState]:
    """Load the newest of `candidates` that loads; a checkpoint that passed the size check but
    does not load is skipped. A failed write while loading (optimizer state offloaded to disk)
    says nothing against the checkpoint: it ends the resume with the one write-failure message."""
    for i, ckpt in enumerate(candidates):
        try:
            return ckpt, _load_into(session, ckpt)
        except Exception as e:
            if is_write_failure(e) and not _names_a_file_in(e, ckpt):
                raise write_failed(session.run_dir, e) from None
            if i + 1 == len(candidates):
                raise LisaftError(f"{ckpt}: cannot be loaded ({e}); no older complete checkpoint; start "
                                  f"over with `lisaft train {recipe_file} --overwrite`") from None
            warn(f"skipping checkpoint {ckpt.name}: cannot be loaded ({e})")


def _names_a_file_in(e: BaseException, folder: Path) -> bool:
    # Reading a checkpoint can fail with an errno that also fails writes (EACCES, EIO); that
    # error names the checkpoint's file, and the checkpoint is the one to skip.
    filename = getattr(e, "filename", None)
    return bool(filename) and Path(folder) in Path(filename).parents


def _load_into(session: Session, ckpt: Path) -> TrainState:
    """Weights, RNG, LISA position, unit optimizers and data order of `ckpt`."""
    state = ckpt_mod.load_checkpoint(ckpt, session.model)
    if not state.lisa or not state.schedule:
        raise LisaftError(f"{ckpt.name} was written by an older lisaft (one optimizer for the whole "
                          "model); it cannot be resumed by this version (docs/resume.md)")
    session.controller.load_state_dict(state.lisa)
    session.optimizers.load_checkpoint(ckpt / "optimizer", session.controller.resident_units(),
                                       session.recipe.lisa.state_policy)
    session.order.load_state_dict(state.data)
    return state


def _continue_schedule(session: Session, state: TrainState, reschedule: bool) -> str:
    """Set the LR curve of a resumed run; say what happens to it when max_steps changed."""
    saved = Plan(**state.schedule)
    r = session.recipe
    max_steps = r.training.max_steps
    if reschedule:
        lr_now = _lr(session, state.step, saved)
        session.plan = Plan(horizon=max_steps, start_step=state.step, start_lr=lr_now)
        return (f"learning rate re-planned: from {lr_now:.3g} at step {state.step} to "
                f"{r.optimizer.lr * r.scheduler.min_lr_ratio:.3g} at step {max_steps}")
    session.plan = saved
    if max_steps == saved.horizon:
        return ""
    if max_steps > saved.horizon:
        return (f"learning rate continues on the saved curve, which ends at step {saved.horizon}; past it "
                f"it stays at its floor (pass --reschedule to re-plan the decay to step {max_steps})")
    return (f"learning rate continues on the saved curve planned for {saved.horizon} steps and stops at "
            f"step {max_steps} without reaching its end (pass --reschedule to re-plan the decay)")


def _lr(session: Session, step: int, plan: Plan) -> float:
    r = session.recipe
    return lr_for(step, plan, peak_lr=r.optimizer.lr, name=r.scheduler.name,
                  warmup_steps=r.scheduler.warmup_steps, min_lr_ratio=r.scheduler.min_lr_ratio)


# ---------------------------------------------------------------------------------------------
# the loop


def _forward_loss(model, batch: dict) -> torch.Tensor:
    from lisaft.loss import token_loss_sum

    return token_loss_sum(model, batch)


@torch.no_grad()
def evaluate(session: Session) -> dict:
    """eval_loss and teacher-forced argmax accuracy on response tokens, over ranks."""
    from lisaft.batches import collate, eval_index_batches
    from lisaft.loss import eval_sums

    examples = session.eval_examples
    t = session.recipe.training
    batches = eval_index_batches(len(examples), t.batch_size)
    if t.eval_batches is not None:
        batches = batches[: t.eval_batches]
    batches = batches[dist.rank():: dist.world_size()]
    model = session.model
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    for idx in batches:
        batch = collate([examples[i] for i in idx], session.tokenizer.pad_token_id)
        batch = {k: v.to(session.device) for k, v in batch.items()}
        loss_sum, n_tokens, n_correct = eval_sums(model, batch)
        totals += torch.tensor([loss_sum, n_tokens, n_correct], dtype=torch.float64)
    model.train()
    totals = dist.all_reduce_sum(totals.to(session.device)).cpu()
    n = max(totals[1].item(), 1.0)
    return {"eval_loss": totals[0].item() / n, "eval_token_accuracy": totals[2].item() / n}


def train_step(session: Session, step: int, measure_norm: bool = True) -> tuple[float, int]:
    """One optimizer step over grad_accum_steps micro-batches. Returns (mean token loss, global
    tokens processed). measure_norm: compute session.grad_norm even when nothing clips."""
    from lisaft.batches import collate

    t = session.recipe.training
    controller, optimizers = session.controller, session.optimizers
    controller.activate_for_step(step)
    micro = []
    for _ in range(t.grad_accum_steps):
        idx = session.order.next_indices()
        micro.append(collate([session.train_examples[i] for i in idx], session.tokenizer.pad_token_id))
    counts = torch.tensor([sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in micro),
                           sum(int(b["attention_mask"].sum()) for b in micro)], dtype=torch.float64)
    counts = dist.all_reduce_sum(counts.to(session.device)).cpu()
    loss_tokens = max(counts[0].item(), 1.0)
    # The learning rate is set before backward: with optimizer.in_backward the update runs there.
    session.lr = _lr(session, step, session.plan)
    optimizers.set_lr(session.lr, step)
    in_backward = session.recipe.optimizer.in_backward
    if in_backward and measure_norm:
        optimizers.grad_sq = torch.zeros((), dtype=torch.float32, device=session.device)
    loss_sum = 0.0
    for batch in micro:
        batch = {k: v.to(session.device, non_blocking=True) for k, v in batch.items()}
        if session.activation_bytes is None:
            # Once per process: what the forward keeps for backward, for the estimate-vs-measured
            # table at the end. The hooks only observe; the numbers are unchanged.
            from lisaft.memory.measure import saved_activations

            with saved_activations(session.model) as meter:
                loss = _forward_loss(session.model, batch)
            session.activation_bytes = meter.bytes
            session.activation_seq_len = int(batch["input_ids"].shape[1])
        else:
            loss = _forward_loss(session.model, batch)
        (loss / loss_tokens).backward()
        loss_sum += loss.item()
    if in_backward:
        session.grad_norm = optimizers.grad_sq.sqrt().item() if optimizers.grad_sq is not None else None
        optimizers.grad_sq = None
    else:
        _clip_and_step(session, measure_norm)
    loss_total = dist.all_reduce_sum(torch.tensor([loss_sum], dtype=torch.float64, device=session.device)).item()
    return loss_total / loss_tokens, int(counts[1].item())


def _clip_and_step(session: Session, measure_norm: bool) -> None:
    trainable = session.controller.trainable_parameters()
    for p in trainable:
        if p.grad is not None and p.grad.is_sparse:
            # Sum the rows of repeated tokens once; the norm and the update read the values.
            p.grad = p.grad.coalesce()
    dist.all_reduce_grads(trainable)
    session.grad_bytes = session.controller.grad_bytes()
    session.peak_grad_bytes = max(session.peak_grad_bytes, session.grad_bytes)
    max_norm = session.recipe.training.max_grad_norm
    if max_norm is not None or measure_norm:
        session.grad_norm = clip_grad_norm(trainable, max_norm)
    session.optimizers.step(session.controller.trainable_units())


def _save(session: Session, state: TrainState, base: Path | None, changed: set[str] | None) -> Path:
    state.data = session.order.state_dict()
    state.lisa = session.controller.state_dict()
    state.schedule = asdict(session.plan)
    # A failed write leaves the older checkpoints untouched; _run's guard reports it.
    written = ckpt_mod.save_checkpoint(
        session.run_dir, state, session.model, session.layers_path, session.parts.head,
        session.optimizers.write_checkpoint, changed, base, session.recipe.training.keep_last,
        extra_files={"recipe.json": json.dumps(session.recipe.model_dump(mode="json"), indent=1)},
    )
    session.optimizers.saved()
    return written


@clean_write_failures
def _run(session: Session, state: TrainState, base: Path | None, show: bool, stop_at: int | None) -> int:
    t = session.recipe.training
    changed: set[str] = set()
    if dist.is_main():
        remove_temporaries(session.run_dir)  # what a killed run left half written
    window = state.window or {"loss_sum": 0.0, "steps": 0, "tokens": 0}
    window_t0 = time.perf_counter()
    with StopRequest() as stop, Display(t.max_steps, state.step, enabled=show) as display, \
            RunLog(session.run_dir, session.recipe, state.step) as metrics:
        _announce(session, display, state)
        if state.step == 0 and session.eval_examples and t.eval_every:
            # The untrained model's score: where the curve starts.
            rec = {"step": 0, **evaluate(session)}
            metrics.write(rec)
            display.eval(rec)
        while state.step < t.max_steps:
            step = state.step
            logs = (step + 1) % t.log_every == 0 or step + 1 == t.max_steps
            try:
                loss, tokens = train_step(session, step, measure_norm=logs)
            except torch.OutOfMemoryError:
                raise _out_of_memory(session, step, base) from None
            changed |= {u.name for u in session.controller.trainable_units()}
            state.step += 1
            state.tokens_seen += tokens
            window["loss_sum"] += loss
            window["steps"] += 1
            window["tokens"] += tokens
            if logs:
                elapsed = max(time.perf_counter() - window_t0, 1e-9)
                dev_state, off_state = session.optimizers.state_bytes()
                session.peak_state_bytes = max(session.peak_state_bytes, dev_state)
                rec = {
                    "step": state.step,
                    "loss": window["loss_sum"] / window["steps"],
                    "lr": session.lr,
                    "grad_norm": session.grad_norm,
                    "tokens_per_s": window["tokens"] / elapsed,
                    "active_layers": session.controller.active_layers,
                    "trainable_params": session.controller.trainable_params(),
                    "grad_bytes": session.grad_bytes,
                    "optimizer_state_bytes": dev_state,
                    "offloaded_state_bytes": off_state,
                    **memory_counters(session.device),
                }
                metrics.write(rec)
                display.train(rec)
                window = {"loss_sum": 0.0, "steps": 0, "tokens": 0}
                window_t0 = time.perf_counter()
            if session.eval_examples and (
                (t.eval_every and state.step % t.eval_every == 0) or state.step == t.max_steps
            ):
                rec = {"step": state.step, **evaluate(session)}
                metrics.write(rec)
                display.eval(rec)
            stopping = dist.any_rank(stop.requested or (stop_at is not None and state.step >= stop_at))
            if (t.save_every and state.step % t.save_every == 0) or stopping or state.step == t.max_steps:
                state.window = window
                base = _save(session, state, base, changed)
                changed = set()
            if stopping and state.step < t.max_steps:
                why = signal.Signals(stop.signum).name if stop.signum else "stop requested"
                if stop.signum is None and stop_at is None:
                    why = "another rank was stopped"
                display.print(f"stopped ({why}) at step {state.step}; checkpoint {base.name} written. "
                              f"Continue with: lisaft resume {session.run_dir}")
                return 128 + stop.signum if stop.signum else 3

        _save_final(session)
        if dist.is_main() and show:
            _memory_report(session, metrics)
            display.print(f"done: {state.step} steps; model saved to {session.run_dir / 'final'}")
    return 0


def _memory_report(session: Session, metrics: RunLog) -> None:
    """The run's own memory, measured, beside what `lisaft estimate-memory` predicts for it."""
    from rich.console import Console

    from lisaft.memory.command import estimate_for_recipe
    from lisaft.memory.measure import peak_memory
    from lisaft.memory.render import estimated_vs_measured_table

    recipe = session.recipe
    seq_len = session.activation_seq_len or recipe.data.max_seq_len
    if seq_len != recipe.data.max_seq_len:
        # Rows are padded to the longest in the batch, not to max_seq_len: compare like with like.
        recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_seq_len": seq_len})})
    try:
        estimate = estimate_for_recipe(recipe, device=session.device.type)
    except LisaftError as e:  # e.g. an architecture the estimator does not model
        print(f"memory estimate unavailable: {e}")
        return
    dev_state, off_state = session.optimizers.state_bytes()
    if session.device.type == "cpu" and session.recipe.lisa.state_policy == "offload_cpu":
        # Offloaded moments sit in the CPU device's own memory, where the estimate counts them.
        dev_state += off_state
    session.peak_state_bytes = max(session.peak_state_bytes, dev_state)
    peak = peak_memory(session.device)
    if session.device.type == "cuda":
        # Paged optimizer state lives in unified memory, outside the allocator's counters.
        paged = session.peak_state_bytes if "paged" in session.recipe.optimizer.name else 0
        peak_bytes = peak.cuda_reserved_bytes + paged
    else:
        peak_bytes = peak.rss_bytes
    measured = {
        "weights_bytes": sum(p.numel() * p.element_size() for p in session.model.parameters()),
        "grad_bytes": session.peak_grad_bytes,
        "optimizer_state_bytes": session.peak_state_bytes,
        "activation_bytes": session.activation_bytes,
        "peak_bytes": peak_bytes,
    }
    metrics.memory(estimate, measured)
    console = Console(highlight=False, soft_wrap=True)
    console.print(estimated_vs_measured_table(estimate, measured))
    console.print(f"(estimated for batches of {recipe.training.batch_size} x {seq_len} tokens, the shape "
                  f"measured; data.max_seq_len is {session.recipe.data.max_seq_len})", markup=False)


def _out_of_memory(session: Session, step: int, base: Path | None) -> RunFailed:
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


def _announce(session: Session, display: Display, state: TrainState) -> None:
    r = session.recipe
    n_params = sum(p.numel() for p in session.model.parameters())
    lisa = (f"LISA γ={r.lisa.active_layers} of {len(session.parts.layers)} layers every "
            f"{r.lisa.interval_steps} steps, state {r.lisa.state_policy}" if r.lisa.enabled else "full fine-tuning")
    display.print(
        f"lisaft: {n_params / 1e6:.1f}M parameters on {session.device}, {r.model.dtype}, "
        f"{lisa}, {r.optimizer.name}{' in backward' if r.optimizer.in_backward else ''}; "
        f"{len(session.train_examples)} train examples"
        + (f", {len(session.eval_examples)} eval" if session.eval_examples else "")
        + f"; steps {state.step}->{r.training.max_steps}; run {session.run_dir}"
    )


def _save_final(session: Session) -> None:
    if not dist.is_main():
        dist.barrier()
        return
    final = session.run_dir / "final"
    tmp = session.run_dir / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    session.model.save_pretrained(tmp, safe_serialization=True)
    session.tokenizer.save_pretrained(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    dist.barrier()

