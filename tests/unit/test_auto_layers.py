"""lisa.active_layers: auto picks the largest γ whose estimate fits, as the estimator says."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.config.schema import load_recipe
from lisaft.errors import LisaftError
from lisaft.memory.advice import AUTO_MARGIN
from lisaft.memory.auto_layers import (
    choose_active_layers,
    device_memory_bytes,
    host_memory_available,
    resolve_active_layers,
)
from lisaft.memory.command import settings_from_recipe
from lisaft.memory.estimate import GiB, compute

REPO = Path(__file__).resolve().parents[2]
RECIPE_8B = REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"


def _recipe_8b(*overrides: str):
    return load_recipe(RECIPE_8B, ["lisa.active_layers=auto", *overrides])


def _totals(s) -> dict[int, int]:
    return {g: compute(s.with_keys({"lisa.active_layers": g})).total_bytes for g in range(1, 33)}


def test_auto_picks_the_largest_gamma_the_estimator_fits():
    base = settings_from_recipe(_recipe_8b(), device="cuda", budget_bytes=24 * GiB)
    assert base.auto
    totals = _totals(base)
    assert all(totals[g] < totals[g + 1] for g in range(1, 32))  # what makes a bisection exact
    # Budgets on both sides of several γ's estimate, and around the ends.
    # The choice keeps AUTO_MARGIN of the budget free: a budget is the total over (1 - margin).
    for total in (totals[1], totals[3] - 1, totals[3], totals[7] + 1, 24 * GiB, totals[32], 10**12):
        budget = int(total / (1 - AUTO_MARGIN)) + 1
        choice = choose_active_layers(base.with_(budget_bytes=budget))
        brute = max(g for g, t in totals.items() if t <= budget * (1 - AUTO_MARGIN))
        assert choice.active_layers == brute, budget
        assert choice.total_bytes == totals[brute] and choice.budget_bytes == budget
    assert "full fine-tuning" in choose_active_layers(base.with_(budget_bytes=10**12)).line()
    assert "full fine-tuning" not in choose_active_layers(base.with_(budget_bytes=24 * GiB)).line()


def test_auto_leaves_the_margin_a_total_budget_choice_would_not():
    # The case: on a 4090 (23.39 GiB torch can allocate) a choice against the whole budget
    # left 1.2%; with the margin the peak stays under 95% of it.
    base = settings_from_recipe(_recipe_8b(), device="cuda", budget_bytes=int(23.39 * GiB))
    choice = choose_active_layers(base)
    assert choice.total_bytes <= 0.95 * base.budget_bytes
    one_more = base.with_keys({"lisa.active_layers": choice.active_layers + 1})
    assert compute(one_more).total_bytes > 0.95 * base.budget_bytes


def test_the_gpu_budget_is_the_free_memory_plus_this_process_context(monkeypatch):
    import torch

    from lisaft.memory.cuda_process import CUDA_CONTEXT_BYTES

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A display holds 1.5 GiB of a 24 GiB card; creating our context took CUDA_CONTEXT_BYTES.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (24 * GiB - int(1.5 * GiB) - CUDA_CONTEXT_BYTES,
                                                                  24 * GiB))
    assert device_memory_bytes("cuda") == 24 * GiB - int(1.5 * GiB)


def test_auto_that_fits_nothing_names_the_key():
    base = settings_from_recipe(_recipe_8b(), device="cuda", budget_bytes=24 * GiB)
    one = compute(base.with_keys({"lisa.active_layers": 1})).total_bytes
    with pytest.raises(LisaftError, match=r"lisa\.active_layers: auto: even γ=1 needs"):
        choose_active_layers(base.with_(budget_bytes=one - 1))


def test_resolving_writes_the_choice_into_the_recipe_and_states_it():
    recipe = _recipe_8b()
    choice = resolve_active_layers(recipe, "cuda", budget_bytes=24 * GiB)
    assert recipe.lisa.active_layers == choice.active_layers >= 2
    assert choice.line() == (f"γ={choice.active_layers}: {choice.total_bytes / GiB:.1f} of 24.0 GiB (5% kept free)")
    assert "active_layers: auto" not in recipe.to_yaml()  # the run's recipe.yaml records the number
    assert resolve_active_layers(recipe, "cuda", budget_bytes=24 * GiB) is None  # nothing left to do
    assert resolve_active_layers(_recipe_8b("lisa.enabled=false"), "cuda") is None


def test_cpu_device_memory_is_the_host_ram_available():
    available = host_memory_available()
    if available is None:
        pytest.skip("no /proc/meminfo")
    first = device_memory_bytes("cpu")
    # MemAvailable moves with other processes: compare within a margin, and below physical RAM.
    assert abs(first - available) < 2 * GiB
    import os
    assert first <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_estimate_memory_shows_the_same_choice():
    runner = CliRunner()
    args = ["estimate-memory", str(RECIPE_8B), "--set", "lisa.active_layers=auto", "--budget", "24GiB"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    expected = choose_active_layers(settings_from_recipe(_recipe_8b(), device="cuda", budget_bytes=24 * GiB))
    assert out["settings"]["active_layers"] == expected.active_layers
    assert out["settings"]["active_layers_auto"] is True
    assert out["total_bytes"] == expected.total_bytes and out["fits"]
    text = runner.invoke(app, args)
    assert text.exit_code == 0, text.output
    assert f"auto picks γ={expected.active_layers}: {expected.total_bytes / GiB:.1f} of 24.0 GiB" in text.stdout
    small = runner.invoke(app, [*args[:-1], "4GiB"])
    assert small.exit_code == 0 and "not even γ=1 fits" in small.stdout
    # --lisa-layers overrides auto.
    fixed = json.loads(runner.invoke(app, [*args, "--lisa-layers", "1", "--json"]).stdout)
    assert fixed["settings"]["active_layers"] == 1 and fixed["settings"]["active_layers_auto"] is False
