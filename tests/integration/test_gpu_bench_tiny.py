"""benchmarks/gpu_8b_24gb.py --tiny: the GPU benchmark's code path, on CPU, so it cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_tiny_mode(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_8b_24gb.py"), "--tiny",
                           "--steps", "3", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["mode"] == "tiny-cpu" and summary["lisa_fits_cap"] is True
    runs = {r["run"]: r for r in summary["runs"]}
    assert set(runs) == {"lisa", "full"}
    for r in runs.values():
        assert r["steps_done"] == 3 and not r["oom"]
        assert r["tokens_per_s"] > 0 and r["estimated_total_bytes"] > 0 and r["peak_rss_bytes"] > 0
    assert runs["full"]["in_backward"] and not runs["full"]["lisa"]
    assert runs["lisa"]["lisa"] and runs["lisa"]["optimizer"] == "paged_adamw_8bit"
    # LISA keeps moments for 2 of 4 layers plus embeddings and head only.
    assert runs["lisa"]["optimizer_state_bytes"] < runs["full"]["optimizer_state_bytes"]
    assert "| lisa |" in proc.stdout and "| full |" in proc.stdout
