"""One optimizer step over grad_accum_steps micro-batches, and what it measured."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lisaft.data.collate import to_device
from lisaft.distributed import dist
from lisaft.metrics.phases import Phases
from lisaft.train.objectives import StepBatches
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
    figures: dict[str, float] = field(default_factory=dict)  # the objective's own (rewards, ...): step_figures


_NO_PHASES = Phases()


class StepTotals:
    """The step's sums on the training device, read by the host once, when the step ends: a read
    after every micro-batch would leave the device idle until the host queued the next forward
    (torchtitan reads its loss only when it logs). The loss is one sum; an objective adds its own
    statistics the same way (`add`); the token counts and the gradient norm join them at `read`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        # float64, as the host summed the loss before: the same sum bit for bit.
        v = value.detach().to(self.device, torch.float64, non_blocking=True)
        self.sums[name] = self.sums[name] + v if name in self.sums else v

    def read(self, known: dict[str, torch.Tensor | float | None]) -> dict[str, float]:
        """The sums over ranks and `known` (global already; None stays None) on the host, in one read."""
        names = list(self.sums)
        values = [dist.all_reduce_sum(torch.stack([self.sums[n] for n in names]))]
        values += [torch.as_tensor(v).detach().to(self.device, torch.float64, non_blocking=True).reshape(1)
                   for v in known.values() if v is not None]
        host = iter(torch.cat(values).tolist())  # the step's one host read
        out = {n: next(host) for n in names}
        out.update({k: next(host) for k, v in known.items() if v is not None})
        return out


def _micro_batches(session: Session, step: int) -> tuple[StepBatches, torch.Tensor]:
    """The step's micro-batches, as the objective makes them from the data order's examples, and
    this rank's counts: what the loss is normalised by, real positions, positions."""
    examples = [[session.train_examples[i] for i in session.order.next_indices()]
                for _ in range(session.recipe.training.grad_accum_steps)]
    made = session.objective.step_batches(session.model, step, examples)
    positions = sum(b["input_ids"].numel() for b in made.batches)
    counts = [torch.as_tensor(x, dtype=torch.float64) for x in (made.normaliser, made.real_positions, positions)]
    return made, torch.stack(counts)


def _measured_forward(model: torch.nn.Module, batch: dict, forward) -> tuple[torch.Tensor, int]:
    """The forward, and the bytes it saved for backward."""
    from lisaft.metrics.measure import saved_activations

    with saved_activations(model) as meter:
        loss = forward(model, batch)
    return loss, meter.bytes


def train_step(session: Session, step: int, measure_norm: bool = True, measure_activations: bool = False,
               phases: Phases = _NO_PHASES, forward: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None,
               longer_than: int = 0) -> StepResult:
    """One optimizer step. measure_norm: the gradient norm even when nothing clips;
    measure_activations: what the step's longest micro-batch saves for backward, if it is longer
    than `longer_than` positions (the hooks only observe); `forward`: a benchmark's own loss. The
    host reads the device once, at the end (with training.on_nonfinite: skip, the norm once more
    before the update)."""
    objective = session.objective
    forward = forward or objective.loss_sum
    t = session.recipe.training
    controller = session.controller
    with phases.phase("lisa"):
        controller.activate_for_step(step)
    with phases.phase("collate"):
        made, counts = _micro_batches(session, step)
    micro = made.batches
    counts = dist.all_reduce_sum(counts.to(session.device, non_blocking=True))
    loss_tokens = counts[0].clamp(min=1.0)  # on the device: the loss is divided there
    # The learning rate is set before backward: with optimizer.in_backward the update runs there.
    lr = session.schedule.lr(step)
    session.optimizers.set_lr(lr, step)
    activation_bytes, activation_seq_len = None, 0
    widths = [int(b["input_ids"].shape[1]) for b in micro]
    measured = widths.index(max(widths)) if measure_activations and max(widths) > longer_than else None
    totals = StepTotals(session.device)
    in_backward = session.in_backward.step(measure_norm) if session.in_backward else contextlib.nullcontext()
    with in_backward as norm:
        for i, batch in enumerate(micro):
            batch = to_device(batch, session.device)
            with phases.phase("forward"):
                if i == measured and session.parallel.measures_activations:
                    loss, activation_bytes = _measured_forward(session.model, batch, forward)
                    activation_seq_len = int(batch["input_ids"].shape[1])
                else:
                    loss = forward(session.model, batch)
            if i == len(micro) - 1:
                session.parallel.before_last_backward(controller, measure_norm)
            with phases.phase("backward"):
                (loss / loss_tokens.to(loss.dtype)).backward()
            totals.add("loss", loss)
    for name, value in objective.step_sums().items():  # the objective's own sums, read with the rest
        totals.add(name, value)
    skipped = False
    grad_norm: torch.Tensor | float | None
    if norm is not None:
        grad_norm, grad_bytes = norm.value, 0
    else:
        grad_norm, grad_bytes, skipped = session.parallel.update(
            session.controller, session.optimizers, t.max_grad_norm, measure_norm, phases,
            skip_nonfinite=t.on_nonfinite == "skip")
    read = totals.read({"normaliser": counts[0], "tokens": counts[1], "positions": counts[2], "grad_norm": grad_norm})
    return StepResult(loss=read["loss"] / max(read["normaliser"], 1.0), tokens=int(read["tokens"]),
                      padding=int(read["positions"] - read["tokens"]), lr=lr, grad_norm=read.get("grad_norm"),
                      grad_bytes=grad_bytes, activation_bytes=activation_bytes,
                      activation_seq_len=activation_seq_len, skipped=skipped, figures=objective.step_figures(read))
