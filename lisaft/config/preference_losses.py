"""The preference losses a recipe may name, and what each needs: the one place a loss is decoded.

Every other module asks `preference_loss(name)` and reads a property of its row rather than the
name's spelling (tests/unit/test_preference_loss_names.py holds lisaft/ to it), so a new loss of
a kind the table describes is one `Literal` member, one row, and its formula in model/.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

PreferenceLoss = Literal["dpo", "simpo", "orpo", "ipo", "kto"]
PREFERENCE_LOSSES: tuple[PreferenceLoss, ...] = get_args(PreferenceLoss)


# What each data.format a loss trains on holds, for messages.
DATA: dict[str, str] = {
    "preference": "pairs: set data.format: preference (rows of prompt, chosen, rejected)",
    "feedback": "unpaired feedback: set data.format: feedback (rows of prompt, completion, label)",
}


@dataclass(frozen=True)
class LossKind:
    data_format: Literal["preference", "feedback"]  # the data.format it trains on
    # The loss of a pair's score h (the log-ratio of chosen over rejected, model/preference.py):
    # sigmoid −log σ(βh − γ); squared (h − 1/(2β))²; odds_ratio ORPO's NLL plus β times its term.
    # prospect: KTO's value of each unpaired answer against the KL estimate (model/feedback.py).
    form: Literal["sigmoid", "squared", "odds_ratio", "prospect"]
    reference: bool                     # scores the policy against reference log-probs (computed once)
    beta: float                         # β when the recipe gives none ...
    beta_source: str                    # ... and where that default comes from
    per_token: bool                     # the answer's log-prob averaged over its tokens (else summed)
    keys: tuple[str, ...] = ()          # preference.* keys it reads besides loss, beta and reference

    @property
    def sequences(self) -> int:
        """Sequences one example puts through the training forward: a pair's two, an unpaired
        answer's one (KTO's KL sequence goes through a forward without gradients)."""
        return 2 if self.data_format == "preference" else 1


_KINDS: dict[str, LossKind] = {
    "dpo": LossKind("preference", "sigmoid", reference=True, beta=0.1, per_token=False,
                    beta_source="the DPO paper (Rafailov et al. 2023), TRL's DPOConfig"),
    "simpo": LossKind("preference", "sigmoid", reference=False, beta=2.0, per_token=True, keys=("gamma",),
                      beta_source="the SimPO paper (Meng et al. 2024) 2.0-2.5, torchtune's SimPOLoss"),
    "orpo": LossKind("preference", "odds_ratio", reference=False, beta=0.1, per_token=True,
                     beta_source="the ORPO paper (Hong et al. 2024) and TRL's ORPOConfig λ"),
    # Log-ratios averaged over the answer's tokens, as TRL's DPOTrainer does for IPO (a choice TRL
    # says it confirmed with the IPO authors; the paper writes sequence log-probs).
    "ipo": LossKind("preference", "squared", reference=True, beta=0.1, per_token=True,
                    beta_source="TRL's DPOConfig β, IPO's τ (the IPO paper, Azar et al. 2023)"),
    "kto": LossKind("feedback", "prospect", reference=True, beta=0.1, per_token=False,
                    keys=("desirable_weight", "undesirable_weight"),
                    beta_source="the KTO paper (Ethayarajh et al. 2024) and TRL's KTOConfig"),
}
assert set(_KINDS) == set(PREFERENCE_LOSSES), "every preference loss has one row"


def preference_loss(name: str) -> LossKind:
    """The properties of preference loss `name` (a KeyError for a name the schema would refuse)."""
    return _KINDS[name]


def losses_where(test: Callable[[LossKind], bool]) -> list[PreferenceLoss]:
    """The names whose row passes `test`, in the Literal's order: what a message offers instead."""
    return [n for n in PREFERENCE_LOSSES if test(_KINDS[n])]
