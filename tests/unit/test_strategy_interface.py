"""Nothing but the parallel strategy asks which strategy runs (docs/code.md, "The parallel
strategy"): in train/ and model/, outside train/parallel.py, no hasattr or getattr on the
optimizers or the strategy, no isinstance on a strategy's type, its optimizers' or FSDP's, no
read of training.fsdp and no import of distributed/fsdp.py. Read from the source (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lisaft"
OWNER = PACKAGE / "train" / "parallel.py"
# What only a strategy may know it is: its classes, its optimizers', FSDP's module.
TYPES = {"Strategy", "SingleProcess", "DataParallel", "CpuOffload", "Fsdp", "OffloadedOptimizers",
         "UnitOptimizers", "FSDPModule", "DTensor"}
ASKED = ("optimizers", "parallel", "strategy")


def questions(source: str) -> list[str]:
    """'line: what' for each place in `source` that asks which strategy runs."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("hasattr", "getattr") and node.args and \
                    any(w in ast.unparse(node.args[0]) for w in ASKED):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
            if node.func.id in ("isinstance", "issubclass") and len(node.args) == 2 and \
                    {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & TYPES:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr == "fsdp":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module and \
                (node.module.startswith(("lisaft.distributed.fsdp", "torch.distributed.fsdp"))
                 or (node.module == "lisaft.distributed" and any(a.name == "fsdp" for a in node.names))):
            found.append(f"{node.lineno}: from {node.module} import ...")
    return found


def test_only_the_strategy_knows_which_strategy_runs():
    found = [f"{path.relative_to(PACKAGE.parent)}:{q}" for folder in ("train", "model")
             for path in sorted((PACKAGE / folder).rglob("*.py")) if path != OWNER
             for q in questions(path.read_text())]
    assert not found, "questions about the strategy outside lisaft/train/parallel.py (make it a method " \
        "of the strategy):\n" + "\n".join(found)


def test_the_check_sees_each_way_of_asking():
    for source in ('if hasattr(optimizers, "wait_in_forward"): pass', 'x = recipe.training.fsdp',
                   'def f(m):\n    from torch.distributed.fsdp import FSDPModule\n    return isinstance(m, FSDPModule)',
                   'from lisaft.distributed.fsdp import local_tensor', 'x = isinstance(o, (int, OffloadedOptimizers))',
                   'x = getattr(session.parallel, "shards", None)'):
        assert questions(source), source
    for source in ('x = session.parallel.weights_bytes(model)', 'x = hasattr(model.config, "use_cache")',
                   'x = isinstance(mod, nn.Module)'):
        assert not questions(source), source


def test_each_strategy_answers_for_itself():
    from lisaft.config.schema import recipe_from_dict
    from lisaft.train.parallel import Fsdp, SingleProcess, Strategy

    def recipe(**training):
        return recipe_from_dict({"model": {"name_or_path": "m"}, "data": {"train": "t.jsonl"},
                                 "training": {"max_steps": 1, "output_dir": "r", **training}})

    one, sharded = SingleProcess(recipe()), Fsdp(recipe(fsdp=True))
    assert isinstance(one, Strategy) and isinstance(sharded, Strategy)
    # FSDP needs a process group even on one rank, and its losses run the model's own forward.
    assert one.resume_command(Path("RUN")) == "lisaft resume RUN"
    assert sharded.resume_command(Path("RUN")) == "torchrun --nproc-per-node 1 -m lisaft resume RUN"
    assert not one.sharded_forward and sharded.sharded_forward
    assert one.host_rows(estimate=None) == []  # cpu_offload's: tests/integration/test_run_guards.py
