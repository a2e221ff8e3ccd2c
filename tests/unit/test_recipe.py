from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from lisaft.config.schema import Recipe, apply_overrides, load_recipe
from lisaft.errors import LisaftError

BASE = {
    "model": {"config": "cfg/config.json", "tokenizer": "tok"},
    "data": {"train": "data/train.jsonl", "format": "instruction"},
    "training": {"max_steps": 10, "output_dir": "runs/x"},
}


def write(tmp_path: Path, data, name="r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def test_defaults_documented_and_applied(tmp_path):
    r = load_recipe(write(tmp_path, BASE))
    assert r.optimizer.name == "adamw_32bit"
    assert r.lisa.enabled is False and r.lisa.state_policy == "discard"
    for section in (Recipe.model_fields["optimizer"].annotation, Recipe.model_fields["lisa"].annotation):
        for name, f in section.model_fields.items():
            assert f.description, f"{section.__name__}.{name} has no description"


def test_relative_paths_resolve_against_recipe_folder(tmp_path, monkeypatch):
    (tmp_path / "tok").mkdir()
    r = load_recipe(write(tmp_path, BASE))
    monkeypatch.chdir("/")
    assert r.data.train == str((tmp_path / "data/train.jsonl").resolve())
    assert r.model.tokenizer == str((tmp_path / "tok").resolve())
    assert r.training.output_dir == str((tmp_path / "runs/x").resolve())


def test_hub_id_left_alone(tmp_path):
    data = {**BASE, "model": {"name_or_path": "meta-llama/Llama-3.1-8B"}}
    r = load_recipe(write(tmp_path, data))
    assert r.model.name_or_path == "meta-llama/Llama-3.1-8B"


def test_overrides_parse_yaml_values(tmp_path):
    r = load_recipe(write(tmp_path, BASE), ["lisa.enabled=true", "optimizer.lr=3e-4",
                                            "training.max_grad_norm=null", "lisa.active_layers=3"])
    assert r.lisa.enabled is True and r.lisa.active_layers == 3
    assert r.optimizer.lr == 3e-4 and r.training.max_grad_norm is None


def test_override_creates_missing_section():
    assert apply_overrides({}, ["lisa.enabled=true"]) == {"lisa": {"enabled": True}}


@pytest.mark.parametrize("override, key", [
    (["lisa.intervals_steps=3"], "lisa.intervals_steps: unknown key"),
    (["optimizer.lr=0"], "optimizer.lr"),
    (["optimizer.lr=-1"], "optimizer.lr"),
    (["optimizer.name=sgd"], "optimizer.name"),
    (["training.batch_size=many"], "training.batch_size"),
    (["optimizer.in_backward=true"], "training.max_grad_norm"),
    (["optimizer.in_backward=true", "training.max_grad_norm=null", "training.grad_accum_steps=2"],
     "grad_accum_steps"),
])
def test_bad_values_name_the_key(tmp_path, override, key):
    with pytest.raises(LisaftError) as e:
        load_recipe(write(tmp_path, BASE), override)
    assert key in str(e.value)
    if override[0].startswith("optimizer.in_backward"):
        # A combination of the file's keys and the command line's: both are named.
        assert str(e.value).startswith(f"{tmp_path / 'r.yaml'} --set {override[0]}")
    else:  # the --set alone is wrong: the recipe file is not blamed
        assert str(e.value).startswith(f"--set {override[0].split('=')[0]}: ")
        assert "r.yaml" not in str(e.value)


def test_a_set_mistake_next_to_a_file_mistake_names_each_where_it_is(tmp_path):
    with pytest.raises(LisaftError) as e:
        load_recipe(write(tmp_path, _with("lisa", active_layer=2)), ["optimizer.lr=0"])
    assert str(e.value) == (f"{tmp_path / 'r.yaml'}: invalid recipe: lisa.active_layer: unknown key; did you "
                            "mean lisa.active_layers?; --set optimizer.lr: must be > 0")


@pytest.mark.parametrize("raw", ["Q: {instruction}\nA: ", "it's: \"x\" {y}", "a: b: c"])
def test_a_set_value_yaml_cannot_read_gets_the_quoting_that_works(tmp_path, raw):
    import shlex

    from lisaft.config.overrides import parse_override

    with pytest.raises(LisaftError) as e:
        load_recipe(write(tmp_path, BASE), [f"data.template={raw}"])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("--set data.template: ")
    assert "the value is not valid YAML (" in message or "must be text (YAML read" in message
    suggested = message.split("quote it: ", 1)[1]
    argv = shlex.split(suggested)  # as the shell would pass it
    assert argv[0] == "--set" and parse_override(argv[1]).value == raw


def test_command_line_paths_mean_the_current_directory(tmp_path, monkeypatch):
    """Paths in the file mean the recipe's folder; paths typed with --set mean where one stands."""
    (tmp_path / "recipes").mkdir()
    recipe = write(tmp_path / "recipes", BASE)
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = load_recipe(recipe, ["data.eval=mine/eval.jsonl", "training.output_dir=runs/here"])
    assert r.data.eval == str(elsewhere / "mine" / "eval.jsonl")
    assert r.training.output_dir == str(elsewhere / "runs" / "here")
    assert r.data.train == str(tmp_path / "recipes" / "data" / "train.jsonl")  # from the file
    whole = load_recipe(recipe, ["data={train: t.jsonl}"])
    assert whole.data.train == str(elsewhere / "t.jsonl")


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(LisaftError, match="not valid YAML"):
        load_recipe(write(tmp_path, "model: [unclosed\n  - x: :"))
    with pytest.raises(LisaftError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(LisaftError, match="mapping"):
        load_recipe(write(tmp_path, "- a\n- b\n"))


def test_bad_set_syntax(tmp_path):
    with pytest.raises(LisaftError, match="key.path=value"):
        load_recipe(write(tmp_path, BASE), ["lisa.enabled"])


def test_missing_required_section(tmp_path):
    with pytest.raises(LisaftError, match="training: required key is missing"):
        load_recipe(write(tmp_path, {k: v for k, v in BASE.items() if k != "training"}))


def test_model_source_exclusive(tmp_path):
    data = {**BASE, "model": {"config": "c.json", "name_or_path": "x", "tokenizer": "t"}}
    with pytest.raises(LisaftError, match="exactly one of model.name_or_path and model.config"):
        load_recipe(write(tmp_path, data))


def _checkpoint(tmp_path, saved, world_size: int):
    """What resume reads of a checkpoint before set-up: its recipe and how many ranks wrote it."""
    import json

    ckpt = tmp_path / "step-000002"
    ckpt.mkdir()
    (ckpt / "recipe.json").write_text(json.dumps(saved.model_dump(mode="json")))
    progress = {"step": 2, "world_size": world_size}
    (ckpt / "state.json").write_text(json.dumps({"format": 2, "components": {"progress": progress}}))
    return ckpt


def test_resume_accepts_cadence_changes_and_refuses_the_rest(tmp_path):
    from lisaft.train.resume import recipe_changes

    saved = load_recipe(write(tmp_path, BASE))
    ckpt = _checkpoint(tmp_path, saved, world_size=1)
    cadence = load_recipe(write(tmp_path, BASE), ["training.log_every=5", "training.max_steps=99"])
    assert [k for k, _, _ in recipe_changes(ckpt, cadence)] == ["training.log_every", "training.max_steps"]
    with pytest.raises(LisaftError, match="training.seed: cannot change on resume"):
        recipe_changes(ckpt, load_recipe(write(tmp_path, BASE), ["training.seed=7"]))
    # On as many ranks the per-rank batch is the training path too.
    with pytest.raises(LisaftError, match="training.batch_size: cannot change on resume .*when the number of ranks"):
        recipe_changes(ckpt, load_recipe(write(tmp_path, BASE), ["training.batch_size=2"]))


def test_a_resume_on_fewer_ranks_may_change_the_per_rank_batch_but_not_the_global_one(tmp_path):
    from lisaft.train.resume import recipe_changes

    as_saved = ["training.batch_size=2", "training.grad_accum_steps=3"]
    ckpt = _checkpoint(tmp_path, load_recipe(write(tmp_path, BASE), as_saved), world_size=2)
    # This process is one rank: 2 x 3 x 2 = 12 examples per step, kept by 4 x 3 or 2 x 6.
    for keep in (["training.batch_size=4", "training.grad_accum_steps=3"],
                 ["training.batch_size=2", "training.grad_accum_steps=6"]):
        changed = recipe_changes(ckpt, load_recipe(write(tmp_path, BASE), keep))
        assert {k for k, _, _ in changed} <= {"training.batch_size", "training.grad_accum_steps"}
    with pytest.raises(LisaftError) as e:
        recipe_changes(ckpt, load_recipe(write(tmp_path, BASE), as_saved))
    assert "written by 2 ranks at a global batch of 12" in str(e.value) and "\n" not in str(e.value)
    assert "pass --set training.batch_size=4" in str(e.value)


def test_every_shipped_recipe_validates():
    recipes = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))
    assert recipes, "no recipes shipped"
    for path in recipes:
        load_recipe(path)


