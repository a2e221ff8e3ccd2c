"""`lisaft resume` on something it cannot resume: each case says what it is and what to do."""

import pytest
import yaml

from lisaft.checkpoint.missing import nothing_left, run_recipe_file
from lisaft.errors import LisaftError


def _error(path) -> str:
    with pytest.raises(LisaftError) as e:
        run_recipe_file(path)
    return str(e.value)


def test_a_missing_folder_a_recipe_file_and_a_folder_that_is_no_run_are_told_apart(tmp_path):
    assert _error(tmp_path / "nope").startswith(f"{tmp_path / 'nope'}: no such folder")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"config": "c", "tokenizer": "t"}, "data": {"train": "t.jsonl"},
                                      "training": {"max_steps": 3, "output_dir": "runs/a"}}))
    assert _error(recipe) == (f"{recipe} is a recipe file; resume takes the run folder it trains into: "
                              f"`lisaft resume {tmp_path / 'runs' / 'a'}`")
    (tmp_path / "notes.txt").write_text("x")
    assert "is a file; resume takes the run folder" in _error(tmp_path / "notes.txt")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "recipe.yaml").write_text("{}")
    assert _error(tmp_path / "runs") == f"{tmp_path / 'runs'}: not a lisaft run (no recipe.yaml in it); runs in it: a"
    assert run_recipe_file(tmp_path / "runs" / "a") == tmp_path / "runs" / "a" / "recipe.yaml"


def test_a_stopped_run_is_not_called_complete():
    assert nothing_left("run", 89, 500, None) is None
    assert str(nothing_left("run", 89, 50, 50)) == \
        "--max-steps 50 is not past the newest checkpoint, at step 89; give a larger N to train further"
    assert str(nothing_left("run", 500, 500, None)) == \
        "run: the run is complete at step 500 of 500; pass --max-steps N (N > 500) to train further"
