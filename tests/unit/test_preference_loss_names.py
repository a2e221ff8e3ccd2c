"""A preference loss's name is decoded in one place, config/preference_losses.py's table: every
other module of lisaft/ reads a property of `preference_loss(name)` (its reference, its data, its
form), so a new loss is one row there and its formula, and no decision elsewhere takes a wrong
branch on a name it does not know. Read from the source (ast), as for optimizer names."""

from __future__ import annotations

import ast
from pathlib import Path

from lisaft.config.preference_losses import PREFERENCE_LOSSES

PACKAGE = Path(__file__).resolve().parents[2] / "lisaft"
TABLE = PACKAGE / "config" / "preference_losses.py"
STRING_TESTS = {"startswith", "endswith", "removeprefix", "removesuffix", "split", "partition", "find",
                "index", "count", "replace"}


def _spelling(node: ast.AST) -> str | None:
    """The loss name a constant (or a tuple/list/set of them) spells, if any."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in PREFERENCE_LOSSES:
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return next((s for e in node.elts if (s := _spelling(e)) is not None), None)
    return None


def spelling_decisions(source: str) -> list[str]:
    """'line: what' for each decision in `source` on a loss name's spelling: a comparison with a
    name, a string method called with one, a match case on one, or a table keyed by names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hits: list[str | None] = []
        if isinstance(node, ast.Compare):
            hits = [_spelling(n) for n in (node.left, *node.comparators)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STRING_TESTS:
            hits = [_spelling(a) for a in node.args]
        elif isinstance(node, ast.MatchValue):
            hits = [_spelling(node.value)]
        elif isinstance(node, ast.Dict):
            hits = [_spelling(k) for k in node.keys if k is not None]
        found += [f"{node.lineno}: {h!r}" for h in hits if h is not None]
    return found


def test_no_module_but_the_table_decides_by_a_loss_names_spelling():
    found = [f"{path.relative_to(PACKAGE.parent)}:{hit}" for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE
             for hit in spelling_decisions(path.read_text())]
    assert not found, "decisions on a preference loss's spelling outside config/preference_losses.py (read a " \
        "property of preference_loss(name) instead):\n" + "\n".join(found)


def test_the_check_sees_each_way_of_reading_a_spelling():
    for source in ('ref = loss == "dpo"', 'x = p.loss in ("simpo", "orpo")', 'x = {"dpo": 0.1}[name]',
                   'match loss:\n    case "orpo":\n        pass', 'x = name.startswith("dpo")'):
        assert spelling_decisions(source), source
    for source in ('ref = preference_loss(p.loss).reference', 'x = loss == "sigmoid"',
                   'recipe_from_dict({"preference": {"loss": "dpo"}})'):
        assert not spelling_decisions(source), source
