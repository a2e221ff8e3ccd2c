"""`lisaft train` with a grpo section on a tiny model: the reward (the share of `a` in each
completion, a dense character reward) rises with full fine-tuning and LISA; every other way to
train (cpu_offload, APOLLO, APOLLO-Mini, in_backward, bf16, LoRA, DoRA, QLoRA) trains; the
records and RUN/completions say what happened; a run killed with SIGKILL resumes to the same
completions, rewards and weights bit for bit. Two ranks: test_grpo_distributed.py."""

import json

import pytest
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.metrics.log import read_metrics
from lisaft.metrics.plot import RunData, plot_command
from lisaft.train import train
from tests.integration.test_resume import _spawn, _wait_for, assert_same_run

runner = CliRunner()
pytestmark = pytest.mark.slow  # tiny runs of 6-12 steps, each sampling 8 completions a step

REWARDS = "def share_a(prompts, completions, **kw):\n    return [c.count('a') / max(len(c), 1) for c in completions]\n"
FIELDS = ("reward", "reward_std", "reward_share_a", "frac_reward_zero_std", "completion_length",
          "completion_truncated", "clip_ratio", "generation_s", "generation_share")


@pytest.fixture
def grpo_run(tiny_run):
    with (tiny_run.dir / "prompts.jsonl").open("w") as f:
        for w in ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "st", "uv", "wx", "yz", "ba", "dc", "fe"):
            f.write(json.dumps({"prompt": w, "answer": w[::-1]}) + "\n")
    (tiny_run.dir / "rewards.py").write_text(REWARDS)

    def make(name="recipe.yaml", grpo=None, **sections):
        base = {"data": {"train": "prompts.jsonl", "eval": None, "format": "prompts"},
                "lisa": {"enabled": False}, "scheduler": {"name": "constant", "warmup_steps": 0},
                "optimizer": {"name": "adamw_32bit", "lr": 3e-2},
                "training": {"batch_size": 8, "max_steps": 12, "eval_every": 0}}
        for section, values in sections.items():
            base[section] = {**base.get(section, {}), **values}
        return tiny_run(name, grpo={"reward_funcs": ["rewards.py:share_a"], "num_generations": 4,
                                    "max_completion_length": 6, **(grpo or {})}, **base)

    make.dir = tiny_run.dir
    return make


def _train_records(run):
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("method", [{}, {"lisa": {"enabled": True, "active_layers": 2, "interval_steps": 3}}],
                         ids=["full", "lisa"])
def test_the_reward_rises(grpo_run, method):
    # Four groups a step: with two, whether the reward rises within 12 steps depends on the seed.
    method = {**method, "training": {"batch_size": 16}}
    assert train(grpo_run(**method), show=False) == 0
    records = _train_records(grpo_run.dir / "run")
    assert all(f in r for r in records for f in FIELDS) and "kl" not in records[0]
    assert all(0 < r["generation_share"] < 1 for r in records)  # sampling is part of the step, not all of it
    first, last = (sum(r["reward"] for r in part) / 3 for part in (records[:3], records[-3:]))
    assert last > first + 0.2, [r["reward"] for r in records]
    shown = (grpo_run.dir / "run" / "completions" / "step-000012.jsonl").read_text().splitlines()
    assert {"prompt", "completion", "reward", "advantage"} <= set(json.loads(shown[0]))


# Two steps say enough. cpu_offload at two micro-batches a step takes the layer-major backward
# (offload_accumulation device), which the 8B recipe uses; it is held to full fine-tuning below.
@pytest.mark.parametrize("method", [{"optimizer": {"cpu_offload": True}, "training": {"batch_size": 4,
                                                                                     "grad_accum_steps": 2}},
                                    {"optimizer": {"name": "apollo"}},
                                    {"optimizer": {"name": "apollo_mini"}},
                                    {"optimizer": {"in_backward": True}, "training": {"max_grad_norm": None}},
                                    {"model": {"dtype": "bfloat16"}, "grpo": {"beta": 0.04}},
                                    {"lora": {"enabled": True, "dora": True}},
                                    {"lora": {"enabled": True}, "model": {"quantize": "nf4"}}],
                         ids=["cpu_offload", "apollo", "apollo_mini", "in_backward", "bf16-frozen-reference", "dora",
                              "qlora"])
def test_other_ways_to_train_run_and_move_the_policy(grpo_run, method):
    sections = {**method, "training": {"max_steps": 2, **method.get("training", {})}}
    grpo = sections.pop("grpo", None)
    if sections.get("model", {}).get("quantize"):  # bitsandbytes' CPU kernel wants a base with weights
        from tests.integration.test_lora_train import _base

        sections["model"] = {"name_or_path": str(_base(grpo_run)), "config": None, "dtype": "bfloat16",
                             **sections["model"]}
    assert train(grpo_run(grpo=grpo, **sections), show=False) == 0
    records = _train_records(grpo_run.dir / "run")
    assert len(records) == 2 and any(r["grad_norm"] is None or r["grad_norm"] > 0 for r in records)
    if grpo:  # the frozen copy of the initial weights: the KL is 0 at step 1 and then grows
        assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0
    if sections.get("optimizer", {}).get("cpu_offload"):
        full = {**sections, "optimizer": {"cpu_offload": False}, "training": {**sections["training"],
                                                                               "output_dir": "full"}}
        assert train(grpo_run("full.yaml", **full), show=False) == 0
        resident = _train_records(grpo_run.dir / "full")
        for key in ("reward", "completion_length", "loss", "grad_norm"):
            assert [r[key] for r in records] == pytest.approx([r[key] for r in resident], rel=1e-5), key


