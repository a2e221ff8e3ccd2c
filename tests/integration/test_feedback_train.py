"""`lisaft train` with KTO on unpaired feedback (full, LoRA, cpu_offload) and IPO on pairs, each
added as the objective interface promises; KTO's references computed once: a run cut at half
resumes to the same losses and weights without another reference pass; `lisaft data` audits a
feedback file."""

import json
import math
import random

import pytest
from safetensors.torch import load_file
from test_preference_train import _records, _write_pairs
from typer.testing import CliRunner

import lisaft.train.preference as preference
from lisaft.cli import app
from lisaft.train import train
from lisaft.train.commands import resume

runner = CliRunner()
pytestmark = pytest.mark.slow  # a few tiny runs each (5-10 s of CPU a test)
FIGURES = ("reward_desirable", "reward_undesirable", "reward_margin", "reward_accuracy", "kl", "logp_desirable",
           "logp_undesirable")


def _write_feedback(path, n, seed):
    """Reversals: the right one desirable, a shuffled one undesirable, about half each."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
            good = rng.random() < 0.5
            wrong = "".join(rng.sample(s, len(s)))
            f.write(json.dumps({"prompt": f"Reverse {s}", "completion": s[::-1] if good else wrong + "x",
                                "label": good}) + "\n")


@pytest.fixture
def kto_run(tiny_run, monkeypatch):
    _write_feedback(tiny_run.dir / "feedback.jsonl", 32, 1)
    _write_feedback(tiny_run.dir / "feedback_eval.jsonl", 8, 2)
    calls = []
    real = preference.reference_pass
    monkeypatch.setattr(preference, "reference_pass", lambda *a, **k: (calls.append(len(a[1])), real(*a, **k)))

    def make(name="recipe.yaml", method=None, **training):
        sections = {"data": {"train": "feedback.jsonl", "eval": "feedback_eval.jsonl", "format": "feedback"},
                    "lisa": {"enabled": False}, "preference": {"loss": "kto"}, "scheduler": {"warmup_steps": 0},
                    "training": {"max_steps": 6, "eval_every": 3, "eval_batches": None, **training}}
        for section, values in (method or {}).items():
            sections[section] = {**sections.get(section, {}), **values}
        return tiny_run(name, **sections)

    make.dir, make.passes = tiny_run.dir, calls
    return make


@pytest.mark.parametrize("method", [
    {}, {"lora": {"enabled": True}}, {"optimizer": {"cpu_offload": True}}, {"lisa": {"enabled": True}},
    {"optimizer": {"in_backward": True}, "training": {"max_grad_norm": None},
     "model": {"gradient_checkpointing": True}},
], ids=["full", "lora", "cpu_offload", "lisa", "in_backward_checkpointed"])
def test_kto_trains_with_every_way_and_starts_at_one_half(kto_run, method):
    assert train(kto_run(method=method), show=False) == 0
    train_recs, eval_recs = _records(kto_run.dir / "run")
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4, 5, 6]
    # The reference is the initial policy and z = 0: every row's loss is 1 − σ(0) before the first update.
    assert train_recs[0]["loss"] == pytest.approx(0.5, abs=1e-6) and train_recs[0]["kl"] == pytest.approx(0, abs=1e-6)
    assert eval_recs[0]["eval_loss"] == pytest.approx(0.5, abs=1e-6)
    for r in train_recs:
        assert all(math.isfinite(r[k]) for k in ("loss", *FIGURES)), r
        assert r["reward_margin"] == pytest.approx(r["reward_desirable"] - r["reward_undesirable"], abs=1e-6)
    assert train_recs[-1]["loss"] != train_recs[0]["loss"] and train_recs[-1]["reward_margin"] != 0
    assert set(eval_recs[-1]) == {"step", "eval_loss", "eval_reward_accuracy", "eval_reward_margin", "eval_kl"}
    assert kto_run.passes == [32, 8]  # the completions and KL sequences of every train and eval row, once
    assert (kto_run.dir / "run" / "final").is_dir()


def test_a_kto_run_cut_at_half_resumes_to_the_same_losses_and_weights_without_a_second_pass(kto_run):
    assert train(kto_run("ref.yaml", output_dir="ref"), show=False) == 0
    assert train(kto_run("cut.yaml", output_dir="cut"), show=False, _stop_at=3) != 0
    assert resume(kto_run.dir / "cut", show=False) == 0
    assert kto_run.passes == [32, 8, 32, 8]  # read back from the checkpoint, never computed again
    (ref_train, ref_eval), (cut_train, cut_eval) = _records(kto_run.dir / "ref"), _records(kto_run.dir / "cut")
    assert [(r["step"], r["loss"], r["kl"], r["reward_margin"]) for r in cut_train] == \
        [(r["step"], r["loss"], r["kl"], r["reward_margin"]) for r in ref_train]
    assert [r["eval_loss"] for r in cut_eval] == [r["eval_loss"] for r in ref_eval]
    a, b = (load_file(kto_run.dir / run / "final" / "model.safetensors") for run in ("ref", "cut"))
    assert all((a[k] == b[k]).all() for k in a)


def test_ipo_trains_end_to_end_from_its_target_margin_squared(tiny_run):
    _write_pairs(tiny_run.dir / "pairs.jsonl", 16, 1)
    recipe = tiny_run(data={"train": "pairs.jsonl", "eval": None, "format": "preference"}, lisa={"enabled": False},
                      preference={"loss": "ipo"}, training={"max_steps": 2, "eval_every": 0})
    assert train(recipe, show=False) == 0
    first, second = _records(tiny_run.dir / "run")[0]
    assert first["loss"] == pytest.approx(25.0, rel=1e-6)  # (1/(2β))² with h = 0 at the start
    assert second["loss"] != first["loss"] and second["reward_margin"] != 0  # the first update moved the policy


def test_lisaft_data_audits_a_feedback_file(kto_run):
    out = runner.invoke(app, ["data", str(kto_run()), "--json"])
    assert out.exit_code == 0, out.output
    train_split = json.loads(out.output)["splits"][0]
    labels = [json.loads(line)["label"] for line in (kto_run.dir / "feedback.jsonl").read_text().splitlines()]
    assert train_split["rows"] == 32 and train_split["desirable"] == sum(labels)
    text = runner.invoke(app, ["data", str(kto_run())])
    assert text.exit_code == 0, text.output
    assert f"32 rows, 0 dropped with no loss token; {sum(labels)} desirable, {32 - sum(labels)} undesirable" \
        in text.output
    assert ", desirable" in text.output or ", undesirable" in text.output


def test_two_ranks_take_the_kl_estimate_over_the_global_batch_as_one_process_at_twice_the_batch(kto_run):
    """Data parallel and FSDP2, two gloo ranks of batch 2, against one process of batch 4."""
    from test_distributed import grad_norms, torchrun

    assert train(kto_run("one.yaml", batch_size=4, output_dir="one", max_steps=4), show=False) == 0
    one_train, one_eval = _records(kto_run.dir / "one")
    for name, fsdp in (("dp", False), ("fsdp", True)):
        recipe = kto_run(f"{name}.yaml", batch_size=2, output_dir=name, fsdp=fsdp, max_steps=4)
        result = torchrun("train", str(recipe), cwd=kto_run.dir)
        assert result.returncode == 0, result.stdout + result.stderr
        two_train, two_eval = _records(kto_run.dir / name)
        for key in ("loss", "kl", "reward_margin", "reward_accuracy"):
            assert [r[key] for r in two_train] == pytest.approx([r[key] for r in one_train], rel=1e-4, abs=1e-5), \
                (name, key)
        assert grad_norms(kto_run.dir / name) == pytest.approx(grad_norms(kto_run.dir / "one"), rel=1e-4), name
        assert [r["eval_loss"] for r in two_eval] == pytest.approx([r["eval_loss"] for r in one_eval], rel=1e-5)
