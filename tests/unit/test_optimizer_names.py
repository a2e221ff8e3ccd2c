"""An optimizer's name is decoded in one place, config/optimizers.py's table: every other module
of lisaft/ reads a property of `optimizer_kind(name)`, so a new optimizer is one row there and no
decision elsewhere takes a wrong branch on a name it does not know. Read from the source (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

from lisaft.config.optimizers import OPTIMIZERS

PACKAGE = Path(__file__).resolve().parents[2] / "lisaft"
TABLE = PACKAGE / "config" / "optimizers.py"
# The names and the words they are spelled from (paged, 8bit, apollo, mini, ...).
WORDS = set(OPTIMIZERS) | {w for n in OPTIMIZERS for w in n.split("_")}
STRING_TESTS = {"startswith", "endswith", "removeprefix", "removesuffix", "split", "partition", "find",
                "index", "count", "replace"}


def _spelling(node: ast.AST) -> str | None:
    """The optimizer name or word a constant (or a tuple/list/set of them) spells, if any."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip("_") in WORDS:
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return next((s for e in node.elts if (s := _spelling(e)) is not None), None)
    return None


def spelling_decisions(source: str) -> list[str]:
    """'line: what' for each decision in `source` that reads an optimizer name's spelling: a
    comparison with a name or one of its words, a string method called with one, a match case on
    one, or a table keyed by names."""
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
            hits = [k.value for k in node.keys
                    if isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value in OPTIMIZERS]
        found += [f"{node.lineno}: {h!r}" for h in hits if h is not None]
    return found


def test_no_module_but_the_table_decides_by_an_optimizer_names_spelling():
    found = [f"{path.relative_to(PACKAGE.parent)}:{hit}" for path in sorted(PACKAGE.rglob("*.py")) if path != TABLE
             for hit in spelling_decisions(path.read_text())]
    assert not found, "decisions on an optimizer name's spelling outside config/optimizers.py (read a " \
        "property of optimizer_kind(name) instead):\n" + "\n".join(found)


def test_the_check_sees_each_way_of_reading_a_spelling():
    for source in ('paged = "paged" in name', 'mini = name == "apollo_mini"', 'x = name.startswith("paged_")',
                   'x = name not in ("adamw_8bit", "paged_adamw_8bit")', 'x = {"adamw_32bit": 8}[name]',
                   'match name:\n    case "apollo":\n        pass'):
        assert spelling_decisions(source), source
    for source in ('paged = optimizer_kind(name).paged', 'Option({"optimizer.name": "adamw_8bit"})',
                   'x = s.optimizer == opt', 'x = name == "cosine"'):
        assert not spelling_decisions(source), source