def test_lora_trains_with_the_reference_as_the_base_and_reports_the_kl_and_eval_rewards(grpo_run):
    recipe = grpo_run(lora={"enabled": True}, grpo={"beta": 0.04}, data={"eval": "prompts.jsonl"},
                      training={"max_steps": 4, "eval_every": 2, "eval_batches": 1})
    assert train(recipe, show=False) == 0
    rows = read_metrics(grpo_run.dir / "run" / "metrics.jsonl")
    records = [r for r in rows if "loss" in r]
    assert records[0]["kl"] == 0.0  # the adapters start at zero: the policy is the base
    assert any(r["kl"] > 0 for r in records[1:]) and any(r["grad_norm"] > 0 for r in records)
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and all(0 <= r["eval_reward"] <= 1 for r in evals)
    run = grpo_run.dir / "run"
    assert RunData(run, "grpo").grpo and plot_command([run]) == 0 and (run / "plot.png").is_file()


def test_a_step_whose_groups_all_scored_the_same_is_warned_once(grpo_run):
    flat = "def flat(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    (grpo_run.dir / "rewards.py").write_text(flat)
    with pytest.warns(UserWarning, match="every group's completions scored the same") as seen:
        assert train(grpo_run(grpo={"reward_funcs": ["rewards.py:flat"]}, training={"max_steps": 2}), show=False) == 0
    assert sum("scored the same" in str(w.message) for w in seen) == 1
    assert [r["frac_reward_zero_std"] for r in _train_records(grpo_run.dir / "run")] == [1.0, 1.0]


def test_a_reward_that_fails_stops_the_run_in_one_line_naming_it_and_the_row(grpo_run):
    (grpo_run.dir / "rewards.py").write_text(REWARDS + "def bad(prompts, completions, **kw):\n    return [1.0]\n")
    out = runner.invoke(app, ["train", str(grpo_run(grpo={"reward_funcs": ["rewards.py:bad"]}))])
    assert out.exit_code == 1 and "grpo reward bad returned 1 rewards for 8 completions" in out.output, out.output
    missing = grpo_run("m.yaml", grpo={"reward_funcs": ["rewards.py:nothing"]}, training={"output_dir": "m"})
    out = runner.invoke(app, ["train", str(missing)])
    assert out.exit_code == 2 and "has no function 'nothing'" in out.output, out.output
    assert not (grpo_run.dir / "m").exists()  # refused before the model loaded, nothing left behind
    long = grpo_run("l.yaml", grpo={"max_completion_length": 31}, training={"output_dir": "l"})
    out = runner.invoke(app, ["train", str(long)])
    assert out.exit_code == 2 and "a prompt of 3 tokens plus grpo.max_completion_length 31 is over data.max_seq_len " \
        "32; raise data.max_seq_len to at least 34" in out.output, out.output
    assert not (grpo_run.dir / "run" / "final").exists()


# μ = 2 is cut after step 3, whose generation step 4 trains on again: the rollout comes from the checkpoint.
@pytest.mark.parametrize("grpo, save_every, resumed", [({}, 2, 2), ({"num_iterations": 2}, 1, 3)],
                         ids=["generation-per-step", "mu-2"])
def test_sigkill_then_resume_gives_the_same_completions_rewards_and_weights(grpo_run, grpo, save_every, resumed):
    common = {"max_steps": 6, "save_every": save_every}
    assert train(grpo_run("ref.yaml", grpo=grpo, training={**common, "output_dir": "ref"}), show=False) == 0
    run = grpo_run.dir / "run"
    # The process is killed inside the write of step-000004, the checkpoint before it complete.
    proc = _spawn(grpo_run(grpo=grpo, training=common), env={"LISAFT_TEST_PAUSE_BEFORE_MARKER": "4:60"})
    _wait_for((run / "checkpoints" / "PAUSED").exists, proc)
    proc.kill()
    proc.wait()
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 0 and f"from step-{resumed:06d}" in result.output, result.output
    assert_same_run(run, grpo_run.dir / "ref")
    ref = _train_records(grpo_run.dir / "ref")
    figures = [(r["reward"], r["clip_ratio"]) for r in ref]
    assert [(r["reward"], r["clip_ratio"]) for r in _train_records(run)] == figures
    shown = sorted(p.name for p in (grpo_run.dir / "ref" / "completions").iterdir())  # each generation's
    assert sorted(p.name for p in (run / "completions").iterdir()) == shown
    for name in shown:
        assert (run / "completions" / name).read_text() == (grpo_run.dir / "ref" / "completions" / name).read_text()
    if grpo:  # μ = 2: the old log-probs move the ratio off 1 on every second step
        assert any(r["clip_ratio"] > 0 for r in ref) or any(r["loss"] != 0 for r in ref)
