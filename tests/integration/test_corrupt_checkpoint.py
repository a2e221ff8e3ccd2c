"""A checkpoint corrupted in place (bytes garbled at the same size, or the file cut short), in any
of its files: resume falls back to the previous complete checkpoint with one line naming the
checkpoint and the file, and continues as the uninterrupted run, bit for bit. With none left it
refuses in one line."""

import shutil

import pytest
from test_resume import assert_same_run
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.train import train

runner = CliRunner()
FILES = ["state.json", "recipe.json", "weights/head.safetensors", "optimizer/head.pt", "rng-rank0.pt"]


@pytest.fixture(scope="module")
def runs(shared_tiny_run):
    """The uninterrupted run, and one stopped at step 6 with checkpoints at 2, 4 and 6."""
    common = dict(training={"max_steps": 8, "save_every": 2, "keep_last": 3, "eval_every": 0})
    assert train(shared_tiny_run("ref.yaml", **common), overrides=["training.output_dir=ref"], show=False) == 0
    cut = shared_tiny_run("cut.yaml", **common)
    assert train(cut, overrides=["training.output_dir=cut"], show=False, _stop_at=6) != 0
    return shared_tiny_run.dir / "ref", shared_tiny_run.dir / "cut"


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])  # same size, other bytes
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["garbled", "truncated"])
@pytest.mark.parametrize("rel", FILES)
def test_a_damaged_file_falls_back_to_the_previous_checkpoint(runs, tmp_path, rel, how):
    ref, cut = runs
    run = shutil.copytree(cut, tmp_path / "run")
    _damage(run / "checkpoints" / "step-000006" / rel, how)
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if "skipping checkpoint" in ln]
    assert len(lines) == 1 and "step-000006" in lines[0] and rel in lines[0], result.output
    assert "Traceback" not in result.output and "from step-000004" in result.output
    assert_same_run(run, ref)


def test_every_checkpoint_damaged_is_a_one_line_refusal(runs, tmp_path):
    _, cut = runs
    run = shutil.copytree(cut, tmp_path / "run")
    for ckpt in (run / "checkpoints").iterdir():
        _damage(ckpt / "weights" / "head.safetensors", "garbled")
    result = runner.invoke(app, ["resume", str(run)])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "weights/head.safetensors" in errors[0] and "--overwrite" in errors[0]
    assert "Traceback" not in result.output
