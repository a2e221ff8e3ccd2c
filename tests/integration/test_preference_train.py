"""`lisaft train` on preference pairs with each objective, and DPO's reference log-probs computed
once: a run cut at half resumes to the same losses without another reference pass."""

import json
import math
import random

import pytest
from typer.testing import CliRunner

import lisaft.train.preference as preference
from lisaft.cli import app
from lisaft.metrics.display import eval_line
from lisaft.metrics.log import read_metrics, scalars
from lisaft.metrics.plot import RunData, plot_command
from lisaft.model.preference import METRICS
from lisaft.train import train
from lisaft.train.commands import resume

runner = CliRunner()
pytestmark = pytest.mark.slow  # a few tiny runs each (5-10 s of CPU a test)


def _write_pairs(path, n, seed):
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
            wrong = "".join(rng.sample(s, len(s)))
            f.write(json.dumps({"prompt": f"Reverse {s}", "chosen": s[::-1],
                                "rejected": wrong if wrong != s[::-1] else s[::-1] + "a"}) + "\n")


@pytest.fixture
def pref_run(tiny_run):
    _write_pairs(tiny_run.dir / "pairs.jsonl", 32, 1)
    _write_pairs(tiny_run.dir / "pairs_eval.jsonl", 8, 2)

    def make(name="recipe.yaml", loss="dpo", **training):
        return tiny_run(name, data={"train": "pairs.jsonl", "eval": "pairs_eval.jsonl", "format": "preference"},
                        lisa={"enabled": False}, preference={"loss": loss}, scheduler={"warmup_steps": 0},
                        training={"max_steps": 6, "eval_every": 3, "eval_batches": None, **training})

    make.dir = tiny_run.dir
    return make


@pytest.fixture
def passes(monkeypatch):
    """How many reference passes ran (one per pair list: train, eval)."""
    calls = []
    real = preference.reference_pass
    monkeypatch.setattr(preference, "reference_pass", lambda *a, **k: (calls.append(len(a[1])), real(*a, **k)))
    return calls


def _records(run):
    rows = read_metrics(run / "metrics.jsonl")
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


