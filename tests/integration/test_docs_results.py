"""docs/results.md, the index of every figure the README and docs quote: each row's result file
exists and holds the row's figures, each figure quoted in the README is there, every measured
figure of the README has a row, and the committed estimates are what the estimator says now."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results.md"
HEADER = "| figure | quoted in | command | result |"
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _rows() -> list[dict]:
    rows, in_table = [], False
    for line in RESULTS.read_text().splitlines():
        if line.strip() == HEADER:
            in_table = True
            continue
        if not in_table or not line.startswith("|"):
            in_table = in_table and line.startswith("|")
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if set(cells[0]) <= {"-", " "}:
            continue
        assert len(cells) == 4, line
        figure, quoted, command, result = cells
        rows.append({"line": line, "figures": [f for f in re.findall(r"`([^`]+)`", figure) if re.match(r"[-−+]?\d", f)],
                     "text": figure, "quoted": quoted, "command": command, "result": result})
    return rows


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "") for n in NUMBER.findall(text)]


def _signed(text: str) -> list[str]:
    """Numbers with their sign: a minus right before the digits, not a dash between two figures."""
    return [n.replace(",", "").replace("−", "-") for n in re.findall(r"(?<![\w.])[-−]?\d[\d,]*(?:\.\d+)?", text)]


def _in_file(figure: str, text: str) -> bool:
    """As written, or each of its numbers as a number of the file rounded to the figure's digits
    (as it is, as a fraction's percentage, or in thousandths: seconds as ms)."""
    if figure in text:
        return True
    values = [float(n) for n in _signed(text)]
    for wanted in _signed(figure):
        digits = len(wanted.split(".")[1]) if "." in wanted else 0
        target = float(wanted)
        if not any(round(scale * v, digits) == target for v in values for scale in (1, 100, 1000)):
            return False
    return True


def _files(result: str) -> list[Path]:
    return [(RESULTS.parent / link).resolve() for link in re.findall(r"\]\(([^)#]+)\)", result)]


def test_every_row_names_a_committed_result_or_says_why_not():
    rows = _rows()
    assert len(rows) >= 20
    for row in rows:
        files = _files(row["result"])
        if not files:
            assert row["result"].startswith("none: ") and len(row["result"]) > 40, row["line"]
            continue
        assert row["figures"], row["line"]
        text = "\n".join(f.read_text() for f in files)
        for f in files:
            assert f.is_relative_to(REPO / "benchmarks" / "results"), f
        missing = [fig for fig in row["figures"] if not _in_file(fig, text)]
        assert not missing, (row["line"], missing)


def _prose(path: Path) -> str:
    """A page's text without code spans and indented command lines, on one line."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("    "))
    return " ".join(re.sub(r"`[^`]*`", " ", text).split())


def test_each_figure_quoted_in_the_readme_is_there_and_every_measured_readme_figure_has_a_row():
    readme = " ".join((REPO / "README.md").read_text().split())
    listed = set()
    for row in _rows():
        listed.update(_numbers(row["text"]))  # derived figures too, written out in the row
        if "README" in row["quoted"].split(", "):
            for fig in row["figures"]:
                assert all(re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", readme.replace(",", ""))
                           for n in _numbers(fig)), (fig, row["line"])
    # A figure with a unit of measurement in the README's prose (not in a command) has a row.
    unlisted = sorted(_measured(_prose(REPO / "README.md"), UNITS) - listed)
    assert not unlisted, unlisted
    assert "docs/results.md" in readme
    # The recipes' headers quote measured figures (times, ratios, shares) from here too; their
    # estimates are the estimator's own lines.
    for recipe in (REPO / "recipes").glob("*.yaml"):
        header = recipe.read_text().split("\nmodel:")[0]
        assert not _measured(header, r"\s?%|x\b| s\b") - listed, recipe.name


UNITS = r"\s?%|x\b|×|\s?GiB|\s?MiB| s\b"


def _measured(text: str, units: str) -> set[str]:
    return {f.replace(",", "") for f in re.findall(rf"(\d[\d,]*\.\d+|\d+)(?:{units})", text)}


def test_the_quickstart_rows_say_what_varies_between_machines():
    text = " ".join(RESULTS.read_text().split())
    section = text[text.index("## The quickstart"):text.index("## The ways")]
    assert "the last digits of the accuracies are not" in section


def _estimated(path: Path, overrides: list[str]) -> str:
    from lisaft.config.schema import load_recipe
    from lisaft.memory.command import settings_from_recipe
    from lisaft.memory.estimate import compute

    # The committed estimates of cpu_offload recipes were written with --host-ram 64GiB, which sets
    # the layer-major backward's group and so its GPU terms; the others do not depend on it.
    s = settings_from_recipe(load_recipe(path, overrides)).with_(host_budget_bytes=64 * 2**30)
    return f"{compute(s).total_bytes / 2**30:.2f} GiB"


@pytest.mark.parametrize("name,recipe,overrides", [
    ("apollo-24gb", "llama3.1-8b-apollo-24gb.yaml", []),
    ("apollo-r32-24gb", "llama3.1-8b-apollo-24gb.yaml",
     ["optimizer.name=apollo", "optimizer.rank=32", "optimizer.scale=1", "optimizer.scale_type=channel"]),
    ("full-24gb", "llama3.1-8b-full-24gb.yaml", []),
    ("full-24gb-host", "llama3.1-8b-full-24gb.yaml", ["optimizer.offload_accumulation=host"]),
    ("lisa-24gb", "llama3.1-8b-lisa-24gb.yaml", []),
    ("lisa-16k-24gb", "llama3.1-8b-lisa-16k-24gb.yaml", []),
    ("lora-24gb", "llama3.1-8b-lora-24gb.yaml", []),
    ("qlora-24gb", "llama3.1-8b-qlora-24gb.yaml", []),
    ("dpo-24gb", "llama3.1-8b-dpo-24gb.yaml", []),
    ("lora-dpo-24gb", "llama3.1-8b-lora-dpo-24gb.yaml", []),
    ("grpo-24gb", "llama3.1-8b-grpo-24gb.yaml", []),
    ("lora-grpo-24gb", "llama3.1-8b-lora-grpo-24gb.yaml", []),
])
def test_the_committed_estimates_are_the_estimators(name, recipe, overrides):
    committed = (REPO / "benchmarks" / "results" / "estimates" / f"{name}.txt").read_text()
    assert f"Fits: {_estimated(REPO / 'recipes' / recipe, overrides)} of" in committed
