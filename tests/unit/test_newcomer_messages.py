"""Small messages a new user met: a damaged optimizer file, a refusal under torchrun printed once,
torchrun's resume command, and no layer raster for a run that trains every layer."""

from types import SimpleNamespace

import pytest
import torch
import typer

from lisaft.checkpoint.optimizer_files import read_state_file
from lisaft.errors import LisaftError


def test_a_damaged_optimizer_file_says_so_without_torchs_advice(tmp_path):
    path = tmp_path / "layer-00001.pt"
    torch.save({"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": []}, path)
    assert read_state_file(path)["state"][0]["exp_avg"].tolist() == [1.0, 1.0, 1.0]
    path.write_bytes(path.read_bytes()[:40])  # truncated
    with pytest.raises(LisaftError) as e:
        read_state_file(path)
    assert "damaged optimizer state file" in str(e.value) and "weights_only" not in str(e.value)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_refusal_under_torchrun_is_printed_by_rank_0_first(monkeypatch, capsys):
    import lisaft.cli as cli
    from lisaft.cli import _fail

    waited = []
    monkeypatch.setattr("time.sleep", waited.append)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(typer.Exit):
        _fail("training.seed: bad", 2)
    # Rank 1 leaves only after rank 0 had the time to print (torchrun stops it when rank 0 exits);
    # still running then, the refusal was its own.
    assert waited == [cli.RANK_WAIT_S] and cli.RANK_WAIT_S >= 5
    assert "rank 1: training.seed: bad" in capsys.readouterr().err
    with pytest.raises(typer.Exit):
        _fail("could not write the checkpoint", 1)  # a failure may be this rank's alone
    assert "could not write" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(typer.Exit):
        _fail("training.seed: bad", 2)
    assert "training.seed: bad" in capsys.readouterr().err


def test_a_stopped_torchrun_run_prints_the_launch_that_continues_it(monkeypatch):
    from lisaft.distributed import dist
    from lisaft.train.stop import resume_command

    assert resume_command("RUN", 4) == "lisaft resume RUN"
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "local_world_size", lambda: 2)
    line = resume_command("RUN", 4)
    assert line.startswith("torchrun --nproc-per-node 2 -m lisaft resume RUN")
    assert "`lisaft resume RUN --set training.batch_size=8`" in line  # 4 x 2 ranks on one process
    # training.fsdp needs a process group even on one rank.
    assert "`torchrun --nproc-per-node 1 -m lisaft resume RUN --set training.batch_size=8`" in \
        resume_command("RUN", 4, torchrun=True)


def test_a_run_that_trains_every_layer_gets_no_raster():
    from lisaft.metrics.plot import _samples_layers

    def run(layers, count=4):
        return SimpleNamespace(train=[{"active_layers": a} for a in layers], layer_count=count)

    assert not _samples_layers(run([[0, 1, 2, 3]] * 3))
    assert not _samples_layers(run([None, None]))
    assert not _samples_layers(run([[0, 1, 2, 3]] * 2, count=None))
    assert _samples_layers(run([[0, 2], [1, 3]]))


def test_the_signal_note_is_printed_by_rank_0_only(monkeypatch, capsys):
    import signal

    from lisaft.distributed import dist
    from lisaft.train.stop import StopRequest

    for main, expected in ((False, ""), (True, "SIGINT received")):
        monkeypatch.setattr(dist, "is_main", lambda main=main: main)
        with StopRequest() as stop:
            stop._handle(signal.SIGINT, None)
        out = capsys.readouterr()
        assert stop.requested and (expected in out.out + out.err if expected else out.out + out.err == "")


def test_the_nonfinite_stop_reads_as_sentences_with_or_without_a_checkpoint(tmp_path):
    from lisaft.train.nonfinite import stopped

    session = SimpleNamespace(recipe=SimpleNamespace(optimizer=SimpleNamespace(lr=1e-3)), run_dir=tmp_path)
    first = str(stopped(session, 1, "loss nan", None))
    assert "low precision. Start over with a lower optimizer.lr" in first, first
    later = str(stopped(session, 5, "loss nan", tmp_path / "step-000004"))
    assert "skipping such steps, or start over with a lower optimizer.lr" in later, later
    assert ". or" not in first + later


