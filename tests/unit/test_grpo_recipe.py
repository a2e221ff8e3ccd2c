"""The recipe's grpo section and data.format prompts: TRL's defaults, the generation batch's
arithmetic, the combinations refused, reward paths, and what a prompt row becomes."""

import json
from pathlib import Path

import pytest

from lisaft.config.grpo import GrpoSection, generation_shape
from lisaft.config.schema import load_recipe, recipe_from_dict
from lisaft.data.formats import data_format
from lisaft.data.formats.base import IGNORE_INDEX
from lisaft.data.read import Rows
from lisaft.errors import LisaftError

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tokenizer"
BASE = {"model": {"config": "c", "tokenizer": "t"}, "data": {"train": "train.jsonl", "format": "prompts"},
        "training": {"max_steps": 10, "output_dir": "run", "batch_size": 8},
        "grpo": {"reward_funcs": ["exact_match"]}}


def _recipe(grpo=None, training=None, **data):
    return recipe_from_dict({**BASE, "data": {**BASE["data"], **data},
                             "training": {**BASE["training"], **(training or {})},
                             "grpo": {**BASE["grpo"], **(grpo or {})}})


def test_the_defaults_are_trls():
    trl_config = pytest.importorskip("trl.trainer.grpo_config")
    import dataclasses

    theirs = {f.name: f.default for f in dataclasses.fields(trl_config.GRPOConfig)}
    ours = _recipe().grpo
    for name in ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "beta", "epsilon",
                 "epsilon_high", "num_iterations", "steps_per_generation", "loss_type", "scale_rewards",
                 "mask_truncated_completions", "reward_weights", "use_bias_correction_kl"):
        assert getattr(ours, name) == theirs[name], name


def test_a_generation_batch_that_is_not_whole_groups_shows_the_arithmetic_and_the_nearest_sizes():
    with pytest.raises(LisaftError) as e:
        _recipe(training={"batch_size": 6, "grad_accum_steps": 1})
    said = str(e.value)
    assert "training.batch_size 6 x steps_per_generation (= training.grad_accum_steps) 1 = 6" in said
    assert "not a multiple of 8" in said and "set training.batch_size to 8" in said
    assert "grpo.num_generations to 2 or 3 or 6" in said and "\n" not in said
    # 3 x 4 micro-batches = 12: not whole groups of 8; 2 and 4 are the nearest batch sizes.
    with pytest.raises(LisaftError, match="set training.batch_size to 2 or 4"):
        generation_shape(GrpoSection(reward_funcs=["exact_match"]), 3, 4)
    shape = generation_shape(GrpoSection(reward_funcs=["exact_match"], num_generations=4), 2, 4)
    assert (shape.completions, shape.prompts, shape.steps_per_generation) == (8, 2, 4)
    spg = GrpoSection(reward_funcs=["exact_match"], num_generations=4, steps_per_generation=2)
    assert generation_shape(spg, 2, 8).prompts == 1


@pytest.mark.parametrize("change, words", [
    ({"data": {"train": "t.jsonl", "format": "text"}}, "set data.format: prompts"),
    ({"grpo": None}, "data.format prompts needs a grpo section"),
    ({"preference": {"loss": "dpo"}}, "a recipe trains one stage"),
    ({"data": {"train": "t.jsonl", "format": "prompts", "packing": True}}, "data.packing cannot be combined"),
    ({"grpo": {"reward_funcs": ["exact_match"], "reward_weights": [1.0, 2.0]}}, "2 weights for 1 reward_funcs"),
    ({"grpo": {"reward_funcs": ["regex"]}}, "set grpo.regex"),
    ({"grpo": {"reward_funcs": ["regex"], "regex": "(("}}, "not a valid regular expression"),
    ({"grpo": {"reward_funcs": ["exact_match"], "num_generations": 1}}, "greater than or equal to 2"),
    ({"grpo": {"reward_funcs": []}}, "at least 1"),
])
def test_impossible_grpo_recipes_are_refused_in_one_line(change, words):
    with pytest.raises(LisaftError) as e:
        recipe_from_dict({**BASE, **change})
    assert words in str(e.value) and "\n" not in str(e.value).strip()


def test_reward_files_resolve_against_the_recipes_folder_and_modules_stay(tmp_path):
    path = tmp_path / "sub" / "r.yaml"
    path.parent.mkdir()
    path.write_text(json.dumps({**BASE, "grpo": {"reward_funcs": ["rewards.py:score", "pkg.mod:fn", "exact_match"]}}))
    r = load_recipe(path)
    assert r.grpo.reward_funcs == [f"{(tmp_path / 'sub' / 'rewards.py').resolve()}:score", "pkg.mod:fn",
                                   "exact_match"]
    # The run's own recipe.yaml keeps the absolute path, so a resume finds the same file.
    assert recipe_from_dict(r.model_dump(mode="json")).grpo.reward_funcs == r.grpo.reward_funcs


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def test_a_string_prompt_is_its_tokens_with_no_loss_and_its_other_fields_kept():
    tok = _tokenizer()
    rows = Rows([{"prompt": "ab", "answer": "ba", "level": 3}], "data.train", "t.jsonl", "line")
    (ex,) = data_format("prompts").examples(rows, tok, None, {})
    assert ex["input_ids"] == tok("ab")["input_ids"] and set(ex["labels"]) == {IGNORE_INDEX}
    assert ex["prompt"] == "ab" and ex["columns"] == {"answer": "ba", "level": 3}
    assert ex["where"] == "data.train: t.jsonl: line 1"


def test_a_message_prompt_renders_with_the_generation_prompt():
    tok = _tokenizer()
    turns = [{"role": "user", "content": "hi"}]
    rows = Rows([{"prompt": turns, "answer": "x"}], "data.train", "t.jsonl", "line")
    (ex,) = data_format("prompts").examples(rows, tok, None, {})
    text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert ex["input_ids"] == tok(text, add_special_tokens=False)["input_ids"] and ex["prompt"] == turns


def test_a_prompt_that_fills_max_seq_len_is_refused_naming_its_row():
    tok = _tokenizer()
    rows = Rows([{"prompt": "ab"}, {"prompt": "abcdefgh"}], "data.train", "t.jsonl", "line")
    fmt = data_format("prompts")
    with pytest.raises(LisaftError, match="line 2: the prompt fills data.max_seq_len=6"):
        fmt.fitted(fmt.examples(rows, tok, None, {}), 6, rows)
    with pytest.raises(LisaftError, match="line 1: the prompt is empty"):
        fmt.examples(Rows([{"prompt": " "}], "data.train", "t.jsonl", "line"), tok, None, {})
