"""One process at a time in a run folder, and a run that trained to its end is always finished:
a second `lisaft train` or `lisaft resume` on a live run is refused in one line naming who holds
it (never with a command that would wipe it); a crashed process's lock blocks nothing; a run
complete without final/ gets final/ from `lisaft resume`."""

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from test_corrupt_checkpoint import _damage
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.run_folder import LOCK
from lisaft.train import train

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time\nfrom lisaft.run_folder import live\n"
        "with live(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n")


def _one_line(result, code: int) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, result.output
    return errors[0]


def _holder(run: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_run_is_refused_and_a_killed_ones_lock_blocks_nothing(tiny_run):
    recipe = tiny_run(training={"max_steps": 4, "save_every": 2, "eval_every": 0})
    assert train(recipe, show=False, _stop_at=2) == 3
    run = (tiny_run.dir / "run").resolve()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = _holder(run)
    try:
        for args in (["train", str(recipe), "--overwrite"], ["train", str(recipe)], ["resume", str(run)]):
            out = _one_line(runner.invoke(app, args), 2)
            assert f"{run} is live: lisaft process {proc.pid} on {socket.gethostname()} is training it" in out, out
            assert "--overwrite" not in out and "lisaft train" not in out, out
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
        assert (run / "recipe.yaml").is_file() and (run / "metrics.jsonl").is_file()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (run / LOCK).exists()  # what the killed process left: a file nobody holds
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 0, result.output
    assert (run / "final").is_dir() and not (run / LOCK).exists()


def test_a_new_run_folder_that_failed_to_start_is_not_left_behind(tiny_run):
    (tiny_run.dir / "bad.jsonl").write_text('{"instruction": "a"}\n')  # refused once set-up reads it
    recipe = tiny_run(data={"train": "bad.jsonl"})
    assert "missing field 'output'" in _one_line(runner.invoke(app, ["train", str(recipe)]), 2)
    assert not (tiny_run.dir / "run").exists()


def test_a_run_stopped_before_its_first_checkpoint_is_not_offered_to_resume(tiny_run):
    recipe = tiny_run(training={"max_steps": 4, "save_every": 0, "eval_every": 0})
    (tiny_run.dir / "run").mkdir()
    (tiny_run.dir / "run" / "recipe.yaml").write_text(recipe.read_text())  # a start that wrote only its recipe
    out = _one_line(runner.invoke(app, ["train", str(recipe)]), 2)
    assert "stopped before its first checkpoint" in out and "lisaft resume" not in out, out
    assert "--overwrite" in out


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {name: t for f in sorted(folder.glob("*.safetensors")) for name, t in load_file(f).items()}


def test_a_complete_run_without_final_is_finished_by_resume(tiny_run):
    recipe = tiny_run(training={"max_steps": 4, "save_every": 2, "keep_last": 2, "eval_every": 0})
    assert train(recipe, show=False) == 0
    run = (tiny_run.dir / "run").resolve()
    exported = _weights(run / "final")
    shutil.rmtree(run / "final")
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 0, result.output
    assert f"finishing {run}: trained to step 4; writing final/ from step-000004" in result.output
    finished = _weights(run / "final")
    assert finished.keys() == exported.keys()
    assert all(finished[k].equal(exported[k]) for k in exported)
    # With final/ there the run is complete; without it, a corrupt last checkpoint is not trusted.
    assert "the run is complete at step 4" in _one_line(runner.invoke(app, ["resume", str(run)]), 2)
    shutil.rmtree(run / "final")
    _damage(run / "checkpoints" / "step-000004" / "weights" / "head.safetensors", "garbled")
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 0, result.output
    assert "skipping checkpoint step-000004" in result.output and "from step-000002" in result.output
    again = _weights(run / "final")
    assert all(again[k].equal(exported[k]) for k in exported)


def test_reschedule_without_max_steps_is_refused(tiny_run):
    recipe = tiny_run(training={"max_steps": 4, "save_every": 2, "eval_every": 0})
    assert train(recipe, show=False, _stop_at=2) == 3
    out = _one_line(runner.invoke(app, ["resume", str(tiny_run.dir / "run"), "--reschedule"]), 2)
    assert "--reschedule" in out and "--max-steps" in out, out
