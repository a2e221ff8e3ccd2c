"""What stops a run or a resume that would silently train on nothing useful: a non-finite loss or
gradient norm, training data that changed since the checkpoint, and new steps at a zero LR."""

import json
import math
import re

import pytest
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.metrics.log import read_metrics
from lisaft.train import train

runner = CliRunner()


def _one_line(result, code: int) -> str:
    """The run's one error line (a train run prints its progress before it)."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and "warning" not in result.output, result.output
    assert result.output.count("error:") == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error:"), result.output
    return " ".join(last.split())


def test_a_nonfinite_step_stops_the_run_with_one_line_and_no_export(tiny_run):
    recipe = tiny_run(training={"max_steps": 6, "save_every": 1, "eval_every": 0})
    out = _one_line(runner.invoke(app, ["train", str(recipe), "--set", "optimizer.lr=1e30"]), 1)
    assert re.match(r"error: step \d+: (loss|gradient norm) (nan|inf)", out), out
    assert "Likely causes" in out and "optimizer.lr 1e+30" in out
    run = tiny_run.dir / "run"
    assert not (run / "final").exists()
    bad = int(re.match(r"error: step (\d+)", out).group(1))
    # Only the steps before the first non-finite one were checkpointed.
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1:] == \
        ([f"step-{bad - 1:06d}"] if bad > 1 else [])


def _poison(monkeypatch, when):
    """Every later train_step's forward multiplies the loss by when(call number) (1, nan or inf)."""
    import lisaft.train.loop as loop
    from lisaft.model.loss import token_loss_sum

    calls = [0]

    def forward(model, batch):
        calls[0] += 1
        return token_loss_sum(model, batch) * when(calls[0])

    real_step = loop.train_step
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: real_step(*a, forward=forward, **k))


def test_the_stop_names_the_checkpoint_kept_and_how_to_continue(tiny_run, monkeypatch):
    recipe = tiny_run(training={"max_steps": 6, "save_every": 2, "eval_every": 0})
    _poison(monkeypatch, lambda call: math.nan if call > 3 else 1.0)
    result = runner.invoke(app, ["train", str(recipe)])
    out = _one_line(result, 1)
    run = tiny_run.dir / "run"
    assert out.startswith("error: step 4: loss nan"), out
    assert "checkpoint step-000002 (written before it) is kept" in out
    assert f"lisaft resume {run} --set training.on_nonfinite=skip" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    assert not (run / "final").exists()
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r) == 3


def test_skip_drops_nonfinite_steps_and_counts_them(tiny_run, monkeypatch):
    recipe = tiny_run(training={"max_steps": 5, "eval_every": 0, "on_nonfinite": "skip"})
    _poison(monkeypatch, lambda call: math.inf if call == 2 else 1.0)
    assert train(recipe, show=False) == 0
    run = tiny_run.dir / "run"
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1, 1]
    assert _final_weights_finite(run)


def _final_weights_finite(run) -> bool:
    from safetensors.torch import load_file

    weights = load_file(str(next((run / "final").glob("*.safetensors"))))
    return all(bool(w.isfinite().all()) for w in weights.values())


def test_nonfinite_weights_are_never_checkpointed_or_exported(tiny_run, monkeypatch):
    import torch

    import lisaft.train.loop as loop
    from lisaft.model.loss import token_loss_sum

    recipe = tiny_run(training={"max_steps": 6, "save_every": 2, "eval_every": 0, "on_nonfinite": "skip"})
    calls = [0]

    def forward(model, batch):
        calls[0] += 1
        if calls[0] == 3:  # a weight turned NaN: this step's loss and every later one are NaN, and skipped
            with torch.no_grad():
                model.get_output_embeddings().weight[0, 0] = math.nan
        return token_loss_sum(model, batch)

    real_step = loop.train_step
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: real_step(*a, forward=forward, **k))
    out = _one_line(runner.invoke(app, ["train", str(recipe)]), 1)
    assert out.startswith("error: step 4: the weights hold NaN or inf (1 of "), out
    assert "lm_head.weight" in out and "checkpoint step-000002 (written before it) is kept" in out, out
    run = tiny_run.dir / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    assert not (run / "final").exists()


