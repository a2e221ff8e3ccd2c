"""benchmarks/gpu_run.sh --dry-run and gpu_8b_24gb.py --tiny: the GPU suite's code path, on CPU, so
it cannot rot."""

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
    return {**os.environ, "PATH": path, "OUT": str(tmp_path / "out"), "WHEELS": str(tmp_path / "none"),
            "SITE": str(tmp_path / "site")}


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~100 s on a quiet machine; minutes on a loaded shared one
def test_gpu_suite_dry_run_end_to_end(tmp_path):
    """`bash benchmarks/gpu_run.sh --dry-run`: the GPU plan, in its order, on CPU at tiny size,
    preflight included; each measurement leaves its JSON."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=840, env=_env(tmp_path))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert "preflight ok" in (out / "preflight.log").read_text()
    order = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("== ")]
    assert order == ["lisa-8b", "offload-full", "paged-full", "equality", "packing", "fsdp", "apollo-8b"]
    runs = {}
    for name in ("lisa-8b", "offload-full", "paged-full", "fsdp", "apollo-8b"):
        summary = json.loads((out / f"{name}.json").read_text())
        assert summary["mode"] == "tiny-cpu" and summary["complete"] is True
        runs.update({r["run"]: r for r in summary["runs"]})
    assert list(runs) == ["headroom", "offload-full-ga8", "full-in-backward", "fsdp-ref", "fsdp-1rank", "apollo-8b"]
    for r in runs.values():
        assert r["steps_done"] == 3 and not r["oom"] and "error" not in r
        assert r["tokens_per_s"] > 0 and r["estimated_total_bytes"] > 0 and r["peak_rss_bytes"] > 0
        assert abs(r["estimate_error"]) < 0.5  # on CPU: against peak RSS
    assert runs["headroom"]["offload_activations"] and runs["headroom"]["lisa"]
    assert runs["offload-full-ga8"]["cpu_offload"] and runs["full-in-backward"]["in_backward"]
    assert runs["apollo-8b"]["optimizer"] == "apollo_mini" and runs["apollo-8b"]["in_backward"]
    assert runs["fsdp-1rank"]["last_loss"] == pytest.approx(runs["fsdp-ref"]["last_loss"], rel=1e-4)
    checks = json.loads((out / "equality.json").read_text())["checks"]
    assert set(checks) == {"offload-vs-resident", "activation-offload", "packed-sdpa", "packed-varlen",
                           "compile-offload", "paged-in-backward"}
    assert all(c.get("ok") or c.get("skipped") for c in checks.values()), checks
    # Tiny: the plan's CPU time, which a loaded machine does not inflate as it does wall time.
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 150, cpu_s


def test_the_preflight_refuses_in_one_line_before_measuring(tmp_path):
    env = {**_env(tmp_path), "PYTHONPATH": str(tmp_path)}
    (tmp_path / "xxhash.py").write_text("raise ImportError('not carried')\n")
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error: preflight")]
    assert len(errors) == 1 and "xxhash" in errors[0] and "gpu_wheels.sh" in errors[0]
    assert "==" not in proc.stdout and not (tmp_path / "out" / "lisa-8b.json").exists()


def _wheel(folder: Path, name: str) -> None:
    """A one-module wheel: pip installs it as it would any carried wheel."""
    import zipfile

    folder.mkdir(parents=True)
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}.py", "HERE = True\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def test_wheels_carried_in_turns_add_up(tmp_path):
    """A copy capped below the wheels' total carries them in turns (gpu_wheels.sh puts each wheel
    over 40 MB in a folder of its own): each --install-only adds to the suite's site folder."""
    env = _env(tmp_path)
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for turn, (folder, name) in enumerate([("any", "carried_first"), (f"py{py}-big", "carried_second")]):
        wheels = tmp_path / f"turn{turn}"
        _wheel(wheels / folder, name)
        proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--install-only"],
                              capture_output=True, text=True, timeout=120, env={**env, "WHEELS": str(wheels)})
        assert proc.returncode == 0 and "installed 1 wheels" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "carried_first.py").exists() and (tmp_path / "site" / "carried_second.py").exists()
    assert not (tmp_path / "out" / "preflight.log").exists()  # nothing measured, not even checked


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
