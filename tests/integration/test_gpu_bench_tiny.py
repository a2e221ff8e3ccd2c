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
    """`OUT=D bash benchmarks/gpu_run.sh --dry-run`: the GPU plan, in its order, on CPU at tiny
    size, preflight included; no named run skipped by the GPU's clock; everything back in D as at
    most 8 files of at most 16 MiB (an archive and its summary)."""
    import resource
    import tarfile

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=840, env=_env(tmp_path))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    files = [f for f in out.rglob("*") if f.is_file()]
    assert sorted(f.name for f in files) == ["gpu-results.tar.gz", "summary.json"]
    assert len(files) <= 8 and all(f.stat().st_size <= 16 * 2**20 for f in files)
    order = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("== ")]
    assert order == ["lisa", "dpo-grpo", "offload", "lora", "apollo", "long", "gpu-tests"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and not summary["faults"]
    assert all(s["exit"] == 0 and not s["skipped_runs"] for s in summary["steps"].values()), summary["steps"]
    # The LISA recipe's tokens/s and peak beside the full recipe's under each accumulation path.
    heads = {**summary["steps"]["lisa"]["runs"], **summary["steps"]["offload"]["runs"]}
    assert all(h["tokens_per_s"] > 0 for h in heads.values()) and len(heads) == 3
    assert [heads[r].get("offload_accumulation") for r in heads] == [None, "device", "host"]
    with tarfile.open(out / "gpu-results.tar.gz") as tar:
        def read(name):
            return json.load(tar.extractfile(name))

        assert "preflight ok" in tar.extractfile("preflight.log").read().decode()
        runs = {}
        for name in ("lisa", "dpo-grpo", "offload", "lora", "apollo", "long"):
            step = read(f"{name}.json")
            assert step["mode"] == "tiny-cpu" and step["complete"] is True
            runs.update({r["run"]: r for r in step["runs"]})
    assert list(runs) == ["lisa-8b", "dpo-8b", "grpo-8b", "offload-full-ga4", "offload-host-ga4", "lora-8b",
                          "lora-dpo-8b", "apollo-8b", "apollo-r32-8b", "full-in-backward", "long-16k"]
    for r in runs.values():
        assert r["steps_done"] == len(r["step_times_s"]) >= 3 and not r["oom"] and "error" not in r
        assert r["tokens_per_s"] > 0 and r["estimated_total_bytes"] > 0 and r["peak_rss_bytes"] > 0
        assert abs(r["estimate_error"]) < 0.5  # on CPU: against peak RSS
        assert len(r["step_parts"]) == r["steps_done"] and r["expected"]["seconds"] > 0
    lisa = runs["lisa-8b"]
    assert lisa["offload_activations"] and lisa["lisa"]
    assert len({tuple(a) for a in lisa["active_layers"][2:]}) > 1  # a layer switch inside the timed steps
    offload = runs["offload-full-ga4"]
    assert offload["cpu_offload"] and {"drain", "step_unit"} <= set(offload["offload_parts_timed"])
    host = runs["offload-host-ga4"]
    # Layer-major, the step's forwards and backwards are one phase; micro-batch-major, one each.
    assert all(len(p["backward"]) == 1 and "forward" not in p for p in offload["step_parts"])
    assert all(len(p["backward"]) == len(p["forward"]) == 4 for p in host["step_parts"])
    # The host steps overlap the next step's forward: each shows in the step whose time it took.
    assert all(sum(p.get("offload_step_unit", 0) for p in r["step_parts"]) > 0 for r in (offload, host))
    assert offload["offload_counts"]["host_grad_additions"] == 0 < host["offload_counts"]["host_grad_additions"]
    assert runs["apollo-8b"]["optimizer"] == "apollo_mini" and runs["apollo-8b"]["in_backward"]
    assert runs["dpo-8b"]["preference"] == "dpo" and runs["dpo-8b"]["cpu_offload"] and not runs["dpo-8b"]["lora"]
    assert runs["lora-8b"]["lora"] and runs["lora-dpo-8b"]["lora"] and runs["lora-dpo-8b"]["preference"] == "dpo"
    assert runs["apollo-r32-8b"]["optimizer"] == "apollo"
    assert runs["full-in-backward"]["in_backward"] and not runs["full-in-backward"]["lisa"]
    # GRPO: each step's generation timed apart from its training, both estimated peaks recorded.
    grpo = runs["grpo-8b"]
    assert grpo["cpu_offload"] and len(grpo["generation_s"]) == grpo["steps_done"]
    assert grpo["generation_tokens_per_s"] > 0 and grpo["training_tokens_per_s"] > 0
    assert {"generation", "layer_backward"} <= set(grpo["estimated_phases"])
    assert summary["steps"]["dpo-grpo"]["runs"]["grpo-8b"]["generation_tokens_per_s"] > 0
    # Tiny: the plan's CPU time, which a loaded machine does not inflate as it does wall time.
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 150, cpu_s


def test_the_plan_fits_its_command_and_names_every_subject():
    """`gpu_run.sh --plan`: one JSON line per step, each expected within its budget, the budgets
    within 540 s, a step for each README subject."""
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--plan"], capture_output=True,
                          text=True, timeout=120, env=_env(Path("/nonexistent")))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert all(set(r) == {"step", "budget_s", "expected_s"} and 0 < r["expected_s"] <= r["budget_s"] for r in rows)
    assert sum(r["budget_s"] for r in rows) <= 540
    names = [r["step"] for r in rows]
    assert set(names) >= {"lisa", "dpo-grpo", "offload", "apollo", "lora", "long", "gpu-tests"}
    assert "dpo-grpo" in names[:3]  # the 8B DPO and GRPO recipes' claims among the first measured
    from benchmarks.gpu_8b_24gb import BY_NAME
    from benchmarks.gpu_plan import STEPS

    planned = {c for s in STEPS for c in s.configs}
    assert {"dpo-8b", "grpo-8b", "lora-dpo-8b", "long-16k", "apollo-r32-8b", "full-in-backward", "offload-full-ga4",
            "offload-host-ga4"} <= planned
    assert BY_NAME["full-in-backward"].overrides[:2] == ("lisa.enabled=false", "optimizer.in_backward=true")
    # What the plan leaves out is said, each with its time.
    left = [ln for ln in proc.stderr.splitlines() if ln.startswith("left out: ")]
    assert [ln.split()[2] for ln in left] == ["equality", "resume", "qlora-8b", "peer", "packing"]
    assert all(" s): " in ln for ln in left)


