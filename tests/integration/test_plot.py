"""`lisaft plot`: a PNG from one run and from two runs overlaid."""

import shutil

import pytest
from typer.testing import CliRunner

from lisaft.cli import app

pytest.importorskip("matplotlib")
runner = CliRunner()


def _png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path
    return data


def test_plot_one_run_and_two_runs(tiny_run):
    recipe = tiny_run()
    assert runner.invoke(app, ["train", str(recipe)]).exit_code == 0
    run = tiny_run.dir / "run"
    result = runner.invoke(app, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    _png(run / "plot.png")

    other = tiny_run.dir / "other"
    shutil.copytree(run, other)
    # A run still being written: its last line is cut short.
    with (other / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "lo')
    out = tiny_run.dir / "both.png"
    result = runner.invoke(app, ["plot", str(run), str(other), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert _png(out) != _png(run / "plot.png")


def test_plot_of_a_folder_that_is_no_run_is_one_error_line(tmp_path):
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: {tmp_path}: not a lisaft run (no metrics.jsonl)"]


@pytest.mark.parametrize("content, says", [
    ("", "no train or eval records yet: nothing to plot"),
    ('{"step": 1, "loss": 2.0, "lr": 0.1}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0, "lr": 0.1}\n',
     "line 2 is not a metrics record (a corrupt file?)"),
    ("\x00\x00garbage\n", "line 1 is not a metrics record (a corrupt file?)"),
    ('[1, 2]\n{"step": 1, "loss": 2.0}\n', "line 1 is not a metrics record (a corrupt file?)"),
])
def test_plot_of_an_empty_or_corrupt_metrics_file_fails_with_one_line(tmp_path, content, says):
    (tmp_path / "metrics.jsonl").write_text(content)
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: {tmp_path / 'metrics.jsonl'}: {says}"]
    assert not (tmp_path / "plot.png").exists()
