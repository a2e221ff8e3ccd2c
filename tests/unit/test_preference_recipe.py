"""The recipe's preference section: each loss's defaults, and the combinations refused."""

import pytest

from lisaft.config.schema import PREFERENCE_BETA, load_recipe, recipe_from_dict
from lisaft.config.unused_keys import unused_keys
from lisaft.errors import LisaftError

BASE = {"model": {"config": "c", "tokenizer": "t"}, "data": {"train": "train.jsonl", "format": "preference"},
        "training": {"max_steps": 10, "output_dir": "run"}}


def _recipe(preference, **data):
    return recipe_from_dict({**BASE, "data": {**BASE["data"], **data}, "preference": preference})


def test_no_preference_section_is_sft():
    r = recipe_from_dict({**BASE, "data": {"train": "train.jsonl"}})
    assert r.preference is None and r.data.format == "text"


@pytest.mark.parametrize("loss, beta", [("dpo", 0.1), ("simpo", 2.0), ("orpo", 0.1)])
def test_each_loss_takes_its_own_beta_unless_given(loss, beta):
    assert PREFERENCE_BETA[loss] == beta
    r = _recipe({"loss": loss})
    assert r.preference.beta == beta and r.preference.gamma == 0.5 and r.preference.reference is None
    assert _recipe({"loss": loss, "beta": 0.3}).preference.beta == 0.3
    # The resolved recipe (a run's recipe.yaml) keeps the β it trained with.
    assert recipe_from_dict(r.model_dump(mode="json")).preference.beta == beta


def test_a_set_preference_section_gets_its_loss_default(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {config: c, tokenizer: t}\ndata: {train: x.jsonl, format: preference}\n"
                    "training: {max_steps: 1, output_dir: run}\n")
    r = load_recipe(path, ["preference.loss=simpo"])
    assert r.preference.loss == "simpo" and r.preference.beta == 2.0


@pytest.mark.parametrize("recipe, words", [
    (lambda: _recipe({"loss": "dpo"}, format="chat"), "set data.format: preference"),
    (lambda: recipe_from_dict(BASE), "data.format preference needs a preference section"),
    (lambda: _recipe({"loss": "simpo", "reference": "ref"}), "simpo uses none"),
    (lambda: _recipe({"loss": "orpo", "reference": "ref"}), "orpo uses none"),
    (lambda: _recipe({"loss": "dpo"}, packing=True), "data.packing cannot be combined"),
    # KTO exists since issue 47: an unknown loss is refused with the names, KTO on pairs with its data.
    (lambda: _recipe({"loss": "cpo"}), "'cpo' is not one of dpo, simpo, orpo, ipo, kto"),
    (lambda: _recipe({"loss": "kto"}), "kto trains on unpaired feedback: set data.format: feedback"),
    (lambda: recipe_from_dict({**BASE, "data": {"train": "t.jsonl", "format": "feedback"}}),
     "data.format feedback needs a preference section: preference.loss kto"),
    (lambda: _recipe({"loss": "dpo", "beta": 0}), "preference.beta"),
])
def test_impossible_combinations_are_refused_in_one_line(recipe, words):
    with pytest.raises(LisaftError, match=words) as e:
        recipe()
    assert "\n" not in str(e.value)


def test_dpo_takes_a_reference_and_gamma_off_simpo_is_named():
    assert _recipe({"loss": "dpo", "reference": "ref"}).preference.reference == "ref"
    (note,) = unused_keys(_recipe({"loss": "dpo", "gamma": 1.0}))
    assert note.startswith("preference.gamma (1) is ignored")
    assert unused_keys(_recipe({"loss": "simpo", "gamma": 1.0})) == []

