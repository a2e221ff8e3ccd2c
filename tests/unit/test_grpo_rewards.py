"""GRPO's reward functions: found from a file, a module or lisaft's own; called as TRL calls
them; a reward that cannot load, raises, or returns the wrong thing stops with one line."""

import math

import pytest

from lisaft.config.grpo import GrpoSection
from lisaft.errors import LisaftError, RunFailed
from lisaft.grpo.rewards import exact_match, load_rewards, normalise_answer, score

WHERE = ["data.train: t.jsonl: line 1", "data.train: t.jsonl: line 1", "data.train: t.jsonl: line 2"]


def _load(funcs, **kw):
    return load_rewards(GrpoSection(reward_funcs=funcs, **kw))


def test_exact_match_normalises_both_sides_and_skips_rows_without_an_answer():
    assert normalise_answer("  The  Answer.\n") == "the answer"
    out = exact_match(["p"] * 4, ["42", " 42. ", "41", [{"role": "assistant", "content": "Yes"}]],
                      answer=["42", 42, "42", "yes"])
    assert out == [1.0, 1.0, 0.0, 1.0]
    assert exact_match(["p"], ["x"], answer=[None]) == [None]
    assert exact_match(["p"], ["x"]) == [None]


def test_a_reward_file_gets_trls_call_with_the_rows_columns_and_the_step(tmp_path):
    (tmp_path / "r.py").write_text(
        "def seen(prompts, completions, completion_ids, level, step, trainer_state, **kw):\n"
        "    assert trainer_state.global_step == step\n"
        "    return [float(len(c) + l + step) if l else None for c, l in zip(completions, level)]\n")
    (reward,) = _load([f"{tmp_path / 'r.py'}:seen"])
    s = score([reward], ["p", "p", "q"], ["ab", "abc", "a"], [[1, 2], [1, 2, 3], [1]],
              [{"level": 1}, {"level": 1}, {"level": 0}], WHERE, step=7)
    assert s.per_func[:, 0].tolist()[:2] == [10.0, 11.0] and math.isnan(s.per_func[2, 0].item())
    assert s.total.tolist()[:2] == [10.0, 11.0] and math.isnan(s.total[2].item())


def test_weights_sum_the_functions_and_none_of_one_leaves_the_others(tmp_path):
    rewards = _load(["exact_match", "regex"], regex=r"\d", reward_weights=[2.0, 0.5])
    s = score(rewards, ["p"] * 3, ["4", "x", "7"], [[1]] * 3, [{"answer": "4"}, {"answer": "4"}, {}], WHERE, 0)
    assert s.total.tolist() == [2.5, 0.0, 0.5]  # row 3: exact_match None, regex counts alone


def test_a_module_function_loads_by_its_dotted_name():
    (reward,) = _load(["lisaft.grpo.rewards:exact_match"])
    assert reward.func is exact_match and reward.name == "exact_match"


@pytest.mark.parametrize("spec, words", [
    ("nowhere.py:f", "file not found"),
    ("no_such_package_xyz.mod:f", "cannot import no_such_package_xyz.mod: ModuleNotFoundError"),
    ("lisaft.grpo.rewards:nothing", "has no function 'nothing'"),
    ("just_a_word", "is not FILE.py:FUNCTION"),
])
def test_a_reward_that_cannot_load_is_one_line(spec, words):
    with pytest.raises(LisaftError, match=words) as e:
        _load([spec])
    assert "\n" not in str(e.value)


def test_a_reward_file_that_fails_to_import_is_one_line(tmp_path):
    (tmp_path / "bad.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(LisaftError, match="importing .*bad.py failed: ModuleNotFoundError"):
        _load([f"{tmp_path / 'bad.py'}:f"])


@pytest.mark.parametrize("body, words", [
    ("return [1.0 / (len(c) - 1) for c in completions]", "grpo reward f raised on data.train: t.jsonl: line 2: "
                                                         "ZeroDivisionError"),
    ("return [1.0]", "grpo reward f returned 1 rewards for 3 completions"),
    ("return [1.0, float('nan'), 1.0]", "grpo reward f returned nan on data.train: t.jsonl: line 1 (completion 1)"),
    ("return [1.0, 1.0, 'x']", "returned 'x' on data.train: t.jsonl: line 2 (completion 2)"),
    ("return 3", "returned int, not a list of 3 numbers"),
])
def test_a_reward_that_misbehaves_stops_the_run_naming_itself_and_the_row(tmp_path, body, words):
    (tmp_path / "r.py").write_text(f"def f(prompts, completions, **kw):\n    {body}\n")
    (reward,) = _load([f"{tmp_path / 'r.py'}:f"])
    with pytest.raises(RunFailed) as e:
        score([reward], ["p"] * 3, ["ab", "ab", "a"], [[1]] * 3, [{}] * 3, WHERE, 0)
    assert words in str(e.value)
