"""Keys a run would drop without a word are named when it starts."""

from lisaft.config.schema import recipe_from_dict
from lisaft.config.unused_keys import unused_keys

BASE = {"model": {"config": "c", "tokenizer": "t"}, "data": {"train": "train.jsonl", "eval": "eval.jsonl"},
        "optimizer": {}, "training": {"max_steps": 10, "output_dir": "run", "eval_every": 5}}


def _recipe(**sections):
    data = {k: dict(v) for k, v in BASE.items()}
    for section, values in sections.items():
        data[section].update(values)
    return recipe_from_dict(data)


def test_a_recipe_that_uses_every_key_gets_no_note():
    assert unused_keys(_recipe()) == []
    assert unused_keys(_recipe(training={"max_steps": None, "epochs": 2})) == []
    assert unused_keys(_recipe(data={"eval": None, "eval_fraction": 0.1})) == []
    assert unused_keys(_recipe(data={"eval": None}, training={"eval_every": 0})) == []


def test_epochs_next_to_max_steps_is_named():
    (note,) = unused_keys(_recipe(training={"epochs": 3}))
    assert note.startswith("training.epochs (3) is ignored: training.max_steps (10) is set too")


def test_eval_every_without_an_eval_set_is_named():
    (note,) = unused_keys(_recipe(data={"eval": None}))
    assert note.startswith("training.eval_every (5) is ignored: there is no eval set")


def test_apollo_keys_under_another_optimizer_are_named():
    assert unused_keys(_recipe(data={}, optimizer={"name": "apollo", "rank": 8, "update_proj_gap": 50})) == []
    (note,) = unused_keys(_recipe(optimizer={"name": "adamw_8bit", "rank": 8, "update_proj_gap": 50}))
    assert note == ("optimizer.rank, optimizer.update_proj_gap are ignored: only apollo and apollo_mini read them "
                    "(optimizer.name is adamw_8bit)")
