"""Exact resume: a stopped and resumed run is the same run, bit for bit, on CPU."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.metrics.log import read_metrics
from lisaft.train import train
from lisaft.train.commands import resume

runner = CliRunner()


def losses(run: Path) -> dict[int, float]:
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"duplicate or unordered steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in records}


def evals(run: Path) -> dict[int, float]:
    records = [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    assert len({r["step"] for r in records}) == len(records), "duplicate eval records"
    return {r["step"]: r["eval_loss"] for r in records}


def final_weights(run: Path) -> dict:
    out = {}
    for f in sorted((run / "final").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_run(a: Path, b: Path) -> None:
    assert losses(a) == losses(b)
    assert evals(a) == evals(b)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].equal(wb[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["discard", "offload_cpu", "offload_disk", "keep"])
@pytest.mark.parametrize("stop_at, accum", [(4, 1), (3, 2)], ids=["mid-interval", "boundary-accum2"])
def test_stop_and_resume_is_bit_identical(tiny_run, policy, stop_at, accum):
    common = dict(lisa={"state_policy": policy, "interval_steps": 3},
                  training={"max_steps": 7, "grad_accum_steps": accum, "eval_every": 3})
    ref = tiny_run("ref.yaml", **common)
    ref_code = train(ref, overrides=["training.output_dir=ref"], show=False)
    assert ref_code == 0
    cut = tiny_run("cut.yaml", **common)
    assert train(cut, overrides=["training.output_dir=cut"], show=False, _stop_at=stop_at) != 0
    assert max(losses(tiny_run.dir / "cut")) == stop_at
    assert resume(tiny_run.dir / "cut", show=False) == 0
    assert_same_run(tiny_run.dir / "ref", tiny_run.dir / "cut")


def test_cyclic_sampling_resumes_mid_cycle_bit_identically(tiny_run):
    # γ=1 of 4 layers, K=2: a cycle is 4 intervals (8 steps); stopping at step 5 is inside the
    # third interval of the first cycle.
    common = dict(lisa={"active_layers": 1, "interval_steps": 2, "sampling": "cyclic"},
                  training={"max_steps": 10, "eval_every": 5})
    assert train(tiny_run("ref.yaml", **common), overrides=["training.output_dir=ref"], show=False) == 0
    cut = tiny_run("cut.yaml", **common)
    assert train(cut, overrides=["training.output_dir=cut"], show=False, _stop_at=5) != 0
    assert resume(tiny_run.dir / "cut", show=False) == 0
    assert_same_run(tiny_run.dir / "ref", tiny_run.dir / "cut")
    records = [r for r in read_metrics(tiny_run.dir / "cut" / "metrics.jsonl") if "loss" in r]
    first_cycle = {i for r in records if r["step"] <= 8 for i in r["active_layers"]}
    assert first_cycle == {0, 1, 2, 3}


@pytest.mark.parametrize("policy", ["discard", "offload_cpu", "offload_disk", "keep"])
@pytest.mark.parametrize("name", ["adamw_32bit", "paged_adamw_8bit"])
def test_bf16_stochastic_rounding_resumes_bit_identically(tiny_run, policy, name):
    # The rounding noise is a function of the run's position, so nothing of it needs saving;
    # a learning rate small enough that most updates are below a bf16 step makes the noise matter.
    common = dict(model={"dtype": "bfloat16"}, optimizer={"name": name, "lr": 2e-5},
                  lisa={"state_policy": policy, "interval_steps": 2},
                  training={"max_steps": 6, "eval_every": 3})
    ref = tiny_run("ref.yaml", **common)
    assert train(ref, overrides=["training.output_dir=ref"], show=False) == 0
    if policy == "discard":  # the rounding is the optimizer's, whatever the policy: once per optimizer
        nearest = tiny_run("nearest.yaml", **{**common, "optimizer": {**common["optimizer"], "bf16_update": "nearest"}})
        assert train(nearest, overrides=["training.output_dir=nearest"], show=False) == 0
        wr, wn = final_weights(tiny_run.dir / "ref"), final_weights(tiny_run.dir / "nearest")
        assert any(not wr[k].equal(wn[k]) for k in wr)  # the rounding mode is really in effect
    cut = tiny_run("cut.yaml", **common)
    assert train(cut, overrides=["training.output_dir=cut"], show=False, _stop_at=3) != 0
    assert resume(tiny_run.dir / "cut", show=False) == 0
    assert_same_run(tiny_run.dir / "ref", tiny_run.dir / "cut")


def test_resume_refuses_path_change_and_reports_cadence(tiny_run):
    recipe = tiny_run(training={"max_steps": 6})
    train(recipe, show=False, _stop_at=2)
    run = tiny_run.dir / "run"
    result = runner.invoke(app, ["resume", str(run), "--set", "lisa.active_layers=3"])
    assert result.exit_code == 2
    assert "lisa.active_layers" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["resume", str(run), "--set", "training.seed=5"])
    assert result.exit_code == 2 and "training.seed" in result.output
    result = runner.invoke(app, ["resume", str(run), "--max-steps", "4", "--set", "training.log_every=2"])
    assert result.exit_code == 0, result.output
    assert "training.max_steps" in result.output and "training.log_every" in result.output
    assert sorted(losses(run)) == [1, 2, 4]


def test_resume_extends_a_finished_run_and_refuses_without_more_steps(tiny_run):
    recipe = tiny_run(training={"max_steps": 3}, scheduler={"min_lr_ratio": 0.1})
    assert train(recipe, show=False) == 0
    run = tiny_run.dir / "run"
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 2 and "the run is complete at step 3 of 3; pass --max-steps N (N > 3)" in \
        " ".join(result.output.split())
    # A --max-steps not past the checkpoint is named as such: the run is not called complete.
    result = runner.invoke(app, ["resume", str(run), "--max-steps", "2"])
    assert result.exit_code == 2 and "--max-steps 2 is not past the newest checkpoint, at step 3" in \
        " ".join(result.output.split())
    assert runner.invoke(app, ["resume", str(run), "--max-steps", "5"]).exit_code == 0
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]


def _lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(run / "metrics.jsonl") if "lr" in r}


def test_changing_max_steps_on_resume_keeps_the_lr_curve_unless_replanned(tiny_run):
    common = dict(scheduler={"name": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.1},
                  training={"max_steps": 10, "eval_every": 0})
    ref = tiny_run("ref.yaml", **common)
    assert train(ref, overrides=["training.output_dir=ref"], show=False) == 0
    reference = _lrs(tiny_run.dir / "ref")

    # Stopped at 5 of 10 and resumed to 7: the steps follow the 10-step curve exactly.
    short = tiny_run("short.yaml", **common)
    train(short, overrides=["training.output_dir=short"], show=False, _stop_at=5)
    result = runner.invoke(app, ["resume", str(tiny_run.dir / "short"), "--max-steps", "7"])
    assert result.exit_code == 0 and "saved curve planned for 10 steps" in result.output, result.output
    assert _lrs(tiny_run.dir / "short") == {k: v for k, v in reference.items() if k <= 7}

    # A finished run extended to 13: the LR stays at its floor instead of rising again.
    run = tiny_run.dir / "ref"
    result = runner.invoke(app, ["resume", str(run), "--max-steps", "13"])
    assert result.exit_code == 0 and "stays at its floor" in result.output, result.output
    lrs = _lrs(run)
    floor = 3e-3 * 0.1
    assert all(abs(lrs[k] - floor) < 1e-12 for k in (11, 12, 13)) and lrs[10] == reference[10]

    # --reschedule re-plans from where the run stands: no jump at the seam, the floor at the end.
    cut = tiny_run("cut.yaml", **common)
    train(cut, overrides=["training.output_dir=cut"], show=False, _stop_at=5)
    result = runner.invoke(app, ["resume", str(tiny_run.dir / "cut"), "--max-steps", "20", "--reschedule"])
    assert result.exit_code == 0 and "re-planned" in result.output, result.output
    lrs = _lrs(tiny_run.dir / "cut")
    assert lrs[6] == reference[6]  # step 6 runs at the LR the run had reached: no jump
    # the floor is reached one step after the last, so the last step still trains
    assert all(lrs[k + 1] < lrs[k] for k in range(6, 20)) and floor < lrs[20] < 1.1 * floor
    assert lrs[7] > reference[7]  # the decay is stretched over the longer run


def test_corrupt_newest_checkpoint_is_skipped(tiny_run):
    common = dict(training={"max_steps": 8, "save_every": 2, "keep_last": 3})
    assert train(tiny_run("ref.yaml", **common), overrides=["training.output_dir=ref"], show=False) == 0
    cut = tiny_run("cut.yaml", **common)
    assert train(cut, overrides=["training.output_dir=cut"], show=False, _stop_at=6) != 0
    run = tiny_run.dir / "cut"
    opt = run / "checkpoints" / "step-000006" / "optimizer" / "head.pt"
    # Same size, so the completeness check passes and only loading it can tell.
    data = bytearray(opt.read_bytes())
    data[:64] = bytes(64)
    opt.write_bytes(bytes(data))
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 0, result.output
    assert "skipping checkpoint step-000006: cannot be loaded" in result.output
    assert "from step-000004" in result.output
    assert_same_run(run, tiny_run.dir / "ref")


def test_no_complete_checkpoint_says_how_to_start_over(tiny_run):
    recipe = tiny_run(training={"max_steps": 2})
    assert train(recipe, show=False) == 0
    run = tiny_run.dir / "run"
    for c in (run / "checkpoints").iterdir():
        (c / "COMPLETE").unlink()
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 2
    assert "no complete checkpoint" in result.output and "--overwrite" in result.output


def test_unchanged_layers_are_hard_linked_between_checkpoints(tiny_run):
    recipe = tiny_run(lisa={"active_layers": 1, "interval_steps": 10}, scheduler={"min_lr_ratio": 0.1},
                      training={"max_steps": 4, "save_every": 2, "keep_last": 5})
    assert train(recipe, show=False) == 0
    ck = tiny_run.dir / "run" / "checkpoints"
    first, second = ck / "step-000002" / "weights", ck / "step-000004" / "weights"
    linked = [f.name for f in second.iterdir() if f.stat().st_ino == (first / f.name).stat().st_ino]
    # Three of four layers were frozen throughout; embeddings and head trained.
    assert len(linked) == 3 and all(n.startswith("layer-") for n in linked)
    # Pruning the older checkpoint leaves the newer loadable.
    import shutil
    shutil.rmtree(ck / "step-000002")
    assert runner.invoke(app, ["resume", str(tiny_run.dir / "run"), "--max-steps", "5"]).exit_code == 0


def _spawn(recipe: Path, *extra: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lisaft", "train", str(recipe), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def _wait_for(predicate, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.stdout.read()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("timed out")


def test_sigterm_checkpoints_and_says_how_to_resume(tiny_run):
    recipe = tiny_run(training={"max_steps": 100000, "eval_every": 0, "save_every": 0})
    metrics = tiny_run.dir / "run" / "metrics.jsonl"
    proc = _spawn(recipe)
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "lisaft resume" in out and "SIGTERM" in out
    steps = sorted(losses(tiny_run.dir / "run"))
    ckpts = [p.name for p in (tiny_run.dir / "run" / "checkpoints").iterdir()]
    assert ckpts == [f"step-{steps[-1]:06d}"]


def test_sigkill_while_writing_a_checkpoint_leaves_the_run_resumable(tiny_run):
    common = {"max_steps": 6, "save_every": 2, "eval_every": 0}
    ref = tiny_run("ref.yaml", training={**common, "output_dir": "ref"})
    assert train(ref, show=False) == 0
    recipe = tiny_run(training=common)
    run = tiny_run.dir / "run"
    paused = run / "checkpoints" / "PAUSED"
    # step-000002 completes; the process is killed inside the write of step-000004, with every
    # file written but the completion marker.
    proc = _spawn(recipe, env={"LISAFT_TEST_PAUSE_BEFORE_MARKER": "4:60"})
    _wait_for(paused.exists, proc)
    proc.kill()
    proc.wait()
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step-000002" in names and "step-000004" not in names
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 0, result.output
    assert "from step-000002" in result.output
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert losses(run) == losses(tiny_run.dir / "ref")
    assert_same_run(run, tiny_run.dir / "ref")


def test_out_of_memory_says_what_to_do_and_resumes_with_checkpointing(tiny_run, monkeypatch):
    import torch

    import lisaft.train.loop as loop

    recipe = tiny_run(training={"max_steps": 6, "save_every": 2, "eval_every": 0})
    real_step = loop.train_step

    def step_or_oom(session, step, **kw):
        if step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_step(session, step, **kw)

    monkeypatch.setattr(loop, "train_step", step_or_oom)
    result = runner.invoke(app, ["train", str(recipe)])
    assert result.exit_code == 1, result.output
    out = result.output
    assert "out of memory in step 4" in out and "lisaft estimate-memory" in out and "Traceback" not in out
    assert "--set model.gradient_checkpointing=true" in out and "step-000002" in out
    monkeypatch.setattr(loop, "train_step", real_step)
    run = tiny_run.dir / "run"
    result = runner.invoke(app, ["resume", str(run), "--set", "model.gradient_checkpointing=true"])
    assert result.exit_code == 0, result.output
    assert "model.gradient_checkpointing False -> True" in result.output
    assert sorted(losses(run)) == [1, 2, 3, 4, 5, 6]


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tiny_run, monkeypatch):
    import errno

    import lisaft.checkpoint.checkpointer as ckpt_mod

    recipe = tiny_run(training={"max_steps": 6, "save_every": 2, "eval_every": 0})
    real_save = ckpt_mod.save_file

    def save_or_fail(tensors, path, metadata=None):
        if "step-000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(ckpt_mod, "save_file", save_or_fail)
    result = runner.invoke(app, ["train", str(recipe)])
    assert result.exit_code == 1, result.output
    assert "No space left on device" in result.output and "step-000002" in result.output
    assert "lisaft resume" in result.output and "Traceback" not in result.output
    run = tiny_run.dir / "run"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]
    monkeypatch.setattr(ckpt_mod, "save_file", real_save)
    assert runner.invoke(app, ["resume", str(run)]).exit_code == 0
    assert sorted(losses(run)) == [1, 2, 3, 4, 5, 6]


def _rewrite_state(ckpt: Path, state: dict) -> None:
    """Replace a checkpoint's state.json and its size and checksum in the completion marker, as the
    version that wrote such a state would have recorded them."""
    import json

    from lisaft.checkpoint.checkpointer import file_checksum

    (ckpt / "state.json").write_text(json.dumps(state))
    marker = json.loads((ckpt / "COMPLETE").read_text())
    marker["files"]["state.json"] = (ckpt / "state.json").stat().st_size
    if "state.json" in marker.get("xxh3_64", {}):
        marker["xxh3_64"]["state.json"] = file_checksum(ckpt / "state.json")
    (ckpt / "COMPLETE").write_text(json.dumps(marker))


def test_the_flat_state_format_of_the_previous_version_resumes_exactly(tiny_run):
    import json

    common = dict(training={"max_steps": 6, "eval_every": 3})
    assert train(tiny_run("ref.yaml", **common), overrides=["training.output_dir=ref"], show=False) == 0
    cut = tiny_run("cut.yaml", **common)
    assert train(cut, overrides=["training.output_dir=cut"], show=False, _stop_at=4) != 0
    ckpt = tiny_run.dir / "cut" / "checkpoints" / "step-000004"
    components = json.loads((ckpt / "state.json").read_text())["components"]
    flat = {**components["progress"], "data": components["data"], "lisa": components["lisa"],
            "schedule": components["schedule"], "recipe_digest": "0" * 16, "elapsed_s": 0.0}
    _rewrite_state(ckpt, flat)
    assert resume(tiny_run.dir / "cut", show=False) == 0
    assert_same_run(tiny_run.dir / "cut", tiny_run.dir / "ref")


FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint-94a5cae"


def _fixture_run(folder: Path) -> None:
    """tests/fixtures/checkpoint-94a5cae in `folder`, its recorded paths made real (and the sizes
    the completion marker records for those files updated)."""
    import json
    import shutil

    shutil.copytree(FIXTURE, folder, ignore=shutil.ignore_patterns("make.py", "__pycache__"))
    shutil.copytree(FIXTURE.parents[2] / "recipes" / "quickstart" / "tokenizer", folder / "tokenizer")
    for ckpt in (folder / "run" / "checkpoints").iterdir():
        marker = json.loads((ckpt / "COMPLETE").read_text())
        for f in (ckpt / "recipe.json", folder / "run" / "recipe.yaml"):
            f.write_text(f.read_text().replace("@FIXTURE@", str(folder)))
        marker["files"]["recipe.json"] = (ckpt / "recipe.json").stat().st_size
        (ckpt / "COMPLETE").write_text(json.dumps(marker))


def test_a_checkpoint_written_by_commit_94a5cae_resumes_exactly(tmp_path, monkeypatch):
    # A real checkpoint of the format before issue 29 (tests/fixtures/checkpoint-94a5cae/make.py
    # wrote it with that commit's lisaft), stopped at step 4 of 6: today's lisaft resumes it, and
    # the run ends where one trained from scratch today does.
    folder = tmp_path / "fixture"
    _fixture_run(folder)
    monkeypatch.chdir(folder)
    assert train(folder / "recipe.yaml", overrides=["training.output_dir=ref"], show=False) == 0
    assert resume(folder / "run", show=False) == 0
    assert sorted(losses(folder / "run")) == list(range(1, 7))
    run, ref = folder / "run", folder / "ref"
    assert losses(run) == losses(ref) and evals(run) == evals(ref)
    # Not bit for bit: the chunked loss now forms the head's gradient in one buffer (issue 33),
    # adding its chunks in another order than 94a5cae did for the fixture's first four steps.
    wa, wb = final_weights(run), final_weights(ref)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=k)


def test_a_checkpoint_without_a_component_is_refused_in_one_line(tiny_run):
    import json

    cut = tiny_run(training={"max_steps": 6})
    assert train(cut, show=False, _stop_at=2) != 0
    ckpt = tiny_run.dir / "run" / "checkpoints" / "step-000002"
    state = json.loads((ckpt / "state.json").read_text())
    del state["components"]["lisa"]
    _rewrite_state(ckpt, state)
    result = runner.invoke(app, ["resume", str(tiny_run.dir / "run")])
    assert result.exit_code == 2, result.output
    assert "step-000002 was written by an older lisaft" in result.output and "--overwrite" in result.output
    assert "Traceback" not in result.output
