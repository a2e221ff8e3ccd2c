"""benchmarks/precision_bench.py --quick: the result has the documented shape, and with adamw_32bit
at lr 1e-5 stochastic rounding keeps the float32 run's loss decrease while round-to-nearest loses
most of it. The full comparison is docs/precision.md; this keeps its code path from rotting."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = {"float32", "bf16_nearest", "bf16_stochastic"}
KINDS = {"layer_matrices", "norms", "embeddings_head"}


def test_precision_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.precision_bench", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((tmp_path / "precision.json").read_text())
    assert s["mode"] == "quick" and s["lr"] == 1e-5
    steps = s["settings"]["steps"]
    runs = s["results"]["adamw_32bit"]
    assert set(runs) == MODES
    for mode, r in runs.items():
        for key in ("changed_after_1", f"changed_after_{steps}"):
            assert set(r[key]) == KINDS and all(0.0 <= v <= 1.0 for v in r[key].values()), (mode, key)
        assert r["tokens_per_s"] > 0 and r["update_ms_median"] > 0
        assert -1.0 <= r["update_cosine_with_float32"] <= 1.0 + 1e-9
    ref, near, sto = runs["float32"], runs["bf16_nearest"], runs["bf16_stochastic"]
    assert ref["eval_loss_decrease"] > 0 and ref["share_of_float32_decrease"] == 1.0
    assert ref["changed_after_1"]["layer_matrices"] == 1.0
    # Most Adam steps at lr 1e-5 are below half a bf16 ulp: nearest drops them, stochastic keeps
    # them in expectation, so only the stochastic run keeps changing its matrices and learning.
    assert sto["share_of_float32_decrease"] >= 0.9, sto
    assert near["share_of_float32_decrease"] < 0.6, near
    changed = f"changed_after_{steps}"
    assert sto[changed]["layer_matrices"] > 2 * near[changed]["layer_matrices"]
    assert sto["update_cosine_with_float32"] > near["update_cosine_with_float32"]
    assert set(s["update_microbench_ms"]["adamw_32bit"]) == MODES
    assert "| adamw_32bit | bf16_stochastic |" in (tmp_path / "precision.md").read_text()
