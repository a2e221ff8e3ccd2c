"""benchmarks/offload_bench.py --quick: the result has the documented shape and the pieces are
timed. The figures docs/memory.md quotes come from the full run; this keeps its code from rotting."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_offload_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.offload_bench", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((tmp_path / "offload.json").read_text())
    assert s["mode"] == "quick" and s["results"]
    for r in s["results"]:
        assert set(r["seconds"]) == {"copy_in", "accumulate", "step", "copy_out"}
        assert r["seconds"]["step"] > 0 and all(v >= 0 for v in r["seconds"].values())
        assert r["params"] > 0 and r["seconds_per_1e9_params"]["step"] == r["seconds"]["step"] * 1e9 / r["params"]
    assert "| adamw_8bit | 1 |" in (tmp_path / "offload.md").read_text()


def test_hidden_step_bench_small(tmp_path):
    """benchmarks/hidden_step_bench.py at its smallest: both modes timed, the documented shape."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.hidden_step_bench", "--layers", "2", "--steps", "2",
                           "--hidden", "128", "--seq", "32", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((tmp_path / "hidden_step_adamw_8bit.json").read_text())
    assert set(s["modes"]) == {"after", "as_ready"} and s["params"] > 0
    for m in s["modes"].values():
        assert 0 < m["tail_s"] <= m["s_per_step"]


def test_host_step_bench_small(tmp_path):
    """benchmarks/host_step_bench.py at its smallest: every moment type and accumulator timed
    beside the triad, the documented keys, and float32 accumulators the more precise."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.host_step_bench", "--params", "65536", "--reps", "1",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "host_step.json").read_text())
    assert r["triad_gb_s"] > 0 and "load_avg_1min" in r
    acc = r["accumulate"]
    assert set(acc) == {"bfloat16", "float32"}
    for row in acc.values():
        assert row["s_per_1e9_params"] > 0 and row["share_of_triad"] > 0 and row["torch"]["share_of_triad"] > 0
    assert acc["bfloat16"]["bytes_per_param"] == 6 and acc["float32"]["bytes_per_param"] == 10
    assert 0 < acc["float32"]["rel_error_32_micro_batches"] < acc["bfloat16"]["rel_error_32_micro_batches"] < 0.05


def test_offload_e2e_bench_quick():
    """benchmarks/offload_e2e_bench.py --quick: resident, device and host timed through the
    trainer's step, their counted transfers, and both offloaded runs end with the resident run's
    weights bit for bit."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.offload_e2e_bench", "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout[proc.stdout.index("{"):])["accum_4"]
    assert r["same_weights_bit_for_bit"] == {"device": True, "host": True}
    weights = r["host"]["offload_h2d_bytes"]  # every weight stepped and sent back once
    assert r["host"]["offload_d2h_bytes"] > 3 * weights and r["host"]["host_grad_additions"] > 0
    assert r["device"]["host_grad_additions"] == 0 and r["device"]["offload_d2h_bytes"] > weights
    assert all(r[arm]["tokens_per_s"] > 0 for arm in ("resident", "device", "host"))


def test_recompute_bench_quick():
    """benchmarks/recompute_bench.py --quick: the hook put back recomputes the frozen layers below
    the lowest active one, lisaft's settings do not."""
    from benchmarks import recompute_bench

    r = recompute_bench.main(["--quick"])
    for row in r["sets"]:
        lowest = min(row["active_layers"])
        assert row["recomputed_before"] == 4 and row["recomputed_after"] == 4 - lowest