def test_recipe_reference_doc_matches_schema():
    from lisaft.config.schema import reference_markdown

    doc = Path(__file__).parents[2] / "docs" / "recipes.md"
    assert doc.read_text() == reference_markdown(), "regenerate: python -m lisaft.config.schema > docs/recipes.md"


def test_hub_dataset_names_are_not_turned_into_paths(tmp_path):
    r = load_recipe(write(tmp_path, {**BASE, "data": {"train": "imdb", "eval": "org/set"}}))
    assert r.data.train == "imdb" and r.data.eval == "org/set"


def _error(tmp_path, data) -> str:
    with pytest.raises(LisaftError) as e:
        load_recipe(write(tmp_path, data))
    return str(e.value)


def _with(section: str, **values) -> dict:
    import copy

    data = copy.deepcopy(BASE)
    data.setdefault(section, {}).update(values)
    return data


def test_counts_are_strict_and_1e3_is_a_thousand(tmp_path):
    assert load_recipe(write(tmp_path, _with("training", max_steps="1e3"))).training.max_steps == 1000
    assert load_recipe(write(tmp_path, _with("training", max_steps=2.0))).training.max_steps == 2
    assert "training.batch_size: must be a whole number, not true/false" in \
        _error(tmp_path, _with("training", batch_size=True))
    assert "training.max_steps: must be a whole number, got 2.5e0" in \
        _error(tmp_path, _with("training", max_steps="2.5e0"))
    assert "lisa.enabled: must be true or false" in _error(tmp_path, _with("lisa", enabled=1))
    assert "optimizer.lr: must be a number" in _error(tmp_path, _with("optimizer", lr=True))


