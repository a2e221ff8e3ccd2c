"""optimizer.cpu_offload through `lisaft train` and `lisaft resume` on CPU: the run is the one
without offload, bit for bit (losses, evals, gradient norms, final weights, the checkpoint's
files), and a stopped offloaded run resumes exactly."""

import pytest
from test_resume import assert_same_run

from lisaft.metrics.log import read_metrics
from lisaft.train import train
from lisaft.train.commands import resume


def _train_records(run):
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _plain_and_offloaded(tiny_run, common: dict) -> dict:
    """The same recipe trained with the optimizer on the device and on the CPU: each run's folder."""
    runs = {}
    for offload in (False, True):
        tag = "offloaded" if offload else "plain"
        recipe = tiny_run(f"{tag}.yaml", **{**common, "optimizer": {**common["optimizer"], "cpu_offload": offload}})
        assert train(recipe, overrides=[f"training.output_dir={tag}"], show=False) == 0
        runs[tag] = tiny_run.dir / tag
    return runs


@pytest.mark.parametrize("dtype, name", [("float32", "adamw_32bit"), ("bfloat16", "adamw_8bit")])
def test_train_with_cpu_offload_is_the_same_run(tiny_run, dtype, name):
    common = dict(model={"dtype": dtype}, optimizer={"name": name, "lr": 1e-3},
                  training={"max_steps": 4, "grad_accum_steps": 2, "eval_every": 2, "save_every": 2})
    runs = _plain_and_offloaded(tiny_run, common)
    assert_same_run(runs["plain"], runs["offloaded"])
    ref, off = _train_records(runs["plain"]), _train_records(runs["offloaded"])
    assert [r["grad_norm"] for r in ref] == [r["grad_norm"] for r in off]
    assert all(r["optimizer_state_bytes"] == 0 and r["offloaded_state_bytes"] > 0 for r in off)
    files = {tag: sorted(p.relative_to(run / "checkpoints").as_posix()
                         for p in (run / "checkpoints").rglob("optimizer/*.pt")) for tag, run in runs.items()}
    assert files["plain"] == files["offloaded"] and files["plain"]


def test_offloaded_run_resumes_exactly(tiny_run):
    common = dict(model={"dtype": "bfloat16"}, optimizer={"name": "adamw_32bit", "lr": 1e-3, "cpu_offload": True},
                  lisa={"state_policy": "offload_cpu", "interval_steps": 2},
                  training={"max_steps": 6, "grad_accum_steps": 2, "eval_every": 3})
    ref = tiny_run("ref.yaml", **common)
    assert train(ref, overrides=["training.output_dir=ref"], show=False) == 0
    cut = tiny_run("cut.yaml", **common)
    assert train(cut, overrides=["training.output_dir=cut"], show=False, _stop_at=3) != 0
    assert resume(tiny_run.dir / "cut", show=False) == 0
    assert_same_run(tiny_run.dir / "ref", tiny_run.dir / "cut")


def test_units_stepped_as_gradients_arrive_are_the_same_run(tiny_run, monkeypatch):
    """training.max_grad_norm null: the offloaded units step in the last backward
    (lisaft/optim/cpu_offload.py's step_as_ready), and the run is still the plain one."""
    from lisaft.optim.cpu_offload import OffloadedOptimizers

    started = []
    arm = OffloadedOptimizers.arm

    def counting_arm(self, units, measure_norm):
        started.append(self.step_as_ready)
        return arm(self, units, measure_norm)

    monkeypatch.setattr(OffloadedOptimizers, "arm", counting_arm)
    common = dict(model={"dtype": "bfloat16"}, optimizer={"name": "adamw_8bit", "lr": 1e-3},
                  training={"max_steps": 4, "grad_accum_steps": 2, "max_grad_norm": None, "save_every": 2})
    runs = _plain_and_offloaded(tiny_run, common)
    assert started == [True] * 4
    assert_same_run(runs["plain"], runs["offloaded"])
    ref, off = _train_records(runs["plain"]), _train_records(runs["offloaded"])
    assert [r["grad_norm"] for r in ref] == [r["grad_norm"] for r in off] and off[0]["grad_norm"] is not None
