"""Nothing in the trainer asks which stage runs (docs/code.md, "Objectives"): in lisaft/train/,
outside train/objectives/, no read of a stage's recipe section or of data.format, no isinstance,
hasattr or getattr on the objective, no test of the objective against None, and no import of a
stage's own module (an objective's, model/preference.py, a data format's). The trainer calls the
objective instead. Read from the source (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lisaft"
TRAIN = PACKAGE / "train"
OWNER = TRAIN / "objectives"
# The recipe sections that choose a stage: SFT has none.
SECTIONS = {"preference", "grpo"}
STAGE_MODULES = ("lisaft.model.preference", "lisaft.data.formats", "lisaft.train.objectives.")


def _objective_classes() -> set[str]:
    return {node.name for path in OWNER.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)}


def stage_checks(source: str, classes: set[str] = frozenset()) -> list[str]:
    """'line: what' for each place in `source` that asks which stage runs."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Attribute) and (node.attr in SECTIONS or (
                node.attr == "format" and isinstance(node.value, ast.Attribute) and node.value.attr == "data")):
            what = ast.unparse(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            names = {n.id for n in ast.walk(node.args[-1]) if isinstance(n, ast.Name)}
            if node.func.id in ("isinstance", "issubclass") and names & (classes | {"Objective"}):
                what = ast.unparse(node)
            if node.func.id in ("hasattr", "getattr") and "objective" in ast.unparse(node.args[0]):
                what = ast.unparse(node)
        elif isinstance(node, ast.Compare) and "objective" in ast.unparse(node) and any(
                isinstance(c, ast.Constant) and c.value is None for c in node.comparators):
            what = ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(STAGE_MODULES):
            what = f"from {node.module} import ..."
        if what is not None:
            found.append(f"{node.lineno}: {what}")
    return found


def test_the_trainer_never_asks_which_stage_runs():
    classes = _objective_classes()
    found = [f"{path.relative_to(PACKAGE.parent)}:{q}" for path in sorted(TRAIN.rglob("*.py"))
             if OWNER not in path.parents for q in stage_checks(path.read_text(), classes)]
    assert not found, "stage checks in lisaft/train/ outside train/objectives/ (make it a method of the " \
        "objective):\n" + "\n".join(found)


def test_the_check_sees_each_way_of_asking():
    for source in ('if recipe.preference is not None: pass', 'pairs = session.recipe.data.format == "preference"',
                   'x = isinstance(session.objective, Pairs)', 'if session.objective is None: pass',
                   'x = getattr(session.objective, "reference", None)', 'from lisaft.model.preference import METRICS',
                   'from lisaft.train.objectives.pairs import evaluate_pairs', 'x = r.grpo.num_generations'):
        assert stage_checks(source, {"Pairs"}), source
    for source in ('x = session.objective.describe()', 'from lisaft.train.objectives import Objective',
                   'x = session.recipe.data.max_seq_len', 'x = isinstance(mod, nn.Module)'):
        assert not stage_checks(source, {"Pairs"}), source
