"""--version, flags that look like flags, help for every option within 80 columns, and the
paged-memory explanation only when asked for."""

import re

import pytest
from typer.testing import CliRunner

from lisaft import __version__
from lisaft.cli import app

runner = CliRunner()
COMMANDS = ["train", "resume", "estimate-memory", "plot", "generate"]


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"lisaft {__version__}"


@pytest.mark.parametrize("command", [[]] + [[c] for c in COMMANDS])
def test_help_fits_80_columns_and_explains_every_option(command):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(l) for l in lines) <= 80, [l for l in lines if len(l) > 80]
    assert "<bool>" not in result.output
    # An option line whose help column is empty and not continued on the next line has no help.
    options = [i for i, l in enumerate(lines) if re.match(r"\s+-", l)]
    for i in options:
        has_help = len(re.split(r"\s{2,}", lines[i].strip())) > 1 or (
            i + 1 < len(lines) and lines[i + 1].startswith(" " * 20) and not lines[i + 1].strip().startswith("-"))
        assert has_help, lines[i]


def test_overwrite_is_a_flag(tiny_run):
    result = runner.invoke(app, ["train", str(tiny_run()), "--overwrite", "true"])
    assert result.exit_code == 2 and "unexpected extra argument" in result.output.lower()


def test_paged_explanation_only_with_explain():
    args = ["estimate-memory", "--model", "llama-3.1-8b", "--optimizer", "paged_adamw_8bit", "--budget", "80GiB"]
    plain = runner.invoke(app, args, env={"COLUMNS": "200"})
    explained = runner.invoke(app, [*args, "--explain"], env={"COLUMNS": "200"})
    assert plain.exit_code == explained.exit_code == 0
    assert "Paged optimizer state:" in plain.output and "--explain" in plain.output
    assert "unified memory" not in plain.output
    assert "unified memory" in explained.output