def test_a_run_whose_last_steps_were_all_skipped_says_so(tiny_run, monkeypatch):
    from lisaft.console import LisaftWarning

    recipe = tiny_run(training={"max_steps": 5, "eval_every": 0, "on_nonfinite": "skip"})
    _poison(monkeypatch, lambda call: math.nan if call > 3 else 1.0)
    with pytest.warns(LisaftWarning, match="every step since step 3 was skipped .*final/ holds the weights of step 3"):
        assert train(recipe, show=False) == 0
    assert _final_weights_finite(tiny_run.dir / "run")


def test_a_warmup_longer_than_the_run_is_warned(tiny_run):
    from lisaft.console import LisaftWarning

    recipe = tiny_run(training={"max_steps": 2, "eval_every": 0}, scheduler={"warmup_steps": 20})
    with pytest.warns(LisaftWarning, match="warmup_steps 20 is longer than the run .* 10% of optimizer.lr"):
        assert train(recipe, show=False) == 0


def test_a_gradient_norm_of_zero_for_many_steps_is_said_to_be_a_dead_run(tiny_run, monkeypatch):
    from lisaft.console import LisaftWarning

    recipe = tiny_run(training={"max_steps": 14, "eval_every": 0})
    _poison(monkeypatch, lambda call: 0.0 if call > 2 else 1.0)  # a zero loss: a gradient of exactly 0
    with pytest.warns(LisaftWarning) as seen:
        assert train(recipe, show=False) == 0
    said = [str(w.message) for w in seen if "exactly 0" in str(w.message)]
    assert len(said) == 2, said
    assert said[0].startswith("the gradient norm has been exactly 0 since step 3 (10 steps): the model no longer "
                              "learns"), said[0]
    assert "optimizer.lr" in said[0] and "final/ holds" in said[1], said


def test_skip_is_refused_with_the_update_in_backward(tiny_run):
    recipe = tiny_run(training={"on_nonfinite": "skip", "max_grad_norm": None},
                      optimizer={"in_backward": True})
    out = _one_line(runner.invoke(app, ["train", str(recipe)]), 2)
    assert "training.on_nonfinite" in out and "in_backward" in out


def _edit_train_data(folder, how: str) -> None:
    path = folder / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if how == "edit":
        rows[5]["output"] = rows[5]["output"] + "x"
    else:
        rows.reverse()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_resume_over_changed_data_is_refused_packed_or_not(tiny_run):
    for packing, how in ((False, "edit"), (False, "reverse"), (True, "edit")):
        name = f"run-{int(packing)}-{how}"
        recipe = tiny_run(f"{name}.yaml", data={"packing": packing},
                          training={"max_steps": 2, "eval_every": 0, "output_dir": name})
        train(recipe, show=False, _stop_at=1)
        original = (tiny_run.dir / "train.jsonl").read_text()
        _edit_train_data(tiny_run.dir, how)
        try:
            out = _one_line(runner.invoke(app, ["resume", str(tiny_run.dir / name)]), 2)
            assert out.startswith("error: data.train: the training data changed since the checkpoint"), out
            assert "--set training.accept_data_change=true" in out
            # Continuing on purpose: a warning, and the run goes on.
            result = runner.invoke(app, ["resume", str(tiny_run.dir / name), "--set",
                                         "training.accept_data_change=true"])
            assert result.exit_code == 0 and "continuing over the new data as asked" in result.output, result.output
        finally:
            (tiny_run.dir / "train.jsonl").write_text(original)


def test_a_moved_data_file_resumes_and_the_digest_decides(tiny_run):
    recipe = tiny_run(training={"max_steps": 2, "eval_every": 0})
    train(recipe, show=False, _stop_at=1)
    run = tiny_run.dir / "run"
    (tiny_run.dir / "train.jsonl").rename(tiny_run.dir / "moved.jsonl")
    moved = (tiny_run.dir / "moved.jsonl").read_text()
    (tiny_run.dir / "edited.jsonl").write_text(moved.replace('"output": "', '"output": "x', 1))
    out = _one_line(runner.invoke(app, ["resume", str(run), "--set", "data.train=edited.jsonl"]), 2)
    assert out.startswith("error: data.train: the training data changed since the checkpoint"), out
    result = runner.invoke(app, ["resume", str(run), "--set", "data.train=moved.jsonl"])
    assert result.exit_code == 0, result.output
    assert "changed: data.train" in result.output and "moved.jsonl" in result.output, result.output


