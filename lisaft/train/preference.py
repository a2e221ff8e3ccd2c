"""The reference pass of an objective with a reference (DPO, IPO, KTO): log-probs computed once
before step 1 and kept in every checkpoint.

The pass runs before the optimizer exists and without gradients: over the initial policy (the
model as loaded, before any update; with LoRA the adapters are still zero, so that is the base),
or over preference.reference, loaded for the pass (quantized as the policy's base under QLoRA)
and freed before the policy loads. What an
example's reference is (a pair's two sums, a feedback row's completion and KL sums) is the
objective's `score`; the pass stores it in each example (example["ref"]) and `ReferenceLogps`
saves it, tied to the data's digest: `lisaft resume` reads it back and never runs the pass again.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lisaft.config.schema import ModelSection, Recipe
from lisaft.data.digest import ACCEPT_KEY, DataChanged, examples_digest
from lisaft.data.order import eval_index_batches
from lisaft.distributed import dist
from lisaft.metrics.display import PassBar

if TYPE_CHECKING:
    from lisaft.train.parallel import Strategy

# An objective's reference of a batch of its examples: [examples, values] on the device.
Score = Callable[[torch.nn.Module, list[dict]], torch.Tensor]


class ReferenceLogps:
    """The checkpoint component `reference`: each train and eval example's reference values, with
    the digest of the examples they were computed for."""

    def __init__(self, train: list[dict], evals: list[dict] | None, unit: str = "pairs"):
        self.train, self.evals, self.unit = train, evals or [], unit
        self.digest = f"{examples_digest(self.train)}-{examples_digest(self.evals)}"

    def state_dict(self) -> dict:
        return {"digest": self.digest, "train": [p["ref"] for p in self.train],
                "eval": [p["ref"] for p in self.evals]}

    def load_state_dict(self, sd: dict) -> None:
        if sd["digest"] != self.digest:
            # Reference log-probs of other examples cannot serve, and the run's reference may be gone.
            raise DataChanged(f"data: the {self.unit} changed since the checkpoint (reference log-probs for digest "
                              f"{sd['digest']}, {self.unit} of {self.digest} now): the reference log-probs belong to "
                              f"the {self.unit} they were computed for, so this run cannot continue over other "
                              f"{self.unit}, not even with {ACCEPT_KEY}; start a new run")
        for examples, refs in ((self.train, sd["train"]), (self.evals, sd["eval"])):
            for p, ref in zip(examples, refs, strict=True):
                p["ref"] = [float(x) for x in ref]


def reference_section(recipe: Recipe, reference: str) -> ModelSection:
    """How the reference model loads: as the policy's model section says (its dtype, attention and,
    under QLoRA, its 4-bit quantization: an 8B reference is about 5 GiB in NF4, not 15 in bf16),
    from `reference`, with nothing a forward without gradients needs switched off."""
    return recipe.model.model_copy(update={
        "name_or_path": reference, "config": None, "gradient_checkpointing": False, "offload_activations": False})


def _reference_model(recipe: Recipe, reference: str, device: torch.device):
    from lisaft.model.load import load_model

    return load_model(reference_section(recipe, reference), device, seed=recipe.training.seed)


@torch.no_grad()
def reference_pass(model, examples: list[dict], score: Score, width: int, batch_size: int, parallel: Strategy,
                   device: torch.device, show: bool = True) -> None:
    """Each example's `width` reference values into example["ref"], the ranks sharing the batches."""
    batches = eval_index_batches(len(examples), batch_size)
    mine, counted = parallel.eval_batches(batches)
    sums = torch.zeros(len(examples), width, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with PassBar("reference log-probs", len(mine), enabled=show) as bar:
        for n, idx in enumerate(mine):
            values = score(model, [examples[i] for i in idx]).double().cpu()
            if n < counted:
                sums[idx] = values
            bar.advance()
    model.train(was_training)
    sums = dist.all_reduce_sum(sums.to(device)).cpu()
    for p, values in zip(examples, sums.tolist()):
        p["ref"] = values


def compute_reference(recipe: Recipe, reference: str | None, model, train: list[dict], evals: list[dict] | None,
                      score: Score, width: int, parallel: Strategy, device: torch.device) -> None:
    """The one reference pass over every train and eval example: with `model` (the initial policy)
    or, when `model` is None, with the model at `reference` loaded for it and freed after."""
    own = model is None
    if own:
        assert reference is not None, "a reference model of its own, or the policy"
        model = _reference_model(recipe, reference, device)
    for examples in (train, evals or []):
        reference_pass(model, examples, score, width, recipe.training.batch_size, parallel, device)
    if own:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
