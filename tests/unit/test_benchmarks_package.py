"""The benchmarks are one package, run as `python -m benchmarks.NAME`: importing it sets the
process up as the command line does, and no benchmark edits sys.path to find lisaft or another."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_benchmarks_sets_the_process_up_as_lisaft_does():
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "PYTORCH_CUDA_ALLOC_CONF",
                        "PYTORCH_ALLOC_CONF")}
    code = "import os, sys, benchmarks; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PASSIVE", "False"]  # set before torch is imported


def test_no_benchmark_edits_sys_path_or_runs_itself_by_file():
    # A benchmark that starts itself again does so as `-m benchmarks.NAME` from the repository's
    # root: run by its file, it would not find the package.
    patterns = ("sys.path.insert", "sys.path.append", "sys.executable, __file__", "sys.executable, str(Path(__file__")
    offenders = [str(f.relative_to(ROOT)) for f in (ROOT / "benchmarks").rglob("*.py")
                 if any(p in f.read_text() for p in patterns)]
    assert not offenders