@pytest.mark.slow
def test_the_equality_checks_the_plan_leaves_out_still_run_on_cpu(tmp_path):
    """benchmarks/gpu_equality.py --dry-run: left out of the one 540 s plan for GRPO's run, its
    code path still runs here, every check passing or skipped for a reason. In a fresh interpreter,
    not forked from this one: a fork of a process whose OpenMP team has run (earlier tests on this
    worker) can hang in the child."""
    out = tmp_path / "equality.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_equality", "--dry-run", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    assert set(checks) == {"offload-vs-resident", "layer-major", "activation-offload", "packed-sdpa",
                           "packed-varlen", "compile-offload", "paged-in-backward"}
    assert checks["layer-major"]["same_weights_bit_for_bit"]["device"]
    assert all(c.get("ok") or c.get("skipped") for c in checks.values()), checks
    assert checks["packed-sdpa"]["ok"] and checks["packed-sdpa"]["route"] == "position ids"


def test_a_plan_over_its_time_fails_before_running(monkeypatch, tmp_path):
    """A step expected over its box, or boxes over 540 s, is a fault the dry run stops on."""
    from benchmarks import gpu_plan

    rows = gpu_plan.plan()
    assert gpu_plan.check(rows) == []
    slow = [{**r, "expected_s": r["budget_s"] + 1} if r["step"] == "offload" else r for r in rows]
    box = next(r["budget_s"] for r in rows if r["step"] == "offload")
    assert gpu_plan.check(slow) == [f"offload: expected {box + 1} s over its budget of {box} s"]
    monkeypatch.setattr(gpu_plan, "plan", lambda: [*rows, {"step": "extra", "budget_s": 60, "expected_s": 1}])
    assert gpu_plan.run(tmp_path / "out", tmp_path / "work", dry=True) == 1
    assert "over 540 s" in json.loads((tmp_path / "out" / "summary.json").read_text())["faults"][0]


def test_the_preflight_refuses_in_one_line_before_measuring(tmp_path):
    env = {**_env(tmp_path), "PYTHONPATH": str(tmp_path)}
    (tmp_path / "xxhash.py").write_text("raise ImportError('not carried')\n")
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("error: preflight")]
    assert len(errors) == 1 and "xxhash" in errors[0] and "gpu_wheels.sh" in errors[0]
    assert "==" not in proc.stdout and [f.name for f in (tmp_path / "out").iterdir()] == ["preflight.log"]


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
    """The two carries gpu_wheels.sh makes (wheels/base/, then wheels/jit/ with numba and its
    llvmlite together): each --install-only adds to the suite's site folder."""
    env = _env(tmp_path)
    for turn, (folder, name) in enumerate([("base", "carried_first"), ("jit", "carried_second")]):
        wheels = tmp_path / f"turn{turn}"
        _wheel(wheels / folder, name)
        proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--install-only"],
                              capture_output=True, text=True, timeout=120, env={**env, "WHEELS": str(wheels)})
        assert proc.returncode == 0 and "installed 1 wheels" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "carried_first.py").exists() and (tmp_path / "site" / "carried_second.py").exists()
    assert not (tmp_path / "out" / "preflight.log").exists()  # nothing measured, not even checked