def _announced(recipe, auto_layers=None) -> list[str]:
    from lisaft.train.objectives import choose
    from lisaft.train.report import announce

    lines: list[str] = []
    session = SimpleNamespace(recipe=recipe, model=torch.nn.Linear(2, 2), parts=SimpleNamespace(layers=[0] * 4),
                              auto_layers=auto_layers, device=torch.device("cpu"), train_examples=[{}] * 3,
                              eval_examples=[], packing=None, progress=SimpleNamespace(step=0), run_dir="RUN",
                              parallel=SimpleNamespace(layer_major=None),
                              objective=choose(recipe, None, SimpleNamespace(pad_token_id=0), torch.device("cpu")))
    announce(session, SimpleNamespace(print=lines.append))
    return lines


def test_the_banner_names_adapters_and_the_auto_choice_in_a_sentence():
    from lisaft.config.schema import recipe_from_dict
    from lisaft.memory.auto_layers import LayerChoice

    base = {"model": {"config": "cfg/config.json", "tokenizer": "tok"},
            "data": {"train": "data/train.jsonl", "format": "instruction"},
            "training": {"max_steps": 10, "output_dir": "runs/x"}}
    lora = recipe_from_dict({**base, "lisa": {"enabled": False}, "lora": {"enabled": True, "rank": 8, "dora": True}})
    assert "DoRA rank 8 on a frozen base, adamw_32bit" in _announced(lora)[-1]
    auto = _announced(recipe_from_dict({**base, "lisa": {"enabled": True, "active_layers": 2}}),
                      LayerChoice(active_layers=2, total_bytes=3 * 2**30, budget_bytes=8 * 2**30, layer_count=4))
    assert auto[0] == ("lisa.active_layers auto chose the largest γ that fits the cpu memory at its estimated "
                       "peak: γ=2: 3.0 of 8.0 GiB (5% kept free)"), auto[0]


def test_the_eval_set_is_the_same_examples_on_any_number_of_ranks(monkeypatch):
    from lisaft.distributed import dist
    from lisaft.train.evaluate import eval_set

    def examples(world: int, batch_size: int, eval_batches=2) -> list:
        monkeypatch.setattr(dist, "world_size", lambda: world)
        t = SimpleNamespace(eval_batches=eval_batches, batch_size=batch_size, grad_accum_steps=1)
        return eval_set(SimpleNamespace(eval_examples=list(range(100)), recipe=SimpleNamespace(training=t)))

    # A 2-rank run at batch 2 resumed on one process at batch 4: the same global batch, the same examples.
    assert examples(2, 2) == examples(1, 4) == list(range(8))
    assert examples(1, 4, eval_batches=None) == list(range(100))


def test_data_mistakes_name_the_way_out(tmp_path):
    import json

    from lisaft.data.read import read_rows

    def error(rows, fmt: str, text: str | None = None) -> str:
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in rows))
        from lisaft.data.formats import data_format

        try:
            data_format(fmt).examples(read_rows(str(path), "data.train"), _tokenizer(), None, {})
        except LisaftError as e:
            return str(e)
        raise AssertionError("accepted")

    sharegpt = error([{"conversations": [{"from": "human", "value": "hi"}]}], "chat")
    assert "(fields: conversations); ShareGPT data: set data.columns {conversations: messages" in sharegpt
    alpaca = error([{"instruction": "a", "input": "b", "output": "c"}], "chat")
    assert "these are data.format instruction's fields: set data.format: instruction" in alpaca, alpaca
    broken = error([], "text", '{"text": "a"}\n{"text": \n{"text": "b"}\n{oops\n{"text"\n')
    assert "line 2: not valid JSON" in broken and "after it, 2 more not valid JSON (lines 4, 5)" in broken, broken


def _tokenizer():
    from pathlib import Path

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "recipes" / "quickstart" / "tokenizer")


def test_resume_pointed_inside_a_run_names_the_run(tmp_path):
    from lisaft.checkpoint.missing import run_recipe_file

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "step-000004").mkdir(parents=True)
    (run / "recipe.yaml").write_text("x")
    with pytest.raises(LisaftError, match=rf"is the run's exported model, not the run; .*`lisaft resume {run}`"):
        run_recipe_file(run / "final")
    with pytest.raises(LisaftError, match=rf"is the run's folder, not the run; .*`lisaft resume {run}`"):
        run_recipe_file(run / "checkpoints" / "step-000004")


def test_a_tokenizer_without_a_chat_template_names_the_way_out():
    from lisaft.data.formats.chat import need_chat_template

    with pytest.raises(LisaftError, match="no chat template; point model.tokenizer at one that has .*"
                                          "data.format: instruction"):
        need_chat_template(SimpleNamespace(chat_template=None), "data.train", "chat")
