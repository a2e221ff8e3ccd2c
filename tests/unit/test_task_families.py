"""scripts/make_quickstart_assets.py: the shipped quickstart assets are what it makes, byte for
byte, and its task families hold the rules and the train/eval split they promise."""

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_quickstart_assets.py"


def _generator():
    spec = importlib.util.spec_from_file_location("make_quickstart_assets", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quickstart_assets_regenerate_byte_identical(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    shipped = REPO / "recipes" / "quickstart"
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made == sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file())
    for rel in made:
        assert (tmp_path / rel).read_bytes() == (shipped / rel).read_bytes(), rel


def test_new_task_family_rules_and_split():
    gen = _generator()
    train, evals = gen.task_rows(gen.FAMILIES["B"], random.Random(5), 300, 30)
    assert len(train) == 300 and len(evals) == 30
    assert not {r["input"] for r in train} & {r["input"] for r in evals}
    assert {r["instruction"] for r in train} == {"Shift", "Rotate", "Double"}
    expect = {"Shift": {"abj": "bck"}, "Rotate": {"abc": "bca"}, "Double": {"ab": "aabb"}}
    for name, cases in expect.items():
        for given, out in cases.items():
            assert gen.NEW_TASKS[name](given) == out
    for r in train + evals:
        assert gen.NEW_TASKS[r["instruction"]](r["input"]) == r["output"]
    # Family B shares no task with A, which the benchmark pre-trains on.
    assert not set(gen.FAMILIES["A"]) & set(gen.FAMILIES["B"])
