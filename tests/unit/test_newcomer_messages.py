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
        resume_command("RUN", 4, fsdp=True)


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
