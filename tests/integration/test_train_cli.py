import json

import pytest
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.metrics.log import read_metrics

runner = CliRunner()
TRAIN_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "active_layers", "trainable_params",
                "grad_bytes", "optimizer_state_bytes", "offloaded_state_bytes", "peak_memory_bytes",
                "peak_memory_counter"}


def test_train_end_to_end_writes_the_run_directory(tiny_run, monkeypatch):
    from lisaft.checkpoint.checkpointer import Checkpointer
    from lisaft.metrics.log import MetricsLog

    events = []  # metrics.jsonl reaches the disk before each checkpoint a resume truncates it to
    sync, save = MetricsLog.sync, Checkpointer.save
    monkeypatch.setattr(MetricsLog, "sync", lambda self: events.append("sync") or sync(self))
    monkeypatch.setattr(Checkpointer, "save", lambda self, step, *a: events.append(step) or save(self, step, *a))
    recipe = tiny_run()
    result = runner.invoke(app, ["train", str(recipe), "--set", "training.save_every=4"])
    assert result.exit_code == 0, result.output
    assert events == ["sync", 4, "sync", 8, "sync"]  # the last: the log closing
    run = tiny_run.dir / "run"
    records = read_metrics(run / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert TRAIN_FIELDS <= set(train[0])
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert 0.0 <= evals[-1]["eval_token_accuracy"] <= 1.0
    assert all(len(r["active_layers"]) == 2 for r in train)
    assert all(r["peak_memory_bytes"] > 0 and r["grad_bytes"] > 0 for r in train)
    assert all(r["grad_norm"] > 0 for r in train)
    assert (run / "recipe.yaml").is_file()
    assert "Memory: estimated vs measured" in result.output and "optimizer states" in result.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000008"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.num_hidden_layers == 4 and len(tok) == model.config.vocab_size
    # The weights get the mode their neighbours get (safetensors alone writes 0600).
    modes = {f.name: f.stat().st_mode & 0o777 for f in (run / "final").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] != 0o600, modes


def test_loss_goes_down_full_finetuning(tiny_run):
    recipe = tiny_run(lisa={"enabled": False}, training={"max_steps": 30, "eval_every": 0})
    result = runner.invoke(app, ["train", str(recipe)])
    assert result.exit_code == 0, result.output
    train = [r for r in read_metrics(tiny_run.dir / "run" / "metrics.jsonl") if "loss" in r]
    assert train[-1]["loss"] < 0.7 * train[0]["loss"]
    assert train[0]["active_layers"] is None or train[0]["active_layers"] == [0, 1, 2, 3]


def _one_error_line(result):
    out = result.output.strip()
    assert result.exit_code == 2, out
    assert "Traceback" not in out
    assert out.startswith("error:"), out
    return out


@pytest.mark.parametrize("overrides, needle", [
    (["lisa.activ_layers=2"], "lisa.activ_layers: unknown key"),
    (["training.batch_size=two"], "training.batch_size"),
    (["optimizer.name=sgd"], "optimizer.name"),
    (["optimizer.lr=0"], "optimizer.lr"),
    (["data.train=missing.jsonl"], "missing.jsonl"),
    (["model.config=nope/config.json"], "model.config"),
    (["model.attention=flash_attention_2"], "flash_attention_2"),
    (["lisa.active_layers=9"], "lisa.active_layers"),
    (["model.dtype=float16"], "use bfloat16"),
    (["training.batch_size=true"], "training.batch_size: must be a whole number, not true/false"),
    (["training.batch_sise=2"], "training.batch_sise: unknown key; did you mean training.batch_size?"),
    (["training=5"], "training: must be a section of keys (a YAML mapping), got int"),
    (["data.max_seq_len=100"], "data.max_seq_len: 100 is above the model's context length "
                               "(max_position_embeddings 64)"),
    (["training.output_dir=afile/run"], "afile is a file, not a folder"),
    (["model.config=null", "model.tokenizer=null", "model.name_or_path=./no-such-model"],
     ("error: model.name_or_path: ", "no-such-model: no such folder")),
    (["model.config=null", "model.tokenizer=null", "model.name_or_path=empty"],
     ("error: model.name_or_path: ", "empty: no config.json, so no saved model is in it")),
    (["model.config=null", "model.name_or_path=no-such-org/no-such-model"],
     "model.name_or_path: 'no-such-org/no-such-model' is not a local folder and the hub cannot be reached"),
])
def test_bad_input_exits_2_with_one_message(tiny_run, overrides, needle):
    recipe = tiny_run()
    (tiny_run.dir / "afile").write_text("not a folder")
    (tiny_run.dir / "empty").mkdir()
    args = ["train", str(recipe)]
    for o in overrides:
        args += ["--set", o]
    out = _one_error_line(runner.invoke(app, args))
    assert all(n in out for n in ((needle,) if isinstance(needle, str) else needle)), out
    assert not (tiny_run.dir / "run").exists(), "a failed start must not create the run"


def test_not_yaml_and_empty_dataset(tiny_run):
    bad = tiny_run.dir / "bad.yaml"
    bad.write_text("model: {config: [\n")
    out = _one_error_line(runner.invoke(app, ["train", str(bad)]))
    assert out.startswith(f"error: {bad}: line 2, column 1: not valid YAML") and "<unicode string>" not in out
    (tiny_run.dir / "empty.jsonl").write_text("")
    recipe = tiny_run(data={"train": "empty.jsonl"})
    assert "empty.jsonl" in _one_error_line(runner.invoke(app, ["train", str(recipe)]))


def test_bad_row_names_file_and_row(tiny_run):
    path = tiny_run.dir / "badrow.jsonl"
    rows = [{"instruction": "Reverse", "input": "ab", "output": "ba"}] * 5 + [{"instruction": "x"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _one_error_line(runner.invoke(app, ["train", str(tiny_run(data={"train": "badrow.jsonl"}))]))
    assert "badrow.jsonl" in out and "6" in out


def test_existing_run_is_refused_and_untouched(tiny_run):
    recipe = tiny_run(training={"max_steps": 2})
    assert runner.invoke(app, ["train", str(recipe)]).exit_code == 0
    metrics = tiny_run.dir / "run" / "metrics.jsonl"
    before = metrics.read_bytes()
    out = _one_error_line(runner.invoke(app, ["train", str(recipe)]))
    assert "lisaft resume" in out and "--overwrite" in out
    assert metrics.read_bytes() == before
    result = runner.invoke(app, ["train", str(recipe), "--overwrite", "--set", "training.max_steps=1"])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(metrics) if "loss" in r] == [1]


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
def test_chunked_loss_trains_like_the_plain_loss(tiny_run, monkeypatch, in_backward):
    import torch

    from lisaft.model import loss as loss_mod
    from lisaft.train import train

    extra = {"optimizer": {"in_backward": True}, "training": {"max_grad_norm": None}} if in_backward else {}
    recipe = tiny_run(lisa={"enabled": False}, **{
        "training": {"max_steps": 4, "eval_every": 2, **extra.get("training", {})},
        "optimizer": {"name": "adamw_32bit", "lr": 3e-3, **extra.get("optimizer", {})}})
    assert train(recipe, overrides=["training.output_dir=plain"], show=False) == 0
    # About 9 positions per chunk: every micro-batch's loss runs in several checkpointed chunks,
    # and the head's gradient must still be accumulated (and, in backward, applied) once.
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 1000)
    assert train(recipe, overrides=["training.output_dir=chunked"], show=False) == 0
    a = read_metrics(tiny_run.dir / "plain" / "metrics.jsonl")
    b = read_metrics(tiny_run.dir / "chunked" / "metrics.jsonl")
    for key in ("loss", "eval_loss"):
        x = torch.tensor([r[key] for r in a if key in r])
        y = torch.tensor([r[key] for r in b if key in r])
        assert len(x) and torch.allclose(x, y, rtol=1e-4), (key, x, y)


def test_grad_norm_is_the_norm_before_clipping_in_both_modes(tiny_run):
    import math

    from lisaft.train import train

    common = {"lisa": {"enabled": False}, "scheduler": {"name": "constant"},
              "optimizer": {"name": "adamw_32bit", "lr": 1e-3}}
    # One step from the same init and batch: the clipped run, the unclipped run and the
    # in-backward run (which never holds all gradients at once) all see the same norm.
    runs = {"clipped": {"max_grad_norm": 1e-3}, "unclipped": {"max_grad_norm": None}}
    for name, t in runs.items():
        recipe = tiny_run(f"{name}.yaml", training={"max_steps": 1, "eval_every": 0, **t}, **common)
        assert train(recipe, overrides=[f"training.output_dir={name}"], show=False) == 0
    ib = tiny_run("ib.yaml", training={"max_steps": 1, "eval_every": 0, "max_grad_norm": None},
                  **{**common, "optimizer": {**common["optimizer"], "in_backward": True}})
    assert train(ib, overrides=["training.output_dir=ib"], show=False) == 0
    norms = {name: [r["grad_norm"] for r in read_metrics(tiny_run.dir / name / "metrics.jsonl") if "loss" in r][0]
             for name in ("clipped", "unclipped", "ib")}
    assert norms["clipped"] > 1e-3 and math.isclose(norms["clipped"], norms["unclipped"], rel_tol=1e-6)
    assert math.isclose(norms["ib"], norms["unclipped"], rel_tol=1e-4)


def test_overwrite_keeps_files_lisaft_did_not_write(tiny_run):
    recipe = tiny_run(training={"max_steps": 1, "eval_every": 0})
    assert runner.invoke(app, ["train", str(recipe)]).exit_code == 0
    run = tiny_run.dir / "run"
    (run / "notes.txt").write_text("mine")
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    out = _one_error_line(runner.invoke(app, ["train", str(recipe), "--overwrite"]))
    assert "did not write (notes.txt)" in out and "--force" in out
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    result = runner.invoke(app, ["train", str(recipe), "--overwrite", "--force"])
    assert result.exit_code == 0, result.output
    assert (run / "notes.txt").read_text() == "mine" and (run / "final").is_dir()


def test_epochs_set_the_run_length_and_resume_keeps_it(tiny_run):
    from lisaft.config.schema import load_recipe
    from lisaft.train import train
    from lisaft.train.commands import resume

    # 96 rows, 4 per step: one epoch is 24 steps, 1.5 epochs 36.
    recipe = tiny_run(training={"max_steps": None, "epochs": 1.5, "eval_every": 0, "log_every": 6})
    assert train(recipe, show=False, _stop_at=6) != 0
    run = tiny_run.dir / "run"
    saved = load_recipe(run / "recipe.yaml").training
    assert (saved.epochs, saved.max_steps) == (1.5, 36)
    assert resume(run, show=False) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r][-1] == 36


