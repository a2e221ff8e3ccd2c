"""What estimate-memory prints, for a user to act on: keys never cut in 80 columns, every "no"
beside a figure that fits says why, --host-ram counts whatever keeps host memory, and the rows of
"Ways to train it" say which settings they use."""

import io
import json
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from lisaft.cli import app

REPO = Path(__file__).resolve().parents[2]
FULL = str(REPO / "recipes" / "llama3.1-8b-full-24gb.yaml")
LISA = str(REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml")
APOLLO = str(REPO / "recipes" / "llama3.1-8b-apollo-24gb.yaml")
runner = CliRunner()


def _json(*args: str) -> dict:
    result = runner.invoke(app, ["estimate-memory", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _text(*args: str, width: int = 80) -> str:
    from lisaft.memory.command import EstimateFlags, build_report, build_settings, parse_budget
    from lisaft.memory.render import render

    flags = EstimateFlags(recipe=Path(args[0]), host_ram=args[1] if len(args) > 1 else None)
    budget = parse_budget(None, None)
    out = io.StringIO()
    Console(file=out, width=width).print(render(build_report(build_settings(flags, budget.bytes), budget,
                                                             flags.host_ram)))
    return out.getvalue()


def test_no_key_is_cut_in_80_columns():
    text = _text(FULL, "32GiB")
    lines = [line.strip("│┃ ") for line in text.splitlines()]
    rows = _json(FULL, "--host-ram", "32GiB")["advice"]
    assert any(len(r["set"]) >= 4 for r in rows)  # a long change, as the issue saw cut
    for row in rows:
        for key, value in row["set"].items():
            assert any(line.startswith(f"{key}: {json.dumps(value)}") for line in lines), (key, text)
    assert "…" not in text.split("What brings it under")[1].split("Optimizers side by side")[0]


def test_a_no_beside_a_figure_that_fits_says_host_ram():
    data = _json(FULL, "--host-ram", "64GiB")
    full = data["optimizers"]["adamw_32bit"]["full"]  # float32 moments in host memory: 90+ GiB
    assert not full["fits"] and full["total_bytes"] <= data["budget_bytes"]
    text = " ".join(_text(FULL, "64GiB").split())
    assert "no (host RAM)" in text and "is more than the machine's RAM (--host-ram)" in text


def test_host_ram_counts_offloaded_layer_inputs_without_cpu_offload():
    small, enough = _json(LISA, "--host-ram", "256MiB"), _json(LISA, "--host-ram", "64GiB")
    assert not small["settings"]["cpu_offload"] and small["settings"]["offload_activations"]
    assert small["host_bytes"] == small["activation_host_bytes"] == 512 * 2**20
    assert not small["fits_host"] and not small["fits"] and enough["fits"]
    assert small["total_bytes"] == enough["total_bytes"] <= small["budget_bytes"]
    assert "pins 512.00 MiB of layer inputs in host memory, the machine has 256.00 MiB" in \
        " ".join(_text(LISA, "256MiB").split())
    # Where nothing stays in host memory, the flag is answered, not silently dropped.
    assert "--host-ram 64GiB: these settings keep nothing in host memory" in " ".join(_text(APOLLO, "64GiB").split())


def test_the_ways_to_train_rows_say_which_settings_they_use():
    """From the LISA recipe APOLLO-Mini shows less than from the APOLLO recipe: the rows keep the
    recipe's model.offload_activations, and say so; each row's keys reproduce its figure."""
    from lisaft.config.schema import load_recipe
    from lisaft.memory.command import estimate_for_recipe

    for recipe in (LISA, APOLLO):
        for row in _json(recipe)["methods"]:
            sets = [f"{k}={json.dumps(v)}" for k, v in row["set"].items()]
            assert estimate_for_recipe(load_recipe(recipe, sets), "cuda", 24 * 2**30).total_bytes == \
                row["total_bytes"], (recipe, row["method"])
    mini = {r: next(m for m in _json(r)["methods"] if m["method"].startswith("APOLLO-Mini")) for r in (LISA, APOLLO)}
    assert mini[LISA]["total_bytes"] < mini[APOLLO]["total_bytes"] == _json(APOLLO)["total_bytes"]
    text = " ".join(_text(LISA).split())
    assert "each row: data.max_seq_len 2048, training.batch_size 1" in text
    assert "model.offload_activations true" in text.split("Ways to train it")[1]
    assert "model.offload_activations" not in " ".join(_text(APOLLO).split()).split("Ways to train it")[1]


def test_the_json_of_every_shipped_recipe_keeps_its_keys_and_adds_up():
    """The --json contract on every shipped recipe: the keys scripts read, the components summing to
    the total at every moment, the settings read back from the recipe's own keys, and the weights
    and trainable counts against arithmetic from the model's config."""
    from lisaft.config.schema import load_recipe
    from lisaft.memory.catalogue import resolve_model

    top = {"total_bytes", "budget_bytes", "fits", "fits_with_paging", "components", "sizes", "peak_phase", "phases",
           "phase_components", "paged_state_bytes", "paged_gpu_bytes", "paged_host_bytes", "saved_activation_bytes",
           "activation_host_bytes", "host_bytes", "host_components", "host_budget_bytes", "fits_host",
           "total_params", "trainable_params", "settings", "notes", "budget", "largest_seq_len",
           "largest_batch_size", "context_length", "weights_fit", "advice", "fewest_ranks", "smallest_budget_bytes",
           "smallest_gpu", "smallest_gpu_as_is", "optimizers", "methods", "preference", "flag_notes",
           "layer_major", "grpo"}
    for path in sorted((REPO / "recipes").glob("llama3.1-8b-*.yaml")):
        recipe, out = load_recipe(path), _json(str(path), "--host-ram", "64GiB")
        assert set(out) == top, (path.name, set(out) ^ top)
        assert out["total_bytes"] == out["phases"][out["peak_phase"]] == max(out["phases"].values())
        assert out["components"] == out["phase_components"][out["peak_phase"]]
        for phase, parts in out["phase_components"].items():
            assert sum(parts.values()) == out["phases"][phase], (path.name, phase)
        s = out["settings"]
        assert (s["seq_len"], s["batch_size"], s["optimizer"], s["lisa"], s["cpu_offload"], s["in_backward"]) == (
            recipe.data.max_seq_len, recipe.training.batch_size, recipe.optimizer.name, recipe.lisa.enabled,
            recipe.optimizer.cpu_offload, recipe.optimizer.in_backward), path.name
        assert s["clipping"] == (recipe.training.max_grad_norm is not None)
        assert (s["lora"] is not None) == recipe.lora.enabled and s["sequences"] == recipe.training.batch_size * (
            2 if recipe.preference is not None else 1)
        config = resolve_model("llama-3.1-8b")[0]
        assert out["total_params"] == 8_030_261_248
        if not recipe.lora.enabled:
            # bf16 parameters plus the float32 rotary tables (inv_freq and its original copy: head_dim / 2 each)
            assert out["sizes"]["weights"] == 2 * 8_030_261_248 + 2 * 4 * (config.head_dim // 2)
        if not recipe.lisa.enabled and not recipe.lora.enabled:
            assert out["trainable_params"] == out["total_params"]
        assert out["fits"] and out["total_bytes"] <= 24 * 2**30, path.name
        # A GRPO recipe's two peaks are moments of its own (docs/memory.md); null for the others.
        assert (out["grpo"] is not None) == (recipe.grpo is not None) and ("generation" in out["phases"]) == (
            recipe.grpo is not None), path.name


def test_the_verdict_shows_the_digits_that_tell_need_from_budget():
    """A total a few KiB over the budget: both sides to the digit where they differ, and by how much."""
    from lisaft.memory.command import EstimateFlags, build_settings
    from lisaft.memory.estimate import compute
    from lisaft.memory.render import verdict
    from lisaft.memory.tables import human_pair

    for recipe, says in ((APOLLO, "Does not fit: {} > {} (over by 2.93 KiB)."),
                         (LISA, "needs {} resident, budget {})")):  # paged: runs, with its state paged out
        total = compute(build_settings(EstimateFlags(recipe=Path(recipe)), 24 * 2**30)).total_bytes
        over = compute(build_settings(EstimateFlags(recipe=Path(recipe)), total - 3000))
        assert not over.fits
        need, budget = human_pair(over.total_bytes, over.budget_bytes)
        assert need != budget and need.endswith(" GiB") and budget.endswith(" GiB")
        assert says.format(need, budget) in verdict(over).plain
    assert human_pair(24 * 2**30 + 1, 24 * 2**30) == ("24.000000001 GiB", "24.000000000 GiB")
    assert human_pair(2**30, 2**30) == ("1.00 GiB", "1.00 GiB")
