"""What one training stage owns, so the trainer never asks which stage runs.

An objective turns the step's examples into micro-batches and what their loss is divided by,
computes each micro-batch's summed loss through the parallel strategy, keeps the step's own
figures (rewards, KL, ...) as device sums until the step reads them, scores the eval set, runs
any pass it needs before training (a reference's log-probs) and names the checkpoint components
that hold its state. The trainer (session.py, step.py, evaluate.py, loop.py, report.py) calls
these methods and nothing else; tests/unit/test_stages.py reads lisaft/train/ outside this
package for a stage check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

    from lisaft.train.parallel import Strategy


@dataclass
class StepBatches:
    """One step's micro-batches on this rank, as the objective built them."""

    batches: list[dict]              # collated micro-batches, each fed to `loss_sum` in order
    normaliser: torch.Tensor         # this rank's divisor of the summed loss (label tokens, pairs, rows);
                                     # the step sums it over ranks and divides every micro-batch's loss by it
    real_positions: int              # positions holding a token (padding not counted), for tokens/s


class Objective:
    """The base: what every objective does unless it says otherwise. A new stage is a subclass
    here and one line in `objectives/__init__.py` `choose`."""

    unit = "examples"                # what one training example is called in the banner
    sees_global_batch = False        # step_batches gets every rank's examples, not this rank's

    def __init__(self, strategy: Strategy, pad_id: int, device: torch.device) -> None:
        self.strategy = strategy     # the loss runs through it (sharded forward, eval batches)
        self.pad_id = pad_id
        self.device = device

    # -- set-up ---------------------------------------------------------------------------------

    def describe(self) -> str:
        """What the banner says of the stage after the method ("" for SFT)."""
        return ""

    def before_model(self, train: list[dict], evals: list[dict] | None, resuming: bool) -> None:
        """Before the policy loads: a pass with a model of the objective's own, loaded and freed
        here so the two are never resident together."""

    def with_model(self, model: nn.Module, train: list[dict], evals: list[dict] | None, resuming: bool) -> None:
        """The policy loaded, before the optimizer exists: a pass over the initial policy."""

    def checkpoint_components(self, train: list[dict], evals: list[dict] | None) -> dict[str, Any]:
        """The objective's pieces of a checkpoint, by name (train/session.py checkpoint_components)."""
        return {}

    # -- the step -------------------------------------------------------------------------------

    def step_batches(self, model: nn.Module, step: int, examples: list[list[dict]]) -> StepBatches:
        """The step's micro-batches from its examples (one list per micro-batch). The batch is
        made here, at step time, so an objective may run the model first (a KL estimate, or
        completions generated from prompts)."""
        raise NotImplementedError

    def loss_sum(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """A micro-batch's summed loss, on the device; the step divides it by the global normaliser."""
        raise NotImplementedError

    def step_sums(self) -> dict[str, torch.Tensor]:
        """The objective's own sums since the last call (on the device), summed over ranks with
        the loss when the step ends; `step_figures` turns them into record fields."""
        return {}

    def step_figures(self, read: dict[str, float]) -> dict[str, float]:
        """Train record fields from the step's global sums (`read` holds step_sums' names and
        `normaliser`); the loop averages each over the logging window's steps."""
        return {}

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self, model: nn.Module, examples: list[dict], batches: list[list[int]], counted: int) -> dict:
        """Eval record fields (eval_loss and the stage's own) over this rank's `batches` of
        `examples`, of which the first `counted` count; summed over ranks here (collective)."""
        raise NotImplementedError
