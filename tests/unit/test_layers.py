"""The layers of docs/code.md, read from the source: a module imports only from its own layer or
the ones below it. A new upward import fails here, and the fix is to move code down (or, where an
upward arrow is the honest design, to add it to ALLOWED with the reason)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lisaft"

# Bottom to top, as docs/code.md draws them.
LAYERS = [
    {"errors", "console", "internals", "env"},
    {"config"},
    {"data"},
    {"model"},
    {"distributed"},
    {"optim"},
    {"lisa", "memory"},
    {"checkpoint"},
    {"run_folder"},
    {"metrics", "generate"},
    {"grpo"},
    {"train"},
    {"cli", "__main__"},
]
# (importer's group, imported group): why it is allowed. Empty: every arrow points down.
ALLOWED: dict[tuple[str, str], str] = {}


def _group(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _level(group: str) -> int:
    for i, layer in enumerate(LAYERS):
        if group in layer:
            return i
    raise AssertionError(f"lisaft.{group} is in no layer of tests/unit/test_layers.py")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lisaft"):
            if node.module == "lisaft":
                found.update(f"lisaft.{a.name}" for a in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lisaft."))
    return found


def _module(path: Path) -> str:
    return "lisaft." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def test_every_module_sits_in_a_layer():
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py" or path.parent != PACKAGE:
            _level(_group(_module(path)))


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _group(_module(path))
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue
        for target in _imports(path):
            there = _group(target)
            if there == "__version__":
                continue
            if _level(there) > _level(here) and (here, there) not in ALLOWED:
                upward.append(f"{_module(path)} imports {target}")
    assert not upward, "imports that point up a layer (docs/code.md):\n" + "\n".join(upward)


def test_the_top_level_stays_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


def test_no_package_binds_a_submodule_name_to_something_else():
    """`import lisaft.train.resume` gives resume.py: a package that re-exported a function of
    that name would hand out the function instead."""
    import importlib
    import pkgutil

    hidden = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        name = _module(init).removesuffix(".__init__")
        package = importlib.import_module(name)
        for sub in pkgutil.iter_modules([str(init.parent)]):
            value = getattr(package, sub.name, None)
            if value is not None and value is not importlib.import_module(f"{name}.{sub.name}"):
                hidden.append(f"{name}.{sub.name}")
    assert not hidden, f"package attributes that hide a submodule of that name: {hidden}"
