"""Unpaired feedback under KTO: each row's completion scored against the reference, the KL
estimate from mismatched sequences (a row's prompt with another row's completion), both
references computed once before step 1 (train/preference.py) and kept in every checkpoint.

Which completion a row's KL sequence takes is fixed with the data: the previous row's (the first
row takes the last's), TRL's rotation by one. TRL rotates within blocks of its per-device batch
and reads them in order, so a batch's KL sequences reuse that batch's completions; lisaft shuffles
rows as for every format, so a micro-batch's KL sequences take completions from elsewhere in the
data. Either way the estimate is the mean log-ratio of mismatched (prompt, completion) pairs, and
a fixed pairing is what lets the reference's side be computed once. The estimate is taken over
the step's global batch (every micro-batch of every rank: one forward without gradients over the
KL sequences before the first micro-batch, one all-reduce), where TRL takes it per micro-batch
over the ranks; with one micro-batch a step the two are the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lisaft.config.schema import Recipe
from lisaft.data.collate import IGNORE_INDEX, collate, real_positions, to_device
from lisaft.data.formats.preference import prompt_length
from lisaft.distributed import dist
from lisaft.model.feedback import SUMS, figures, kl_estimate, kto_losses
from lisaft.model.preference import sequence_logps
from lisaft.train.objectives.base import StepBatches
from lisaft.train.objectives.referenced import Referenced

if TYPE_CHECKING:
    from torch import nn

    from lisaft.train.parallel import Strategy


def attach_kl(rows: list[dict], max_seq_len: int) -> None:
    """Each row's KL sequence (row["kl"]): its own prompt, then the previous row's completion."""
    for i, row in enumerate(rows):
        other = rows[i - 1]
        p, q = prompt_length(row), prompt_length(other)
        row["kl"] = {"input_ids": (row["input_ids"][:p] + other["input_ids"][q:])[:max_seq_len],
                     "labels": ([IGNORE_INDEX] * p + other["labels"][q:])[:max_seq_len]}


class Feedback(Referenced):
    """data.format feedback under preference.loss kto."""

    unit = "feedback rows"

    def __init__(self, recipe: Recipe, strategy: Strategy, pad_id: int, device: torch.device) -> None:
        super().__init__(recipe, strategy, pad_id, device, uses_reference=True)
        self._sums: torch.Tensor | None = None
        self._kl = torch.zeros((), dtype=torch.float64)

    def describe(self) -> str:
        s = self.section
        return f"{s.loss} β={s.beta:g} weights {s.desirable_weight:g}/{s.undesirable_weight:g}; "

    def _logps(self, model: nn.Module, rows: list[dict]) -> torch.Tensor:
        """[rows, 2]: each row's summed log-probs of its completion and of its KL sequence."""
        batch = to_device(collate([*rows, *(r["kl"] for r in rows)], self.pad_id), self.device)
        return sequence_logps(model, batch, self.strategy.sharded_forward)[0].view(2, len(rows)).t()

    def before_model(self, train: list[dict], evals: list[dict] | None, resuming: bool) -> None:
        for rows in (train, evals or []):
            attach_kl(rows, self.recipe.data.max_seq_len)
        super().before_model(train, evals, resuming)

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def _kl_sums(self, model: nn.Module, rows: list[dict]) -> torch.Tensor:
        """[Σ(logp − ref) over the rows' KL sequences, their count], on the device."""
        batch = to_device(collate([r["kl"] for r in rows], self.pad_id), self.device)
        logps = sequence_logps(model, batch, self.strategy.sharded_forward)[0].double()
        ref = torch.tensor([r["ref"][1] for r in rows], dtype=torch.float64).to(self.device, non_blocking=True)
        return torch.stack([(logps - ref).sum(), torch.tensor(float(len(rows)), device=logps.device,
                                                                 dtype=torch.float64)])

    def _batch(self, rows: list[dict], kl: torch.Tensor) -> dict:
        batch = collate(rows, self.pad_id)
        batch["ref"] = torch.tensor([r["ref"][0] for r in rows], dtype=torch.float64)
        batch["desirable"] = torch.tensor([r["desirable"] for r in rows], dtype=torch.bool)
        batch["kl"] = kl
        return batch

    def step_batches(self, model: nn.Module, step: int, examples: list[list[dict]]) -> StepBatches:
        kl = kl_estimate(dist.all_reduce_sum(torch.stack([self._kl_sums(model, rows) for rows in examples]).sum(0)))
        self._kl = kl
        rows = sum(len(ex) for ex in examples)
        return StepBatches([self._batch(ex, kl) for ex in examples], torch.tensor(float(rows), dtype=torch.float64),
                           sum(real_positions(ex) for ex in examples))

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logps = sequence_logps(model, batch, self.strategy.sharded_forward)[0]
        losses, sums = kto_losses(self.section, logps, batch["ref"].to(logps.dtype), batch["kl"].to(logps.dtype),
                                  batch["desirable"])
        self._sums = sums if self._sums is None else self._sums + sums
        return losses.sum()

    def step_sums(self) -> dict[str, torch.Tensor]:
        sums = self._sums if self._sums is not None else torch.zeros(len(SUMS), dtype=torch.float64)
        self._sums = None
        # The KL estimate is global already: divided by the ranks it comes back whole from their sum.
        return {**dict(zip(SUMS, sums.to(self.device))), "kl": self._kl / dist.world_size()}

    def step_figures(self, read: dict[str, float]) -> dict[str, float]:
        return figures(read, read["kl"])

    # -- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: nn.Module, examples: list[dict], batches: list[list[int]], counted: int) -> dict:
        """eval_loss (KTO's, under the eval set's own KL estimate), eval_reward_accuracy,
        eval_reward_margin and eval_kl, over every eval row."""
        seen: list[tuple[torch.Tensor, list[dict]]] = []
        kl_sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for n, idx in enumerate(batches):
            if n < counted:
                rows = [examples[i] for i in idx]
                logps = self._logps(model, rows).double()
                ref = torch.tensor([r["ref"] for r in rows], dtype=torch.float64, device=logps.device)
                kl_sums += torch.stack([(logps[:, 1] - ref[:, 1]).sum(), torch.tensor(float(len(rows)),
                                                                                     device=logps.device,
                                                                                     dtype=torch.float64)])
                seen.append((logps[:, 0] - ref[:, 0], rows))
        kl = kl_estimate(dist.all_reduce_sum(kl_sums))
        totals = torch.zeros(1 + len(SUMS), dtype=torch.float64, device=self.device)
        for ratio, rows in seen:
            desirable = torch.tensor([r["desirable"] for r in rows], dtype=torch.bool, device=ratio.device)
            # The log-ratio alone decides the loss: a reference of zero makes logp the ratio.
            losses, sums = kto_losses(self.section, ratio, torch.zeros_like(ratio), kl, desirable)
            totals += torch.cat([losses.sum()[None], sums.to(totals.device)])
        totals = dist.all_reduce_sum(totals).cpu()
        named = dict(zip(SUMS, totals[1:].tolist()))
        got = figures(named, kl.item())
        return {"eval_loss": totals[0].item() / max(named["desirable"] + named["undesirable"], 1.0),
                "eval_reward_accuracy": got["reward_accuracy"], "eval_reward_margin": got["reward_margin"],
                "eval_kl": got["kl"]}
