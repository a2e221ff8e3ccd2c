"""The run folder: write failures recognised whatever library raised them, output_dir checks,
and --overwrite removing only what lisaft wrote."""

import errno
import resource
import signal
from contextlib import contextmanager

import pytest
import torch
from _unprivileged import lisaft_error_as_unprivileged, open_dir

from lisaft.errors import LisaftError
from lisaft.metrics.log import MetricsLog
from lisaft.run_folder import check_output_dir, clear_run, is_write_failure


@contextmanager
def file_size_limit(nbytes: int):
    """A real write failure: the kernel refuses to grow a file past nbytes (EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _raised(fn) -> BaseException:
    with file_size_limit(4096):
        try:
            fn()
        except Exception as e:
            return e
    raise AssertionError("the write did not fail")


def test_failed_writes_are_recognised_from_every_writer(tmp_path):
    from safetensors.torch import save_file

    big = torch.zeros(10_000)
    errors = [
        _raised(lambda: torch.save({"m": big}, tmp_path / "a.pt")),          # RuntimeError
        _raised(lambda: save_file({"w": big}, str(tmp_path / "b.st"))),    # SafetensorError
        _raised(lambda: (tmp_path / "c.txt").write_text("x" * 10_000)),   # OSError
    ]
    assert [type(e).__name__ for e in errors] == ["RuntimeError", "SafetensorError", "OSError"]
    assert all(is_write_failure(e) for e in errors)
    assert not is_write_failure(RuntimeError("shape mismatch")) and not is_write_failure(ValueError("x"))


def test_metrics_truncation_that_cannot_be_written_leaves_metrics_whole(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 11):
        log.write({"step": step, "loss": 1.0, "pad": "x" * 1000})  # 8 kept records: past 4 KiB
    before = log.path.read_bytes()
    error = _raised(lambda: log.truncate_after(8))
    assert isinstance(error, OSError) and error.errno == errno.EFBIG and is_write_failure(error)
    assert error.filename == str(log.path)  # the message names metrics.jsonl
    assert log.path.read_bytes() == before
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_output_dir_under_a_file_and_a_file_as_output_dir(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(LisaftError, match="afile is a file, not a folder"):
        check_output_dir(tmp_path / "afile" / "run", overwrite=False, force=False)
    with pytest.raises(LisaftError, match="is a file; choose a folder"):
        check_output_dir(tmp_path / "afile", overwrite=False, force=False)


def test_output_dir_that_cannot_be_created(tmp_path):
    locked = open_dir(tmp_path) / "locked"
    locked.mkdir(mode=0o555)
    message = lisaft_error_as_unprivileged(lambda: check_output_dir(locked / "run", overwrite=False, force=False))
    assert message and "cannot be created: no permission to write in" in message, message


def test_overwrite_removes_only_lisaft_files_and_refuses_others_without_force(tmp_path):
    run = tmp_path / "run"
    for d in ("checkpoints/step-000004", "final", "lisa_offload/rank-0", "logs/tensorboard"):
        (run / d).mkdir(parents=True)
    (run / "recipe.yaml").write_text("x")
    (run / "metrics.jsonl").write_text("{}")
    with pytest.raises(LisaftError, match="already holds a run"):
        check_output_dir(run, overwrite=False, force=False)
    check_output_dir(run, overwrite=True, force=False)  # only lisaft's files: fine
    (run / "notes.txt").write_text("mine")
    with pytest.raises(LisaftError, match=r"did not write \(notes.txt\).*--force"):
        check_output_dir(run, overwrite=True, force=False)
    check_output_dir(run, overwrite=True, force=True)
    with pytest.raises(LisaftError, match="--force only goes with --overwrite"):
        check_output_dir(run, overwrite=False, force=True)
    clear_run(run)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_files_get_the_mode_a_new_file_gets(tmp_path):
    import os

    from safetensors.torch import save_file

    from lisaft.run_folder import give_files_the_usual_mode

    before = os.umask(0o027)
    try:
        save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text("{}")
        give_files_the_usual_mode(tmp_path)
        assert {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()} == \
            {"model.safetensors": 0o640, "config.json": 0o640}
    finally:
        os.umask(before)


def test_a_run_folder_whose_final_cannot_be_replaced_is_refused_at_start(tmp_path):
    from lisaft.run_folder import live

    run = open_dir(tmp_path) / "run"
    (run / "final").mkdir(parents=True)
    (run / "recipe.yaml").write_text("x")
    run.chmod(0o777)
    (run / "final").chmod(0o555)

    def start():
        with live(run):
            pass

    message = lisaft_error_as_unprivileged(start)
    assert message and f"{run / 'final'}: no permission to write it" in message, message


def test_a_refused_permission_is_not_called_a_full_disk(tmp_path):
    from lisaft.run_folder import write_failed

    denied = write_failed(tmp_path, PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x")))
    assert "Permission denied" in str(denied) and "once you may write there again" in str(denied)
    assert "room" not in str(denied)
    full = write_failed(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    assert "once the disk has room" in str(full)


def test_docs_resume_quotes_the_live_refusal_as_it_is(tmp_path):
    """docs/resume.md gives the line a second process gets, command included, as lisaft writes it."""
    import os
    import socket
    from pathlib import Path

    from lisaft.run_folder import live

    run = tmp_path / "RUN"
    run.mkdir()
    with live(run), pytest.raises(LisaftError) as refused:
        with live(run):
            pass
    said = str(refused.value).replace(str(run), "RUN").replace(str(os.getpid()), "PID")
    said = said.replace(socket.gethostname(), "HOST")
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "resume.md").read_text().split())
    assert f"``{said} ``" in doc, said


def test_metrics_records_are_flushed_each_and_reach_the_disk_at_a_sync(tmp_path, monkeypatch):
    """An fsync per record cost a small model's step as much as its optimizer: the records are
    flushed (a killed process loses none) and fsynced once, before the checkpoint a resume
    truncates metrics.jsonl to (the loop calls sync before it saves)."""
    import os

    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 4):
        log.write({"step": step})
        assert (tmp_path / "metrics.jsonl").read_text().count("\n") == step  # flushed, readable now
    assert not synced
    log.sync()
    assert len(synced) == 1
