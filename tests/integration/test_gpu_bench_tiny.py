"""benchmarks/gpu_run.sh and gpu_8b_24gb.py --tiny: the GPU suite's code path, on CPU, so it
cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env(tmp_path):
    # gpu_run.sh runs `python3`: make it this interpreter; no wheels to install here.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "OUT": str(tmp_path / "out"), "WHEELS": str(tmp_path / "none")}


def test_gpu_suite_tiny_mode_end_to_end(tmp_path):
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_run.sh"), "--tiny", "--configs",
                           "long-16k,full-in-backward,fsdp-ref,fsdp-1rank"],
                          capture_output=True, text=True, timeout=400, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    summary = json.loads((out / "gpu_8b_24gb.json").read_text())
    assert summary["mode"] == "tiny-cpu" and summary["complete"] is True
    runs = {r["run"]: r for r in summary["runs"]}
    assert list(runs) == ["long-16k", "full-in-backward", "fsdp-ref", "fsdp-1rank"]
    for r in runs.values():
        assert r["steps_done"] == 3 and not r["oom"]
        assert r["tokens_per_s"] > 0 and r["estimated_total_bytes"] > 0 and r["peak_rss_bytes"] > 0
        assert abs(r["estimate_error"]) < 0.5  # on CPU: against peak RSS
        assert r["flops_per_token"] > 0 and 0 < r["share_of_flop_bound"] < 1
    long = runs["long-16k"]
    assert long["offload_activations"] and long["lisa"] and long["seq_len"] == 128
    full = runs["full-in-backward"]
    assert full["in_backward"] and not full["lisa"]
    # LISA keeps moments for 2 of 4 layers plus embeddings and head only.
    assert long["optimizer_state_bytes"] < full["optimizer_state_bytes"]
    assert "| full-in-backward |" in (out / "gpu_8b_24gb.md").read_text()
    # training.fsdp on one rank (its own process group) trains the same steps; the table compares
    # its peak with the run without FSDP.
    assert runs["fsdp-1rank"]["last_loss"] == pytest.approx(runs["fsdp-ref"]["last_loss"], rel=1e-4)
    assert "training.fsdp on one rank against the same run without it" in (out / "gpu_8b_24gb.md").read_text()
    assert "| long-16k |" in (out / "gpu_8b_24gb.log").read_text()


def test_budget_skips_what_would_not_finish_and_still_writes(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_8b_24gb", "--tiny", "--budget-s", "0",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    import importlib.util

    suite = importlib.import_module("benchmarks.gpu_8b_24gb")
    assert summary["complete"] and [r["run"] for r in summary["runs"]] == [c.name for c in suite.CONFIGS]
    assert [r["run"] for r in summary["runs"][:3]] == ["headroom", "table-g2-s2048", "long-16k"]
    assert all(r["skipped"].startswith("budget") for r in summary["runs"])
