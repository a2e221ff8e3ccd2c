"""A write that fails for real (the kernel's file-size limit, which fails writes with EFBIG the
way a full disk fails them with ENOSPC) ends in one message: exit 1, what is intact, the resume
command, no temporary left behind."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lisaft.config.schema import load_recipe
from lisaft.metrics.log import read_metrics

DRIVER = Path(__file__).with_name("file_size_limit.py")
REPO = Path(__file__).resolve().parents[2]


def _with_failure(phase: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, str(DRIVER), phase, *args],
                          capture_output=True, text=True, env=env, timeout=300)


def _train_with_failure(recipe: Path, phase: str) -> subprocess.CompletedProcess:
    return _with_failure(phase, "train", str(recipe), "--set", "training.save_every=4")


def _one_failure_line(result) -> str:
    out = (result.stdout + result.stderr)
    assert result.returncode == 1, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    return errors[0]


@pytest.mark.parametrize("phase, what, intact", [
    ("checkpoint", "checkpoint step-000008", "step-000004"),
    ("final", "the final model", "step-000008"),
    ("metrics", "to ", "step-000004"),
])
@pytest.mark.slow
def test_a_real_write_failure_is_one_message(tiny_run, phase, what, intact):
    recipe = tiny_run(training={"eval_every": 0})
    message = _one_failure_line(_train_with_failure(recipe, phase))
    run = tiny_run.dir / "run"
    assert f"could not write {what}" in message and "File too large" in message, message
    assert f"{intact}, is intact" in message and f"lisaft resume {run}" in message, message
    if phase == "metrics":
        assert f"File too large ({run / 'metrics.jsonl'})" in message, message
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == sorted({"step-000004", intact}), names  # no .tmp-* left
    assert not (run / ".final.tmp").exists() and not (run / "final").exists()


@pytest.mark.slow
def test_resume_that_cannot_rewrite_metrics_keeps_them_and_stays_resumable(tiny_run):
    from lisaft.train import train
    from lisaft.train.commands import resume

    recipe = tiny_run(training={"eval_every": 0, "save_every": 4})
    assert train(recipe, show=False) == 0
    run = tiny_run.dir / "run"
    # A crash after step 8 was logged but before its checkpoint: resume drops records 5-8.
    shutil.rmtree(run / "checkpoints" / "step-000008")
    metrics = (run / "metrics.jsonl").read_bytes()
    message = _one_failure_line(_with_failure("truncate", "resume", str(run)))
    assert "File too large" in message and str(run / "metrics.jsonl") in message, message
    assert "step-000004, is intact" in message and f"lisaft resume {run}" in message, message
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert not (run / "metrics.jsonl.tmp").exists() and not (run / ".recipe.yaml.tmp").exists()
    assert resume(run, show=False) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == list(range(1, 9))


@pytest.mark.slow
def test_train_that_cannot_write_its_recipe_names_the_one_to_start_over_with(tiny_run):
    recipe = tiny_run(training={"eval_every": 0})
    run = tiny_run.dir / "run"
    message = _one_failure_line(_with_failure("start", "train", str(recipe)))
    assert f"File too large ({run / 'recipe.yaml'})" in message, message
    assert f"`lisaft train {recipe} --overwrite`" in message, message
    assert not (run / ".recipe.yaml.tmp").exists() and not (run / "recipe.yaml").exists()
    # Starting over from the run's own copy: --overwrite keeps that copy until it is replaced.
    run.mkdir(exist_ok=True)  # the failed start removed the folder it had created
    (run / "recipe.yaml").write_text(load_recipe(recipe).to_yaml())  # what train writes there
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    message = _one_failure_line(_with_failure("start", "train", str(run / "recipe.yaml"), "--overwrite"))
    assert f"`lisaft train {run / 'recipe.yaml'} --overwrite`" in message, message
    assert (run / "recipe.yaml").is_file() and not (run / "metrics.jsonl").exists()


@pytest.mark.slow
def test_resume_that_cannot_offload_optimizer_state_does_not_skip_the_checkpoint(tiny_run):
    from lisaft.train import train

    # A positive LR floor: extending a run whose curve ended at 0 is refused before anything loads.
    recipe = tiny_run(training={"eval_every": 0, "save_every": 4}, lisa={"state_policy": "offload_disk"},
                      scheduler={"min_lr_ratio": 0.1})
    assert train(recipe, show=False) == 0
    run = tiny_run.dir / "run"
    # Loading step-000008 writes the inactive layers' moments to lisa_offload/, and that fails:
    # neither step-000008 nor step-000004 is to blame, so neither is skipped.
    result = _with_failure("offload", "resume", str(run), "--max-steps", "12")
    message = _one_failure_line(result)
    assert "skipping checkpoint" not in result.stdout + result.stderr, message
    assert message.startswith(f"error: could not write to {run}: "), message
    assert "step-000008, is intact" in message and f"lisaft resume {run}" in message, message


def test_a_failure_before_the_first_checkpoint_names_the_recipe_that_was_passed(tiny_run):
    recipe = tiny_run(training={"eval_every": 0})
    message = _one_failure_line(_with_failure("metrics", "train", str(recipe), "--set", "training.save_every=0"))
    assert "no checkpoint was completed" in message, message
    assert f"`lisaft train {recipe} --overwrite`" in message, message