def test_extending_past_a_zero_floor_is_refused_with_the_fix_named(tiny_run):
    recipe = tiny_run(training={"max_steps": 4, "eval_every": 0}, scheduler={"min_lr_ratio": 0.0})
    train(recipe, show=False, _stop_at=2)
    run = tiny_run.dir / "run"
    out = _one_line(runner.invoke(app, ["resume", str(run), "--max-steps", "6"]), 2)
    assert "reaches its floor of 0" in out and "pass --reschedule" in out, out
    assert runner.invoke(app, ["resume", str(run), "--max-steps", "6", "--reschedule"]).exit_code == 0
    lrs = [r["lr"] for r in read_metrics(run / "metrics.jsonl") if "lr" in r]
    assert all(lr > 0 for lr in lrs), lrs
    # Finished at a floor of 0: --reschedule would re-plan from 0 too; a new run from final/ is named.
    out = _one_line(runner.invoke(app, ["resume", str(run), "--max-steps", "8", "--reschedule"]), 2)
    assert "every new step would train at LR 0" in out and "model.name_or_path=" in out, out


def test_skip_with_the_step_on_the_cpu_and_its_host_rows(tiny_run, monkeypatch):
    recipe = tiny_run(optimizer={"name": "adamw_32bit", "lr": 1e-3, "cpu_offload": True},
                      training={"max_steps": 4, "eval_every": 0, "on_nonfinite": "skip"})
    _poison(monkeypatch, lambda call: math.nan if call == 3 else 1.0)
    result = runner.invoke(app, ["train", str(recipe)])
    assert result.exit_code == 0, result.output
    run = tiny_run.dir / "run"
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1]
    assert math.isfinite(records[-1]["loss"]) and _final_weights_finite(run)
    # The end-of-run table compares like with like. On a CPU device the host is the device: the
    # estimate counts the moments and accumulators in the device rows, so the held bytes stand
    # there (not 0 B beside an estimate), and the weights' host copy has its estimated row.
    rows = {line.split("│")[1].strip(): line.split("│")[2:4] for line in result.output.splitlines()
            if line.count("│") >= 4}
    assert "host: optimizer states" not in rows and "host: gradient accumulators" not in rows, result.output
    est, held = (cell.strip() for cell in rows["optimizer states"])
    assert est == held and held != "0 B", result.output  # float32 moments: the same bytes
    assert rows["gradients"][1].strip() not in ("0 B", "-"), result.output
    assert all(cell.strip() not in ("-", "0 B") for cell in rows["host: weight copies"]), result.output


def test_a_cpu_offload_run_whose_host_memory_exceeds_the_ram_is_refused_at_start(tiny_run, monkeypatch):
    from lisaft.memory import command

    recipe = tiny_run(optimizer={"name": "adamw_32bit", "cpu_offload": True}, training={"max_steps": 2})
    monkeypatch.setattr(command, "host_ram_bytes", lambda: 64 * 2**20)  # a 64 MiB machine
    out = _one_line(runner.invoke(app, ["train", str(recipe)]), 2)
    assert out.startswith("error: optimizer.cpu_offload: this run needs an estimated"), out
    assert "of RAM" in out and f"lisaft estimate-memory {recipe}" in out
    assert not (tiny_run.dir / "run").exists()  # refused before anything was written


def test_the_host_check_on_a_gpu_counts_the_host_table(monkeypatch):
    from pathlib import Path

    import pytest

    from lisaft.config.schema import load_recipe
    from lisaft.errors import LisaftError
    from lisaft.memory import command
    from lisaft.train.host_memory import check_host_memory

    full = Path(__file__).resolve().parents[2] / "recipes" / "llama3.1-8b-full-24gb.yaml"
    recipe = load_recipe(full, [])
    monkeypatch.setattr(command, "host_ram_bytes", lambda: 64 * 2**30)
    check_host_memory(recipe, "R", device="cuda")  # 48.7 GiB estimated: fits 64 GiB
    monkeypatch.setattr(command, "host_ram_bytes", lambda: 32 * 2**30)
    with pytest.raises(LisaftError, match=r"needs an estimated 4\d\.\d\d GiB of host memory \(3\d\.\d\d GiB of it "
                                          r"pinned.*has 32\.00 GiB of RAM"):
        check_host_memory(recipe, "R", device="cuda")
