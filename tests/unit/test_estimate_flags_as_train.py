"""estimate-memory's flags and advice rows change the recipe exactly as `lisaft train` needs it: what
the estimator estimates, train accepts as the same recipe; what it refuses, train refuses in the
same words. Train's side is what it runs before the model loads (the recipe's validation and
config/compat.py's set-up check), for a launch of the ranks the estimate is for, on CUDA."""

import re
import shlex
from pathlib import Path

import pytest

from lisaft.config.compat import check_world
from lisaft.config.schema import load_recipe
from lisaft.errors import LisaftError
from lisaft.memory.command import (
    Budget,
    EstimateFlags,
    build_report,
    build_settings,
    companion_notes,
    estimate_recipe,
    train_sets,
)

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("llama3.1-8b-*.yaml"))
GiB = 2**30

# The flags the README's usage of estimate-memory names, one at a time, and its ways table's pair.
README_FLAGS = [
    {"optimizer": "paged_adamw_8bit"}, {"lisa_layers": 2}, {"no_lisa": True}, {"batch_size": 2},
    {"seq_len": 1024}, {"gradient_checkpointing": True}, {"gradient_checkpointing": False},
    {"attention": "sdpa"}, {"dtype": "bfloat16"}, {"in_backward": True}, {"in_backward": False},
    {"cpu_offload": True}, {"cpu_offload": False}, {"fsdp": True, "ranks": 2}, {"fsdp": False},
    {"device": "cuda"}, {"no_lisa": True, "in_backward": True},
]


def _train_says(path: Path, sets: list[str], ranks: int = 1):
    """The recipe `lisaft train PATH --set ...` runs under torchrun with `ranks` processes, or its
    refusal's line."""
    try:
        recipe = load_recipe(path, sets)
        check_world(recipe, ranks, launched=True, device="cuda")
    except LisaftError as e:
        return str(e)
    return recipe


def _reason(line: str) -> str:
    """A refusal without the part that names what was typed (the file and its --set or flags)."""
    return line.split(": invalid recipe: ", 1)[-1]


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_readme_flag_is_a_recipe_train_accepts_or_refuses_alike(path):
    for given in README_FLAGS:
        flags = EstimateFlags(recipe=path, **given)
        sets = shlex.split(train_sets(flags))[1::2]
        said = _train_says(path, sets, flags.ranks or 1)
        try:
            build_settings(flags, 24 * GiB)
        except LisaftError as e:
            assert isinstance(said, str), (path.name, given, str(e))
            assert _reason(str(e)) == _reason(said), (path.name, given)
            continue
        assert not isinstance(said, str), (path.name, given, said)
        assert said == estimate_recipe(flags), (path.name, given)


@pytest.mark.parametrize("name", ["lisa-24gb", "full-24gb", "apollo-24gb", "dpo-24gb"])
def test_every_advice_and_method_row_is_a_recipe_train_accepts(name):
    """Each row's keys, given to `lisaft train` as --set: accepted (at the row's ranks)."""
    path = REPO / "recipes" / f"llama3.1-8b-{name}.yaml"
    for budget in (12 * GiB, 20 * GiB):
        s = build_settings(EstimateFlags(recipe=path, host_ram="64GiB"), budget)
        report = build_report(s, Budget(budget, "test"))
        rows = [(c.overrides, c.ranks or 1) for c in report.advice] + [(m.overrides, 1) for m in report.methods]
        assert rows
        for keys, ranks in rows:
            sets = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in keys.items()]
            said = _train_says(path, sets, ranks)
            assert not isinstance(said, str), (name, budget, keys, said)


def test_the_readme_row_names_the_whole_change():
    """The ways table's `--no-lisa --in-backward` row gives train's --set items, companion included."""
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "`--no-lisa --in-backward`" in line)
    flags = EstimateFlags(recipe=REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml", no_lisa=True, in_backward=True)
    assert "training.max_grad_norm=null" in train_sets(flags)
    assert sorted(re.findall(r"--set (\S+?)`?(?= |$|`)", row)) == sorted(shlex.split(train_sets(flags))[1::2])


def test_a_companion_key_is_said():
    from typer.testing import CliRunner

    from lisaft.cli import app

    result = CliRunner().invoke(app, ["estimate-memory", str(REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"),
                                      "--no-gradient-checkpointing"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "--no-gradient-checkpointing also sets model.offload_activations: false" in text
    assert ("the same recipe for `lisaft train`: --set model.gradient_checkpointing=false "
            "--set model.offload_activations=false") in text
    # A recipe that takes the flag alone (APOLLO's clips nothing already) carries nothing, says nothing.
    flags = EstimateFlags(recipe=REPO / "recipes" / "llama3.1-8b-apollo-24gb.yaml", in_backward=True)
    assert companion_notes(flags) == [] and train_sets(flags) == "--set optimizer.in_backward=true"


def test_both_commands_refuse_a_tiny_recipe_in_the_same_words(tmp_path):
    """The CLIs themselves: a tiny recipe stepping in backward, where --cpu-offload and --fsdp are
    refused by `lisaft train` (before anything loads) and by estimate-memory with the same reason."""
    import yaml
    from transformers import LlamaConfig
    from typer.testing import CliRunner

    from lisaft.cli import app

    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(tmp_path / "model")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": "model/config.json", "gradient_checkpointing": True, "offload_activations": True},
        "data": {"train": "train.jsonl", "max_seq_len": 32},
        "optimizer": {"name": "adamw_32bit", "in_backward": True},
        "training": {"max_steps": 1, "max_grad_norm": None, "output_dir": str(tmp_path / "run")}}))
    runner = CliRunner()

    def refused(*args: str) -> str:
        result = runner.invoke(app, [*args])
        assert result.exit_code == 2, result.output
        (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
        return _reason(line)

    for given in (["--cpu-offload"], ["--fsdp", "--ranks", "2"]):
        flags = EstimateFlags(recipe=recipe, cpu_offload=True if "--cpu-offload" in given else None,
                              fsdp=True if "--fsdp" in given else None, ranks=2 if "--fsdp" in given else None)
        train_args = [a for s in shlex.split(train_sets(flags))[1::2] for a in ("--set", s)]
        assert refused("estimate-memory", str(recipe), *given) == refused("train", str(recipe), *train_args)
    assert not (tmp_path / "run").exists()
