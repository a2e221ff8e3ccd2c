"""The estimator for apollo and apollo_mini: state as the optimizer allocates it, the shipped 8B
recipe, and the advice that proposes it when full fine-tuning does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny import tiny
from test_lisa import run

from lisaft.config.schema import LisaSection, OptimizerSection, load_recipe
from lisaft.lisa import LisaController
from lisaft.memory.advice import advice
from lisaft.memory.command import settings_from_recipe
from lisaft.memory.estimate import GiB, compute
from lisaft.memory.settings import settings_for_config
from lisaft.model.parts import model_parts
from lisaft.model.units import model_units
from lisaft.optim.unit_optimizers import UnitOptimizers

REPO = Path(__file__).parents[2]


@pytest.mark.parametrize("name,rank", [("apollo", 4), ("apollo", None), ("apollo_mini", None)])
@pytest.mark.parametrize("lisa", [False, True])
def test_state_is_what_the_optimizer_holds(tmp_path, name, rank, lisa):
    from types import SimpleNamespace

    model = tiny(0, 4)
    units = model_units(model_parts(model))
    section = OptimizerSection(name=name, rank=rank, lr=1e-3)
    opts = UnitOptimizers(units, section, torch.device("cpu"), tmp_path, 0)
    ctrl = LisaController(units, opts, LisaSection(enabled=lisa, active_layers=2), 0)
    run(SimpleNamespace(model=model, opts=opts, ctrl=ctrl), 0, 1)
    s = settings_for_config(model.config, {"model.dtype": "float32", "optimizer.name": name, "optimizer.rank": rank,
                                           "lisa.enabled": lisa, "lisa.active_layers": 2}, device="cpu")
    assert compute(s).components["optimizer_states"] == opts.state_bytes()[0]


def test_the_8b_recipe_trains_every_weight_within_21_5_gib():
    recipe = load_recipe(REPO / "recipes" / "llama3.1-8b-apollo-24gb.yaml")
    e = compute(settings_from_recipe(recipe, device="cuda", budget_bytes=24 * GiB))
    assert e.settings.model_label == "llama-3.1-8b" and not e.settings.recipe.lisa.enabled
    assert e.trainable_params == e.total_params
    assert e.total_bytes <= 21.5 * GiB
    # The projected moments of 32 layers at rank 1 are a few MiB; the rest is the 8-bit
    # moments of embeddings and head.
    full_rank = compute(e.settings.with_keys({"optimizer.name": "apollo", "optimizer.rank": 256}))
    assert full_rank.components["optimizer_states"] > e.components["optimizer_states"] + GiB


def test_full_fine_tuning_that_does_not_fit_is_told_apollo_mini():
    recipe = load_recipe(REPO / "recipes" / "llama3.1-8b-full-24gb.yaml",
                         ["optimizer.cpu_offload=false", "optimizer.name=adamw_32bit"])
    s = settings_from_recipe(recipe, device="cuda", budget_bytes=24 * GiB)
    e = compute(s)
    assert not e.fits
    change = next(c for c in advice(e, 32) if c.overrides.get("optimizer.name") == "apollo_mini")
    assert change.estimate.fits and change.overrides["optimizer.in_backward"] is True
    assert "llama3.1-8b-apollo-24gb.yaml" in change.why
    ours = compute(settings_from_recipe(load_recipe(REPO / "recipes" / "llama3.1-8b-apollo-24gb.yaml"),
                                        device="cuda", budget_bytes=24 * GiB))
    assert change.estimate.total_bytes == ours.total_bytes  # the recipe's own estimate
    lisa = compute(s.with_keys({"lisa.enabled": True}))
    assert not any(c.overrides.get("optimizer.name") == "apollo_mini" for c in advice(lisa, 32))
