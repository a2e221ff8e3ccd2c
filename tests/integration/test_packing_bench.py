"""benchmarks/packing_bench.py --quick: every contender runs on the same examples and the result
has the documented shape; the full comparison is docs/data.md's."""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTENDERS = {"batch1", "padded8", "concat", "packed", "padding_free"}


def test_packing_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.packing_bench", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((tmp_path / "packing.json").read_text())
    assert s["mode"] == "quick" and set(s["runs"]) == CONTENDERS
    runs = {name: r[0] for name, r in s["runs"].items()}
    # Every contender but the old concatenation trains on exactly the same real tokens.
    real = {name: r["real_tokens"] for name, r in runs.items() if name != "concat"}
    assert len(set(real.values())) == 1
    assert runs["concat"]["real_tokens"] + runs["concat"]["dropped_tokens"] == runs["packed"]["real_tokens"]
    for name in ("batch1", "concat", "padding_free"):
        assert runs[name]["real_share"] == 1.0
    assert runs["packed"]["real_share"] > runs["padded8"]["real_share"]
    assert runs["packed"]["fill"] >= 0.9 and runs["packed"]["summary"].startswith("packing: 64 examples in ")
    for r in runs.values():
        # A step's peak growth is a CUDA figure: on a CPU freed pages are reused and it often reads 0.
        assert r["real_tokens_per_s"] > 0 and r["step_peak_bytes"] >= 0 and math.isfinite(r["eval_loss"])
    assert set(s["summary"]["targets"]) >= {"packed_fill_ok", "speedup_ok", "eval_loss_ok"}
    assert "| packed |" in (tmp_path / "packing.md").read_text()
    assert len({r["steps"] for r in runs.values()}) == 1
