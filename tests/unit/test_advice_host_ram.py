"""estimate-memory's advice when the machine's RAM decides: it names host RAM as the limit, offers
what lowers host memory, quotes each row's own RAM, and never calls CPU-stepped moments paged."""

import json
import sys
from pathlib import Path

from typer.testing import CliRunner

from lisaft.cli import app

REPO = Path(__file__).resolve().parents[2]
FULL = str(REPO / "recipes" / "llama3.1-8b-full-24gb.yaml")
runner = CliRunner()


def _text(*args: str) -> str:
    result = runner.invoke(app, ["estimate-memory", *args])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_host_ram_as_the_limit_is_named_and_no_gpu_is_proposed():
    out = _text(FULL, "--host-ram", "32GiB")
    assert "Host RAM is the limit, not the GPU" in out
    assert "recipes/llama3.1-8b-lisa-24gb.yaml" in out and "optimizer.cpu_offload: false" in out
    assert "smallest catalogue GPU" not in out and "Largest sequence length" not in out
    assert "offload_activations" not in out  # it adds host memory
    data = json.loads(runner.invoke(app, ["estimate-memory", FULL, "--host-ram", "32GiB", "--json"]).stdout)
    rows = data["advice"]
    assert rows and all("model.offload_activations" not in r["set"] for r in rows)
    assert any(r["fits"] for r in rows)


def test_the_offload_row_quotes_the_ram_of_its_own_combination():
    data = json.loads(runner.invoke(app, ["estimate-memory", "--model", "llama-3.1-8b", "--gpu", "rtx-4090",
                                          "--host-ram", "64GiB", "--json"]).stdout)
    fitting = [r for r in data["advice"] if r["fits"] and r["set"].get("optimizer.cpu_offload")]
    assert fitting, data["advice"]
    row = fitting[0]
    # The 8-bit moments live in host RAM: an unpaged optimizer, and the why's RAM is this row's.
    assert row["set"].get("optimizer.name", "adamw_8bit") == "adamw_8bit"
    assert "paged" not in row["why"] and "recipes/llama3.1-8b-full-24gb.yaml" in row["why"]
    flags = ["--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--host-ram", "64GiB", "--cpu-offload",
             "--optimizer", "adamw_8bit", "--json"]
    if row["set"].get("model.gradient_checkpointing"):
        flags.append("--gradient-checkpointing")
    host = json.loads(runner.invoke(app, ["estimate-memory", *flags]).stdout)["host_bytes"]
    assert f"needs {host / 1024**3:.1f} GiB of RAM" in row["why"]


def test_explain_on_the_offload_recipe_says_where_its_memory_is():
    out = _text(FULL, "--host-ram", "64GiB", "--explain")
    assert "Nothing is paged with optimizer.cpu_offload" in out and "pinned" in out


def test_messages_name_what_the_user_typed():
    result = runner.invoke(app, ["estimate-memory", FULL, "--in-backward"])
    out = " ".join(result.output.split())
    # The recipe's refusal, as `lisaft train` words it, after what was typed beside the recipe.
    assert result.exit_code == 2 and f"{FULL} --in-backward: invalid recipe: optimizer.cpu_offload cannot be " \
        "combined with optimizer.in_backward" in out
    assert "--cpu-offload" not in out
    result = runner.invoke(app, ["estimate-memory", FULL, "--host-ram", "64"])
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "--host-ram: '64' needs a unit" in out and "--gpu" not in out
    result = runner.invoke(app, ["estimate-memory", FULL, "--budget", "24"])
    assert result.exit_code == 2 and "--gpu" in result.output


def test_the_mask_note_names_packing_only_when_the_recipe_packs():
    out = _text(str(REPO / "recipes" / "quickstart.yaml"))
    assert "data.packing under" not in out and "rows padded to the longest in the batch under sdpa" in out
    out = _text(str(REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"), "--attention", "sdpa")
    assert "data.packing under sdpa" in out


def test_lisaft_train_without_a_gpu_quotes_the_figure_estimate_memory_gives(monkeypatch):
    """On a CPU device the whole run is host memory: the refusal names `estimate-memory ... --device cpu`,
    whose total is the figure the refusal quotes."""
    import re

    import pytest

    from lisaft.config.schema import load_recipe
    from lisaft.errors import LisaftError
    from lisaft.memory import command
    from lisaft.memory.render import human
    from lisaft.train.host_memory import check_host_memory

    monkeypatch.setattr(command, "host_ram_bytes", lambda: 32 * 2**30)
    # `lisaft train` checks before it loads data, when `datasets` is not imported yet, which the
    # estimate counts on a CPU; an earlier test in this process (tests/unit/test_data.py) imports it.
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    with pytest.raises(LisaftError) as refused:
        check_host_memory(load_recipe(FULL), FULL, device="cpu")
    message = str(refused.value)
    hint = re.search(r"`lisaft (estimate-memory .*?)`", message)
    assert hint is not None and hint.group(1) == f"estimate-memory {FULL} --device cpu", message
    data = json.loads(runner.invoke(app, [*hint.group(1).split(), "--json"]).stdout)
    assert f"needs an estimated {human(data['total_bytes'])} of host memory" in message