def test_max_steps_written_as_1e3_is_a_thousand(tiny_run):
    from lisaft.config.schema import load_recipe

    recipe = tiny_run()
    recipe.write_text(recipe.read_text().replace("max_steps: 8", "max_steps: 1e3"))
    assert load_recipe(recipe).training.max_steps == 1000


def test_memory_table_compares_offloaded_state_like_with_like(tiny_run):
    recipe = tiny_run(lisa={"state_policy": "offload_cpu", "interval_steps": 1},
                      training={"max_steps": 12, "eval_every": 0, "device": "cpu"})
    result = runner.invoke(app, ["train", str(recipe)])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "optimizer states" in line)
    difference = row.split("│")[-2].strip()
    assert abs(float(difference.rstrip("%"))) < 5, row


def test_auto_active_layers_trains_the_largest_gamma_that_fits(tiny_run, monkeypatch):
    """The device's memory set between the estimates at γ=2 and γ=3 of this 4-layer model: auto
    trains 2 layers per interval, says so at start, and the run's recipe.yaml records 2."""
    import yaml

    from lisaft.config.schema import load_recipe
    from lisaft.memory import auto_layers
    from lisaft.memory.command import settings_from_recipe
    from lisaft.memory.estimate import compute

    recipe = tiny_run(lisa={"active_layers": "auto", "sampling": "cyclic"}, training={"max_steps": 4})
    s = settings_from_recipe(load_recipe(recipe), device="cpu")
    two, three = (compute(s.with_keys({"lisa.active_layers": g})).total_bytes for g in (2, 3))
    assert two < three
    # auto keeps AUTO_MARGIN of the memory free: the budget whose usable share lies between them.
    budget = int((two + three) // 2 / (1 - auto_layers.AUTO_MARGIN))
    monkeypatch.setattr(auto_layers, "device_memory_bytes", lambda device: budget)
    result = runner.invoke(app, ["train", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "lisa.active_layers auto chose the largest γ that fits the cpu memory at its estimated peak: γ=2:" \
        in result.output and "cyclic" in result.output
    run = tiny_run.dir / "run"
    assert all(len(r["active_layers"]) == 2 for r in read_metrics(run / "metrics.jsonl") if "loss" in r)
    assert yaml.safe_load((run / "recipe.yaml").read_text())["lisa"]["active_layers"] == 2
    monkeypatch.setattr(auto_layers, "device_memory_bytes", lambda device: two // 4)
    result = runner.invoke(app, ["train", str(recipe), "--set", "training.output_dir=run2"])
    assert result.exit_code != 0 and "lisa.active_layers: auto: even γ=1 needs" in result.output
    assert "Traceback" not in result.output and not (tiny_run.dir / "run2").exists()


def test_keys_a_run_would_not_use_are_named_when_it_starts(tiny_run):
    from lisaft.console import LisaftWarning
    from lisaft.train import train

    recipe = tiny_run(training={"max_steps": 2, "epochs": 3, "eval_every": 1}, data={"eval": None})
    with pytest.warns(LisaftWarning) as caught:
        assert train(recipe, show=False) == 0
    said = [str(w.message) for w in caught]
    assert any(m.startswith("training.epochs (3) is ignored: training.max_steps (2) is set too") for m in said)
    assert any(m.startswith("training.eval_every (1) is ignored: there is no eval set") for m in said)


def test_training_threads_sets_torchs_thread_count(tiny_run):
    import torch

    from lisaft.config.schema import load_recipe
    from lisaft.train import build_session

    before = torch.get_num_threads()
    try:
        build_session(load_recipe(tiny_run(training={"threads": 1})), tiny_run.dir / "run")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_resume_of_what_is_not_a_run_says_what_it_is(tiny_run):
    recipe = tiny_run()
    missing = runner.invoke(app, ["resume", str(tiny_run.dir / "nope")])
    given_recipe = runner.invoke(app, ["resume", str(recipe)])
    not_a_run = runner.invoke(app, ["resume", str(tiny_run.dir / "model")])
    for result in (missing, given_recipe, not_a_run):
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "no such folder" in missing.output
    assert f"is a recipe file; resume takes the run folder it trains into: `lisaft resume {tiny_run.dir / 'run'}`" \
        in " ".join(given_recipe.output.split())
    assert "not a lisaft run (no recipe.yaml in it)" in not_a_run.output


def test_activations_are_measured_on_the_longest_batch_so_far(tiny_run):
    """The end-of-run table estimates for the run's longest batch, where its peak comes from."""
    from lisaft.config.schema import load_recipe
    from lisaft.data.collate import collate
    from lisaft.train import build_session, train_step

    recipe = load_recipe(tiny_run(training={"grad_accum_steps": 3, "batch_size": 2}))
    session = build_session(recipe, tiny_run.dir / "run")
    order = session.order.state_dict()
    widths = []
    for _ in range(3):
        idx = session.order.next_indices()
        widths.append(collate([session.train_examples[i] for i in idx], 0)["input_ids"].shape[1])
    session.order.load_state_dict(order)
    first = train_step(session, 0, measure_activations=True)
    assert first.activation_seq_len == max(widths) and first.activation_bytes > 0
    again = train_step(session, 1, measure_activations=True, longer_than=10**6)
    assert again.activation_bytes is None  # nothing longer than before: no hooks this step