@pytest.mark.parametrize("loss", ["dpo", "simpo", "orpo"])
def test_each_objective_trains_and_reports_its_rewards(pref_run, passes, loss):
    assert train(pref_run(loss=loss), show=False) == 0
    run = pref_run.dir / "run"
    train_recs, eval_recs = _records(run)
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4, 5, 6]
    for r in train_recs:
        assert all(math.isfinite(r[k]) for k in ("loss", *METRICS)), r
        assert 0 <= r["reward_accuracy"] <= 1
        # The three are float32 means: the margin's own rounding scales with the rewards' size.
        scale = max(1.0, abs(r["reward_chosen"]), abs(r["reward_rejected"]))
        assert r["reward_margin"] == pytest.approx(r["reward_chosen"] - r["reward_rejected"], abs=1e-6 * scale)
    assert [r["step"] for r in eval_recs] == [0, 3, 6]
    assert set(eval_recs[-1]) == {"step", "eval_loss", "eval_reward_accuracy", "eval_reward_ties",
                                  "eval_reward_margin"}
    assert (run / "final" / "config.json").is_file()
    if loss == "dpo":
        # The reference is the initial policy: before any update the loss is ln 2 and no reward moved.
        assert train_recs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert eval_recs[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert train_recs[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
        # Every reward is 0 there: all tied, which TRL's accuracy (a tie counts as wrong) reads as 0.
        assert (train_recs[0]["reward_ties"], train_recs[0]["reward_accuracy"]) == (1.0, 0.0)
        assert (eval_recs[0]["eval_reward_ties"], eval_recs[0]["eval_reward_accuracy"]) == (1.0, 0.0)
        assert "reward accuracy — (all tied)" in eval_line(eval_recs[0])
        assert RunData(run, "dpo").untied("eval_reward_accuracy", eval_recs)[0] == [3, 6]
        assert passes == [32, 8]
        # TensorBoard and W&B get every field; `lisaft plot` draws the reward accuracy.
        assert {"train/reward_margin", "train/logp_chosen"} <= set(scalars(train_recs[-1])[1])
        assert set(scalars(eval_recs[-1])[1]) == {"eval/loss", "eval/reward_accuracy", "eval/reward_ties",
                                                  "eval/reward_margin"}
        assert RunData(run, "dpo").pairs and plot_command([run]) == 0 and (run / "plot.png").is_file()
        # `lisaft generate` prompts the result as its pairs' prompts were laid out.
        out = runner.invoke(app, ["generate", str(run), "--input-file", str(pref_run.dir / "pairs_eval.jsonl"),
                                  "--limit", "2", "--max-new-tokens", "3"])
        assert out.exit_code == 0 and "preference prompts" in out.output and "exact match:" in out.output, out.output
    else:
        assert passes == []  # SimPO and ORPO use no reference


def test_a_dpo_run_cut_at_half_resumes_to_the_same_losses_without_a_second_reference_pass(pref_run, passes):
    assert train(pref_run("ref.yaml"), overrides=["training.output_dir=ref"], show=False) == 0
    assert train(pref_run("cut.yaml"), overrides=["training.output_dir=cut"], show=False, _stop_at=3) != 0
    assert passes == [32, 8, 32, 8]
    assert resume(pref_run.dir / "cut", show=False) == 0
    assert passes == [32, 8, 32, 8]  # read back from the checkpoint, never computed again
    (ref_train, ref_eval), (cut_train, cut_eval) = _records(pref_run.dir / "ref"), _records(pref_run.dir / "cut")
    assert [(r["step"], r["loss"], r["reward_margin"]) for r in cut_train] == \
        [(r["step"], r["loss"], r["reward_margin"]) for r in ref_train]
    assert [r["eval_loss"] for r in cut_eval] == [r["eval_loss"] for r in ref_eval]


def test_a_resume_over_changed_pairs_is_refused(pref_run):
    assert train(pref_run(), show=False, _stop_at=2) != 0
    rows = (pref_run.dir / "pairs.jsonl").read_text().splitlines()
    row = json.loads(rows[5])
    row["rejected"] += "x"
    (pref_run.dir / "pairs.jsonl").write_text("\n".join([*rows[:5], json.dumps(row), *rows[6:]]) + "\n")
    result = runner.invoke(app, ["resume", str(pref_run.dir / "run")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "the training data changed since the checkpoint" in result.output
    # The data order may continue over new data on purpose; DPO's reference log-probs cannot.
    result = runner.invoke(app, ["resume", str(pref_run.dir / "run"), "--set", "training.accept_data_change=true"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "cannot continue over other pairs, not even with training.accept_data_change" in result.output


def test_the_nonfinite_guard_covers_pairs(pref_run):
    result = runner.invoke(app, ["train", str(pref_run(loss="simpo", save_every=1, eval_every=0)),
                                 "--set", "optimizer.lr=1e30"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: step") and ("nan" in last or "inf" in last), result.output
    assert not (pref_run.dir / "run" / "final").exists()


def test_two_ranks_normalise_by_the_global_pairs_as_one_process_at_twice_the_batch(pref_run):
    """Data parallel and FSDP2, two gloo ranks of batch 2, against one process of batch 4."""
    from test_distributed import grad_norms, torchrun

    common = dict(max_steps=4)  # every eval pair, whatever the batch
    assert train(pref_run("one.yaml", batch_size=4, output_dir="one", **common), show=False) == 0
    one_train, one_eval = _records(pref_run.dir / "one")
    for name, fsdp in (("dp", False), ("fsdp", True)):
        result = torchrun("train", str(pref_run(f"{name}.yaml", batch_size=2, output_dir=name, fsdp=fsdp, **common)),
                          cwd=pref_run.dir)
        assert result.returncode == 0, result.stdout + result.stderr
        two_train, two_eval = _records(pref_run.dir / name)
        # Float tolerance: the ranks' sums are added in another order. A rank that divided by its
        # own pairs would halve the gradient, which the norm before clipping shows.
        for key in ("loss", "reward_margin", "reward_accuracy", "logp_chosen"):
            assert [r[key] for r in two_train] == pytest.approx([r[key] for r in one_train], rel=1e-4, abs=1e-5), \
                (name, key)
        assert grad_norms(pref_run.dir / name) == pytest.approx(grad_norms(pref_run.dir / "one"), rel=1e-4), name
        assert [r["eval_loss"] for r in two_eval] == pytest.approx([r["eval_loss"] for r in one_eval], rel=1e-5)
        assert two_train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the shared reference pass is whole


@pytest.mark.parametrize("method", [
    {"lora": {"enabled": True}}, {"optimizer": {"cpu_offload": True}}, {"optimizer": {"name": "apollo_mini"}},
    {"optimizer": {"in_backward": True}, "training": {"max_grad_norm": None}}, {"lisa": {"enabled": True}},
], ids=["lora", "cpu_offload", "apollo_mini", "in_backward", "lisa"])
def test_dpo_runs_with_every_way_to_train(tiny_run, method):
    _write_pairs(tiny_run.dir / "pairs.jsonl", 16, 1)
    sections = {"data": {"train": "pairs.jsonl", "eval": None, "format": "preference"},
                "lisa": {"enabled": False}, "preference": {"loss": "dpo"},
                "training": {"max_steps": 2, "eval_every": 0}}
    for section, values in method.items():
        sections[section] = {**sections.get(section, {}), **values}
    assert train(tiny_run(**sections), show=False) == 0
    first, second = _records(tiny_run.dir / "run")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert second["loss"] != first["loss"] and second["reward_margin"] != 0  # the first update moved the policy


def test_a_reference_model_is_loaded_for_the_pass(pref_run, passes):
    assert train(pref_run("orpo.yaml", loss="orpo", max_steps=2, eval_every=0, output_dir="orpo"), show=False) == 0
    trained = str(pref_run.dir / "orpo" / "final")
    # Its own weights as policy and reference: no difference at the start.
    same = pref_run("same.yaml", max_steps=1, eval_every=0, output_dir="same")
    assert train(same, overrides=["model.config=null", f"model.name_or_path={trained}",
                                  f"preference.reference={trained}"], show=False) == 0
    assert _records(pref_run.dir / "same")[0][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # A random-init policy against the trained reference: the rewards start apart.
    other = pref_run("other.yaml", max_steps=1, eval_every=0, output_dir="other")
    assert train(other, overrides=[f"preference.reference={trained}"], show=False) == 0
    assert abs(_records(pref_run.dir / "other")[0][0]["reward_margin"]) > 1e-4
    assert passes == [32, 8, 32, 8]
