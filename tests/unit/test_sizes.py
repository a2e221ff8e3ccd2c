"""No function in lisaft/ over 60 lines and no module over 400, except those docs/code.md lists
under "Size" with the reason; a listed exception that no longer needs to be listed fails too, so
the list stays true."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION, MAX_MODULE = 60, 400


def oversized(package: Path, root: Path = ROOT) -> set[str]:
    """'path' for each module over MAX_MODULE lines, 'path:function' for each function over
    MAX_FUNCTION (a method is 'path:Class.method'), paths relative to the repository."""
    found = set()
    for f in sorted(package.rglob("*.py")):
        src = f.read_text()
        rel = f.relative_to(root).as_posix()
        if len(src.splitlines()) > MAX_MODULE:
            found.add(rel)
        found |= {f"{rel}:{name}" for name, lines in _functions(ast.parse(src)) if lines > MAX_FUNCTION}
    return found


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def allowed() -> set[str]:
    """The backquoted names on the '- ' lines of docs/code.md's "## Size" section."""
    text = (ROOT / "docs" / "code.md").read_text()
    section = text.split("\n## Size\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for line in section.splitlines() if line.startswith("- ")
            for m in [re.match(r"- `([^`]+)`", line)] if m}


def test_functions_and_modules_are_within_size_or_listed_in_docs():
    found, listed = oversized(ROOT / "lisaft"), allowed()
    assert not found - listed, f"over {MAX_FUNCTION} lines a function or {MAX_MODULE} a module, and not " \
        f"listed in docs/code.md's Size section: {sorted(found - listed)}"
    assert not listed - found, f"listed in docs/code.md's Size section but within size now: {sorted(listed - found)}"


def test_the_size_check_sees_a_long_function_and_a_long_module(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION))
    (tmp_path / "pkg").mkdir()
    source = f"class A:\n    def long(self):\n{body}\n    def short(self):\n        pass\n"
    (tmp_path / "pkg" / "a.py").write_text(source)
    (tmp_path / "pkg" / "b.py").write_text("x = 1\n" * (MAX_MODULE + 1))
    (tmp_path / "pkg" / "c.py").write_text("x = 1\n" * MAX_MODULE)
    assert oversized(tmp_path / "pkg", tmp_path) == {"pkg/a.py:A.long", "pkg/b.py"}
