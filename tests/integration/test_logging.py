"""Logging backends: TensorBoard event files and an offline W&B run, across a resume."""

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.train import train
from lisaft.train.commands import resume

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


def _scalar_steps(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_tensorboard_and_wandb_continue_the_same_run_on_resume(tiny_run, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = tiny_run(logging={"backends": ["jsonl", "tensorboard", "wandb"]},
                      training={"save_every": 4, "max_steps": 8})
    assert train(recipe, show=False, _stop_at=6) != 0
    run = tiny_run.dir / "run"
    tb = run / "logs" / "tensorboard"
    assert _scalar_steps(tb, "train/loss") == [1, 2, 3, 4, 5, 6]
    first_id = json.loads((run / "logs" / "wandb-run.json").read_text())["id"]
    # As if killed after step 6 was logged but before its checkpoint: resume starts at step 4
    # and logs steps 5 and 6 again.
    shutil.rmtree(run / "checkpoints" / "step-000006")
    assert resume(run, show=False) == 0

    assert _scalar_steps(tb, "train/loss") == list(range(1, 9))
    assert _scalar_steps(tb, "eval/token_accuracy") == [0, 4, 8]
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # same folder: one TensorBoard run
    state = json.loads((run / "logs" / "wandb-run.json").read_text())
    assert state == {"id": first_id, "logged_through": {"train": 8, "eval": 8}}
    runs = sorted(p.name for p in (run / "logs" / "wandb").glob("offline-run-*"))
    # wandb names a run's folder by its start second and id, adding "-1" when a folder of that
    # second exists already (train and resume can start within one second).
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{first_id}(-\d+)?", name)
                                  for name in runs), runs


def test_wandb_skips_steps_it_already_has_after_a_resume(tiny_run, monkeypatch):
    """The steps the first process sent past the checkpoint are not sent twice."""
    from lisaft.config.schema import load_recipe
    from lisaft.metrics.log import RunLog

    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = load_recipe(tiny_run(logging={"backends": ["wandb"]}))
    run = tiny_run.dir / "run"
    with RunLog(run, recipe, start_step=0) as log:
        for step in range(1, 7):
            log.write({"step": step, "loss": 1.0 / step, "lr": 1e-3, "active_layers": [0, 1]})
        log.write({"step": 4, "eval_loss": 0.5, "eval_token_accuracy": 0.5})
    with RunLog(run, recipe, start_step=4) as log:  # resumed from the step-4 checkpoint
        sent = []
        real_log = log.backends[0].run.log
        monkeypatch.setattr(log.backends[0].run, "log",
                            lambda values, step: (sent.append((step, sorted(values))), real_log(values, step=step)))
        for step in range(5, 9):
            log.write({"step": step, "loss": 1.0 / step, "lr": 1e-3, "active_layers": [0, 1]})
        log.write({"step": 8, "eval_loss": 0.4, "eval_token_accuracy": 0.6})
    assert [s for s, _ in sent] == [7, 8, 8]
    assert sent[0][1] == ["train/loss", "train/lr"]
    assert sent[2][1] == ["eval/loss", "eval/token_accuracy"]


def test_missing_backend_package_names_the_extra_before_loading(tiny_run, monkeypatch):
    import lisaft.metrics.log

    monkeypatch.setitem(lisaft.metrics.log._NEEDS, "tensorboard", ("lisaft_no_such_module", "tensorboard"))
    recipe = tiny_run(logging={"backends": ["tensorboard"]})
    result = CliRunner().invoke(app, ["train", str(recipe)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "pip install 'lisaft[tensorboard]'" in lines[0], result.output
    assert not (tiny_run.dir / "run").exists()  # failed before anything was set up