def _counts():
    """(section, key) of every key of the schema that takes a whole number."""
    import typing

    def takes_int(t) -> bool:
        return t is int or any(takes_int(a) for a in typing.get_args(t))

    return [(name, key) for name, f in Recipe.model_fields.items()
            for key, field in _section(name).model_fields.items() if takes_int(field.annotation)]


def _section(name: str):
    """A recipe section's model; an optional section (preference) is a union with None."""
    import typing

    t = Recipe.model_fields[name].annotation
    return next((a for a in typing.get_args(t) if a is not type(None)), t)


def test_every_count_takes_1e3_as_a_thousand(tmp_path):
    counts = _counts()
    assert ("lora", "rank") in counts and ("optimizer", "rank") in counts and ("model", "mlp_chunk_tokens") in counts
    for section, key in counts:
        errors = []
        try:
            _section(section).model_validate({key: "1e3"})
        except ValidationError as e:
            errors = [err for err in e.errors() if err["loc"][:1] == (key,)]
        assert not errors, f"{section}.{key}: {errors}"
    assert load_recipe(write(tmp_path, _with("lora", enabled=True, rank="1e3"))).lora.rank == 1000
    assert "lora.rank: must be a whole number, not true/false" in _error(tmp_path, _with("lora", rank=True))


def test_unknown_keys_get_did_you_mean(tmp_path):
    assert "lisa.active_layer: unknown key; did you mean lisa.active_layers?" in \
        _error(tmp_path, _with("lisa", active_layer=2))
    assert "optimiser: unknown key; did you mean optimizer?" in _error(tmp_path, {**BASE, "optimiser": {}})


def test_a_sections_key_without_its_section_is_named_with_it(tmp_path):
    with pytest.raises(LisaftError, match=r"--set max_steps: unknown key; did you mean training.max_steps\?"):
        load_recipe(write(tmp_path, BASE), ["max_steps=5"])


@pytest.mark.parametrize("override", ["optimizer.lr=nan", "optimizer.lr=.inf", "optimizer.lr=-.inf",
                                      "training.max_grad_norm=.inf", "optimizer.weight_decay=.nan",
                                      "scheduler.min_lr_ratio=nan"])
def test_non_finite_numbers_are_refused(tmp_path, override):
    key, value = override.split("=")
    with pytest.raises(LisaftError, match=f"--set {key}: must be a finite number, got -?(nan|inf)"):
        load_recipe(write(tmp_path, BASE), [override])


def test_messages_never_name_internal_classes(tmp_path):
    message = _error(tmp_path, {**BASE, "training": 5, "lisa": [1]})
    assert "Section" not in message
    assert "training: must be a section of keys (a YAML mapping), got int" in message


def test_yaml_errors_name_the_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  config: x\n data: [\n")
    with pytest.raises(LisaftError) as e:
        load_recipe(path)
    message = str(e.value)
    assert message.startswith(f"{path}: line 3, column 2: not valid YAML") and "<unicode string>" not in message


def test_max_steps_or_epochs(tmp_path):
    data = _with("training")
    del data["training"]["max_steps"]
    assert "set training.max_steps (optimizer steps) or training.epochs" in _error(tmp_path, data)
    data["training"]["epochs"] = 2
    assert load_recipe(write(tmp_path, data)).training.epochs == 2.0
    assert "training.epochs" in _error(tmp_path, {**data, "training": {**data["training"], "epochs": 0}})


def test_roles_map_only_onto_chat_roles(tmp_path):
    assert "data.roles: gpt: 'bot' is not one of system, user, assistant" in \
        _error(tmp_path, _with("data", roles={"gpt": "bot"}))


def test_an_unknown_value_is_named_with_the_choices(tmp_path):
    assert ("optimizer.name: 'adam_ultra' is not one of adamw_32bit, adamw_8bit, paged_adamw_32bit, "
            "paged_adamw_8bit") in _error(tmp_path, _with("optimizer", name="adam_ultra"))
    assert "scheduler.name: 'cosin' is not one of constant, linear, cosine; did you mean cosine?" in \
        _error(tmp_path, _with("scheduler", name="cosin"))
