"""A run folder copied before its first checkpoint keeps a recipe.yaml that names the original
folder: no command lisaft prints, and no --overwrite, may delete that other run (issue 52)."""

import re
import shlex
import shutil
from pathlib import Path

from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.train import train

runner = CliRunner()


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def copied_before_first_checkpoint(tiny_run) -> tuple[Path, Path]:
    assert train(tiny_run(training={"max_steps": 2, "eval_every": 0}), show=False) == 0
    orig = tiny_run.dir / "run"
    backup = tiny_run.dir / "backup"
    shutil.copytree(orig, backup, symlinks=True)
    shutil.rmtree(backup / "checkpoints")  # as copied before the first checkpoint was written
    return orig, backup


def test_the_printed_hint_restarts_the_copy_and_leaves_the_original(tiny_run):
    orig, backup = copied_before_first_checkpoint(tiny_run)
    before = snapshot(orig)
    result = runner.invoke(app, ["resume", str(backup)])
    assert result.exit_code == 2 and "no complete checkpoint" in result.output, result.output
    hint = re.search(r"`(lisaft train [^`]*)`", " ".join(result.output.split()))
    assert hint is not None, result.output
    args = shlex.split(hint.group(1))[1:]
    followed = runner.invoke(app, args)
    assert followed.exit_code == 0, followed.output
    assert snapshot(orig) == before  # the original run, byte for byte
    assert (backup / "checkpoints").is_dir() and (backup / "final").is_dir()


def test_overwrite_with_a_copied_recipe_refuses_to_replace_the_original(tiny_run):
    orig, backup = copied_before_first_checkpoint(tiny_run)
    before = snapshot(orig)
    result = runner.invoke(app, ["train", str(backup / "recipe.yaml"), "--overwrite"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"training.output_dir={backup}" in text and "another run" in text, text
    assert snapshot(orig) == before


def test_overwrite_of_a_runs_own_folder_is_not_refused(tiny_run):
    assert train(tiny_run(training={"max_steps": 1, "eval_every": 0}), show=False) == 0
    result = runner.invoke(app, ["train", str(tiny_run.dir / "run" / "recipe.yaml"), "--overwrite",
                                 "--set", "training.max_steps=2"])
    assert result.exit_code == 0, result.output
