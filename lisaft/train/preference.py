"""What a preference run adds to the loop: DPO's reference log-probs, computed once before step 1
and kept in every checkpoint; the eval of pairs; and the step's reward figures.

The reference pass runs before the optimizer exists and without gradients: over the initial
policy (the model as loaded, before any update; with LoRA the adapters are still zero, so that
is the base), or over preference.reference, loaded for the pass and freed before the policy
loads. Its sums are stored in each pair (pair["ref"]) and saved by `ReferenceLogps`, tied to the
data's digest: `lisaft resume` reads them back and never runs the pass again.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from lisaft.config.schema import Recipe
from lisaft.data.digest import ACCEPT_KEY, DataChanged, examples_digest
from lisaft.data.order import eval_index_batches
from lisaft.distributed import dist
from lisaft.metrics.display import PassBar
from lisaft.model.preference import METRICS, PairObjective, collate_pairs, sequence_logps

if TYPE_CHECKING:
    from lisaft.train.parallel import Strategy


class ReferenceLogps:
    """The checkpoint component of DPO's reference log-probs: [chosen, rejected] per train and
    eval pair, with the digest of the pairs they were computed for."""

    def __init__(self, train: list[dict], evals: list[dict] | None):
        self.train, self.evals = train, evals or []
        self.digest = f"{examples_digest(self.train)}-{examples_digest(self.evals)}"

    def state_dict(self) -> dict:
        return {"digest": self.digest, "train": [p["ref"] for p in self.train],
                "eval": [p["ref"] for p in self.evals]}

    def load_state_dict(self, sd: dict) -> None:
        if sd["digest"] != self.digest:
            # Reference log-probs of other pairs cannot serve, and the run's reference may be gone.
            raise DataChanged(f"data: the pairs changed since the checkpoint (reference log-probs for digest "
                              f"{sd['digest']}, pairs of {self.digest} now): DPO's reference log-probs belong to "
                              "the pairs they were computed for, so this run cannot continue over other pairs, "
                              f"not even with {ACCEPT_KEY}; start a new run")
        for pairs, refs in ((self.train, sd["train"]), (self.evals, sd["eval"])):
            for p, ref in zip(pairs, refs, strict=True):
                p["ref"] = [float(ref[0]), float(ref[1])]


def _reference_model(recipe: Recipe, device: torch.device):
    assert recipe.preference is not None and recipe.preference.reference is not None
    from lisaft.model.load import load_model

    section = recipe.model.model_copy(update={
        "name_or_path": recipe.preference.reference, "config": None, "gradient_checkpointing": False,
        "offload_activations": False, "quantize": None})
    return load_model(section, device, seed=recipe.training.seed)


@torch.no_grad()
def reference_pass(model, pairs: list[dict], pad_id: int, batch_size: int, parallel: Strategy,
                   device: torch.device, show: bool = True) -> None:
    """Each pair's reference log-probs into pair["ref"], the ranks sharing the batches."""
    batches = eval_index_batches(len(pairs), batch_size)
    mine, counted = parallel.eval_batches(batches)
    sums = torch.zeros(len(pairs), 2, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with PassBar("reference log-probs", len(mine), enabled=show) as bar:
        for n, idx in enumerate(mine):
            batch = collate_pairs([pairs[i] for i in idx], pad_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            logps = sequence_logps(model, batch, parallel.sharded_forward)[0].view(2, len(idx)).t().double().cpu()
            if n < counted:
                sums[idx] = logps
            bar.advance()
    model.train(was_training)
    sums = dist.all_reduce_sum(sums.to(device)).cpu()
    for p, (c, r) in zip(pairs, sums.tolist()):
        p["ref"] = [c, r]


def compute_reference(recipe: Recipe, model, train: list[dict], evals: list[dict] | None, pad_id: int,
                      parallel: Strategy, device: torch.device) -> None:
    """DPO's one reference pass over every train and eval pair: with `model` (the initial policy)
    or, when `model` is None, with preference.reference loaded for it and freed after."""
    own = model is None
    if own:
        model = _reference_model(recipe, device)
    for pairs in (train, evals or []):
        reference_pass(model, pairs, pad_id, recipe.training.batch_size, parallel, device)
    if own:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


@torch.no_grad()
def evaluate_pairs(objective: PairObjective, model, pairs: list[dict], batches: list[list[int]],
                   counted: int, pad_id: int, device: torch.device) -> dict:
    """eval_loss (the preference loss), eval_reward_accuracy, eval_reward_ties and eval_reward_margin,
    mean over pairs."""
    totals = torch.zeros(1 + len(METRICS), dtype=torch.float64)
    pairs_seen = 0
    for n, idx in enumerate(batches):
        batch = {k: v.to(device) for k, v in collate_pairs([pairs[i] for i in idx], pad_id).items()}
        losses, sums = objective.losses(model, batch)
        if n < counted:
            totals += torch.cat([losses.double().sum()[None], sums]).cpu()
            pairs_seen += len(idx)
    totals = dist.all_reduce_sum(torch.cat([totals, torch.tensor([float(pairs_seen)], dtype=torch.float64)])
                                 .to(device)).cpu()
    n_pairs = max(totals[-1].item(), 1.0)
    named = dict(zip(METRICS, (totals[1:-1] / n_pairs).tolist()))
    return {"eval_loss": totals[0].item() / n_pairs, "eval_reward_accuracy": named["reward_accuracy"],
            "eval_reward_ties": named["reward_ties"], "eval_reward_margin": named["reward_margin"]}