def test_gpu_wheels_keeps_numba_with_its_llvmlite_and_carries_annotated_doc_and_pytest():
    script = (REPO / "benchmarks" / "gpu_wheels.sh").read_text()
    base = script.split("jit=")[0]
    assert "jit=(numba llvmlite)" in script and "annotated-doc" in base
    assert all(f" {name}" in base for name in ("pytest", "pluggy", "iniconfig", "pytest-timeout"))


def test_gpu_wheels_refuses_to_gather_what_it_cannot_pin(tmp_path):
    """Outside the environment the tests ran in, a package has no version to pin: the script
    stops before downloading anything rather than fetch whatever version the index has now."""
    bare = tmp_path / "bin" / "python3"
    bare.parent.mkdir()
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # no site-packages: nothing installed
    bare.chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(bare.parent), os.environ.get("PATH", "")]),
           "WHEELS": str(tmp_path / "wheels")}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_wheels.sh")], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no version to pin: bitsandbytes pydantic" in proc.stderr and "Collecting" not in proc.stdout
    assert not list((tmp_path / "wheels").rglob("*.whl"))


def test_budget_skips_what_would_not_finish_and_still_writes(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_8b_24gb", "--tiny", "--budget-s", "0",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    import importlib.util

    suite = importlib.import_module("benchmarks.gpu_8b_24gb")
    assert summary["complete"] and [r["run"] for r in summary["runs"]] == [c.name for c in suite.CONFIGS]
    assert [r["run"] for r in summary["runs"][:3]] == ["lisa-8b", "headroom", "table-g2-s2048"]
    assert all(r["skipped"].startswith("budget") for r in summary["runs"])


def test_offload_times_are_the_estimators_step_on_the_runs_own_path():
    """An offload run's step is lisaft/memory/layer_major.py's step_seconds (its serial bound) on
    the path the run resolves to: `device` ships one gradient a group and the saved layer inputs
    out and back, `host` one gradient a micro-batch and adds them on the host; the start once."""
    from benchmarks.gpu_8b_24gb import BY_NAME, CONFIG_8B, RECIPE_FULL
    from benchmarks.gpu_times import LENT_HOST_RAM, START_S, lent_machine, run_seconds
    from lisaft.memory.layer_major import saved_input_bytes, step_seconds

    device, host = (BY_NAME[f"offload-{arm}-ga4"].expected for arm in ("full", "host"))
    d, h = device["parts"], host["parts"]
    assert (d["offload_accumulation"], d["groups"], h["offload_accumulation"]) == ("device", 1, "host")
    params, tokens = 8_029_995_008, 4 * 2048  # Llama-3.1-8B's matmul weights and embeddings
    saved = saved_input_bytes(32, 2048, 4096, 2)
    assert LENT_HOST_RAM > 4 * saved  # one group at 4 micro-batches
    for parts, groups in ((d, 1), (h, 0)):
        want = step_seconds(params, 2 * params, tokens, 4, lent_machine(), saved if groups else 0, groups, True)
        assert parts["step_s"] == pytest.approx(want["serial_s"])
    assert h["offload_host_additions"] == 3 and d["offload_host_additions"] == 0
    assert d["offload_link_s"] < h["offload_link_s"] and d["step_s"] < h["step_s"]
    assert device["seconds"] == pytest.approx(START_S + d["extra_s"] + 2 * d["step_s"])
    # The recipe as shipped resolves to device; its DPO recipe (a preference loss) to host.
    assert run_seconds(RECIPE_FULL, (), 1, CONFIG_8B)["parts"]["offload_accumulation"] == "device"
    assert BY_NAME["dpo-8b"].expected["parts"]["offload_accumulation"] == "host"
    assert 7.9e9 < d["offload_cpu_step_s"] / 1.61 * 1e9 < 8.1e9  # 1.61 s per 10^9 parameters, 8.03 x 10^9


def test_packing_at_gpu_size_makes_its_data_in_a_moment():
    """The GPU size's documents draw on 1,024 ids (an 8 MB chain), not 32,000 (8.2 GB)."""
    import time

    from benchmarks.packing_bench import GPU, make_data

    t0 = time.process_time()
    train, evals = make_data(GPU, 0)
    assert time.process_time() - t0 < 20
    assert len(train) == GPU["n_train"] and max(t for d in train for t in d["input_ids"]) < GPU["data_vocab"]
