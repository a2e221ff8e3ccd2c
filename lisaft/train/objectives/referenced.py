"""What the preference stages share: a frozen reference's log-probs of every train and eval example,
computed in one pass before step 1 (train/preference.py) and kept in every checkpoint, so a resume
reads them back and never runs the pass again."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lisaft.config.schema import PreferenceSection, Recipe
from lisaft.train import preference as reference
from lisaft.train.objectives.base import Objective

if TYPE_CHECKING:
    import torch
    from torch import nn

    from lisaft.train.parallel import Strategy


class Referenced(Objective):
    """A stage of the preference section. `uses_reference`: whether its loss reads the reference
    (SimPO and ORPO do not, so they skip the pass and keep nothing)."""

    def __init__(self, recipe: Recipe, strategy: Strategy, pad_id: int, device: torch.device,
                 uses_reference: bool) -> None:
        super().__init__(strategy, pad_id, device)
        assert recipe.preference is not None  # objectives/__init__.py chose this stage for its section
        self.recipe = recipe
        self.section: PreferenceSection = recipe.preference
        self.reference = uses_reference
        self._kept: reference.ReferenceLogps | None = None

    def _logps(self, model: nn.Module, examples: list[dict]) -> torch.Tensor:
        """[examples, 2]: the two summed log-probs the stage keeps of each example."""
        raise NotImplementedError

    def _reference_pass(self, model: nn.Module | None, train: list[dict], evals: list[dict] | None) -> None:
        reference.compute_reference(self.recipe, self.section.reference, model, train, evals, self._logps, 2,
                                    self.strategy, self.device)

    def before_model(self, train: list[dict], evals: list[dict] | None, resuming: bool) -> None:
        if self.reference and not resuming and self.section.reference is not None:
            self._reference_pass(None, train, evals)  # loaded, used and freed before the policy loads

    def with_model(self, model: nn.Module, train: list[dict], evals: list[dict] | None, resuming: bool) -> None:
        if self.reference and not resuming and self.section.reference is None:
            self._reference_pass(model, train, evals)  # the initial policy

    def checkpoint_components(self, train: list[dict], evals: list[dict] | None) -> dict[str, Any]:
        if self.reference and self._kept is None:
            self._kept = reference.ReferenceLogps(train, evals, self.unit)
        return {"reference": self._kept} if self._kept is not None else {}
