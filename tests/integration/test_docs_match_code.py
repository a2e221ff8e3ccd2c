"""Docs that name what the code does: the metrics fields in the README, the keys `resume --set`
may change."""

import re
from pathlib import Path

from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.config.schema import CADENCE_KEYS
from lisaft.metrics.log import read_metrics

REPO = Path(__file__).resolve().parents[2]


def _documented_fields(kind: str) -> set[str]:
    text = " ".join((REPO / "README.md").read_text().split())
    m = re.search(rf"an? {kind} record holds (.+?)(;|\.\s)", text, re.IGNORECASE)
    assert m, f"README no longer lists the {kind} record's fields"
    words = re.sub(r"\([^)]*\)", "", m.group(1)).replace(" and ", ", ").split(",")
    return {w.strip() for w in words if w.strip()}


def test_metrics_fields_in_the_readme_are_the_records_fields(tiny_run):
    from lisaft.train import train

    recipe = tiny_run(training={"max_steps": 2, "eval_every": 2})
    assert train(recipe, show=False) == 0
    records = read_metrics(tiny_run.dir / "run" / "metrics.jsonl")
    assert _documented_fields("train") == set(next(r for r in records if "loss" in r))
    assert _documented_fields("eval") == set(next(r for r in records if "eval_loss" in r))


def test_resume_help_names_every_key_a_resume_may_change():
    result = CliRunner().invoke(app, ["resume", "--help"], terminal_width=400)
    text = " ".join(result.output.split())
    missing = [k for k in CADENCE_KEYS if k not in text]
    assert not missing, missing


def test_gpu_table_in_docs_is_the_catalogue():
    from lisaft.memory.gpus import GPUS

    rows = re.findall(r"^\| `([a-z0-9-]+)` \| \d+ MiB \| (\d+) MiB", (REPO / "docs" / "memory.md").read_text(), re.M)
    assert {name: int(usable) * 2**20 for name, usable in rows} == {g.name: g.usable_bytes for g in GPUS.values()}


def _synopsis_flags() -> dict[str, set[str]]:
    """The flags the README's command synopsis shows, per command; `--[no-]x` stands for both."""
    block = (REPO / "README.md").read_text().split("## The commands", 1)[1].split("\n\n", 2)[1]
    flags: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        m = re.match(r"\s*lisaft ([a-z-]+)", line)
        if m:
            command = m.group(1)
        for prefix, name in re.findall(r"--(\[no-\])?([a-z][a-z-]*)", line):
            flags.setdefault(command, set()).update({f"--{name}"} | ({f"--no-{name}"} if prefix else set()))
    return flags


def test_the_readme_synopsis_shows_every_flag_of_every_command():
    documented = _synopsis_flags()
    for command in ("train", "data", "resume", "estimate-memory", "plot", "generate"):
        result = CliRunner().invoke(app, [command, "--help"], terminal_width=400)
        offered = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", result.output)) - {"--help"}
        assert documented.get(command, set()) == offered, command
