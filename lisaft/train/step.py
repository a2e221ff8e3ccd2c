"""One optimizer step over grad_accum_steps micro-batches, and what it measured."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lisaft.data.collate import IGNORE_INDEX, collate, real_positions, to_device
from lisaft.distributed import dist
from lisaft.metrics.phases import Phases
from lisaft.model.attention import varlen_attention
from lisaft.model.preference import collate_pairs, pair_positions
from lisaft.train.preference import step_metrics
from lisaft.train.session import Session


@dataclass(frozen=True)
class StepResult:
    """Every figure one optimizer step measured."""

    loss: float                       # mean token loss over the global batch
    tokens: int                       # global real tokens processed (padding not counted)
    padding: int                      # global positions computed on padding
    lr: float                         # the learning rate the step used
    grad_norm: float | None           # total gradient norm before clipping (None: not measured)
    grad_bytes: int                   # gradient bytes held before the optimizer step
    activation_bytes: int | None = None  # saved for backward by the longest micro-batch, when measured
    activation_seq_len: int = 0          # that micro-batch's padded length
    skipped: bool = False                # training.on_nonfinite: skip dropped a non-finite update
    preference: dict[str, float] | None = None  # a preference run: the rewards, mean over the step's pairs


_NO_PHASES = Phases()


def _micro_batches(session: Session) -> tuple[list[dict], torch.Tensor]:
    """The step's micro-batches and this rank's counts: what the loss is normalised by (label
    tokens, or a preference run's pairs), real positions, positions."""
    micro, real = [], 0
    pairs = session.objective is not None
    # With a varlen attention kernel a micro-batch is one row of documents, no padding at all.
    flatten = varlen_attention(session.model)
    for _ in range(session.recipe.training.grad_accum_steps):
        examples = [session.train_examples[i] for i in session.order.next_indices()]
        if pairs:
            micro.append(collate_pairs(examples, session.tokenizer.pad_token_id))
            real += pair_positions(examples)
        else:
            micro.append(collate(examples, session.tokenizer.pad_token_id, flatten))
            real += real_positions(examples)
    normaliser = sum(b["labels"].shape[0] // 2 if pairs else int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
                     for b in micro)
    return micro, torch.tensor([normaliser, real, sum(b["input_ids"].numel() for b in micro)], dtype=torch.float64)


def train_step(session: Session, step: int, measure_norm: bool = True, measure_activations: bool = False,
               phases: Phases = _NO_PHASES, forward: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None,
               longer_than: int = 0) -> StepResult:
    """One optimizer step. measure_norm: the gradient norm even when nothing clips;
    measure_activations: what the step's longest micro-batch saves for backward, if it is longer
    than `longer_than` positions (the hooks only observe); `forward`: a benchmark's own loss."""
    forward = forward or session.parallel.token_loss
    t = session.recipe.training
    controller = session.controller
    with phases.phase("lisa"):
        controller.activate_for_step(step)
    with phases.phase("collate"):
        micro, counts = _micro_batches(session)
    counts = dist.all_reduce_sum(counts.to(session.device)).cpu()
    loss_tokens = max(counts[0].item(), 1.0)
    pairs = session.objective  # a preference run: pair losses, normalised by the global number of pairs
    if pairs is not None:
        forward = pairs.loss_sum
    # The learning rate is set before backward: with optimizer.in_backward the update runs there.
    lr = session.schedule.lr(step)
    session.optimizers.set_lr(lr, step)
    activation_bytes, activation_seq_len = None, 0
    widths = [int(b["input_ids"].shape[1]) for b in micro]
    measured = widths.index(max(widths)) if measure_activations and max(widths) > longer_than else None
    loss_sum = 0.0
    in_backward = session.in_backward.step(measure_norm) if session.in_backward else contextlib.nullcontext()
    with in_backward as norm:
        for i, batch in enumerate(micro):
            batch = to_device(batch, session.device)
            with phases.phase("forward"):
                if i == measured and session.parallel.measures_activations:
                    from lisaft.metrics.measure import saved_activations

                    with saved_activations(session.model) as meter:
                        loss = forward(session.model, batch)
                    activation_bytes = meter.bytes
                    activation_seq_len = int(batch["input_ids"].shape[1])
                else:
                    loss = forward(session.model, batch)
            if i == len(micro) - 1:
                session.parallel.before_last_backward(controller, measure_norm)
            with phases.phase("backward"):
                (loss / loss_tokens).backward()
            loss_sum += loss.item()
    if norm is not None:
        grad_norm, grad_bytes, skipped = norm.value, 0, False
    else:
        grad_norm, grad_bytes, skipped = session.parallel.update(
            session.controller, session.optimizers, t.max_grad_norm, measure_norm, phases,
            skip_nonfinite=t.on_nonfinite == "skip")
    loss_total = dist.all_reduce_sum(torch.tensor([loss_sum], dtype=torch.float64, device=session.device)).item()
    return StepResult(loss=loss_total / loss_tokens, tokens=int(counts[1].item()),
                      padding=int(counts[2].item() - counts[1].item()), lr=lr, grad_norm=grad_norm,
                      grad_bytes=grad_bytes, activation_bytes=activation_bytes,
                      activation_seq_len=activation_seq_len, skipped=skipped,
                      preference=step_metrics(pairs, loss_tokens, session.device) if pairs is not None else None)
