"""A write that fails for real (the kernel's file-size limit, which fails writes with EFBIG the
way a full disk fails them with ENOSPC) ends in one message: exit 1, what is intact, the resume
command, no temporary left behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("file_size_limit.py")
REPO = Path(__file__).resolve().parents[2]


def _train_with_failure(recipe: Path, phase: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, str(DRIVER), phase, str(recipe), "--set", "training.save_every=4"],
        capture_output=True, text=True, env=env, timeout=300)


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
def test_a_real_write_failure_is_one_message(tiny_run, phase, what, intact):
    recipe = tiny_run(training={"eval_every": 0})
    message = _one_failure_line(_train_with_failure(recipe, phase))
    run = tiny_run.dir / "run"
    assert f"could not write {what}" in message and "File too large" in message, message
    assert f"{intact}, is intact" in message and f"lisaft resume {run}" in message, message
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == sorted({"step-000004", intact}), names  # no .tmp-* left
    assert not (run / ".final.tmp").exists() and not (run / "final").exists()
