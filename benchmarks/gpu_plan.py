"""The GPU suite's plan and its runner: benchmarks/gpu_run.sh calls this after the preflight.

Steps, ordered by value per device minute (the 8B recipes' memory claims first, DPO among the
first three), each named by its subject, each under its own time box (budget_s), their boxes
summing to at most TOTAL_S so the whole suite fits one 10-minute command with a margin; what the
plan cannot hold is LEFT_OUT, which `plan` names on stderr. A box that expires kills the step's
whole process group (benchmarks/gpu_box.py). Every step's expected time is computed before it runs
(benchmarks/gpu_times.py: the 8B runs' from their recipes; the others' from the parts named in
`_small`), and a step whose named run would be skipped for time fails the plan's check, which
`--dry-run` runs first.

    python -m benchmarks.gpu_plan plan                     # one JSON line per step
    python -m benchmarks.gpu_plan run --out DIR [--dry-run]

What comes back: DIR holds two files, written again after every step: gpu-results.tar.gz (every
step's JSON, markdown and log, and the preflight's) and summary.json (each step's exit, time and
JSON files, and each 8B run's tokens/s, NVML peak and offload path). Everything else goes to
--work (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_box import preload, run_boxed, run_forked
from benchmarks.gpu_times import HOST_KERNEL_COMPILE_S, IMPORT_S, START_S, in_sequence

REPO = Path(__file__).resolve().parents[1]
TOTAL_S = 540  # of the 600 s one command may run: 60 s for the preflight and the archive
ARCHIVE, SUMMARY = "gpu-results.tar.gz", "summary.json"
SUITE_MARGIN_S = 8  # a gpu_8b_24gb step's own start before its first run (imports, no CUDA)


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    module: str
    args: tuple[str, ...] = ()
    configs: tuple[str, ...] = ()  # gpu_8b_24gb runs: their expected times are the step's
    writes_out: bool = True  # takes --out (pytest writes only its log)

    def expected(self) -> dict:
        if self.configs:
            from benchmarks.gpu_8b_24gb import BY_NAME

            runs = dict(zip(self.configs, in_sequence([BY_NAME[c].expected for c in self.configs])))
            return {"seconds": SUITE_MARGIN_S + sum(runs.values()), "how": "gpu_times.in_sequence of run_seconds",
                    "runs": runs}
        return _small(self.name)

    def argv(self, out: Path, dry: bool, started: float) -> list[str]:
        """The step's command; `started` is when its box opened (time.time()): the runs' own
        budgets count from there, not from after their imports."""
        # The box's own 2 s for the process to end.
        inner = ["--budget-s", str(self.budget_s - 2), "--started", repr(started)]
        if self.configs:
            return [sys.executable, "-m", self.module, *(["--tiny"] if dry else []), "--configs",
                    ",".join(self.configs), *inner, "--out", str(out / f"{self.name}.json")]
        if not self.writes_out:
            return [sys.executable, "-m", self.module, *self.args]
        return [sys.executable, "-m", self.module, *(["--dry-run"] if dry else self.args), "--out",
                str(out / f"{self.name}.json")]


def _small(name: str) -> dict:
    """The steps of small models: a start (gpu_times.START_S, whose 5 s of 8B model build they
    do not pay) and their own parts, each assumed where no figure exists."""
    start = START_S - 5
    parts = {
        # 7 checks on 2- and 4-layer models: inductor compiling one layer on CUDA (30 s, assumed),
        # the other six under 2 s each (their CPU dry run takes 2-8 s each at hidden 64-256), and
        # numba compiling the host kernel for float32 weights (offload-vs-resident) and for bf16
        # weights with fp32 moments (layer-major: offload_e2e_bench's adamw_32bit), gpu_times'
        # figure each (no step before compiles either).
        "equality": {"start_s": start, "compile_s": 30.0, "checks_s": 6 * 2.0,
                     "host_kernel_s": 2 * HOST_KERNEL_COMPILE_S},
        # 2 variants x 3 runs of the quickstart model (8 steps of 32 x 64 tokens): 2 s each on a
        # GPU (assumed), and cpu_offload's host kernel compiled once (gpu_times' 10 s).
        "resume": {"start_s": start, "runs_s": 6 * 2.0, "host_kernel_s": HOST_KERNEL_COMPILE_S},
        # pytest over the test files that hold a CUDA-only (`gpu`) test: collecting
        # tests/unit/test_lisa.py took 4.3 s of CPU here (/usr/bin/time), its 12 cases 0.5 s each
        # on a GPU (assumed).
        "gpu-tests": {"start_s": 6.6, "collect_s": 4.3 * len(gpu_test_files()), "tests_s": 12 * 0.5},
        # gpu_peer's own process (it imports torch before starting either side), then
        # gpu_8b_24gb's peer-lisaft run and HF Trainer's process: the same start and steps.
        "peer": None,
        # packing_bench --gpu-size: 1 seed, 5 contenders, one epoch of 384 documents each (about
        # 275 tokens each: a log-normal of median 200, sigma 0.8) through a 1.1B model, 6P
        # FLOPs a token at 25% of 788 TFLOP/s; batch1's 384 micro-batches launch-bound at 25 ms
        # each (assumed); models built on the device and evals (15 s, assumed).
        "packing": {"start_s": start, "train_s": 5 * 384 * 275 * 6 * 1.1e9 / (788e12 * 0.25),
                    "batch1_launches_s": 384 * 0.025, "models_evals_s": 15.0},
    }[name]
    if name == "peer":
        from benchmarks.gpu_8b_24gb import BY_NAME

        lisaft = BY_NAME["peer-lisaft"].expected["seconds"]
        parts = {"parent_start_s": IMPORT_S, "lisaft_s": lisaft, "hf_trainer_s": lisaft}
    return {"seconds": sum(parts.values()), "how": "parts", "parts": parts}


def gpu_test_files() -> list[str]:
    """The test files with a CUDA-only test (marker `gpu`, which tests/conftest.py skips on CPU)."""
    return sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in f.read_text())


STEPS = (
    Step("lisa", 31, "benchmarks.gpu_8b_24gb", configs=("lisa-8b",)),
    # The two later stages' 8B recipes with the optimizer on the CPU: numba compiles its host kernel
    # once for both.
    Step("dpo-grpo", 150, "benchmarks.gpu_8b_24gb", configs=("dpo-8b", "grpo-8b")),
    Step("offload", 123, "benchmarks.gpu_8b_24gb", configs=("offload-full-ga4", "offload-host-ga4")),
    Step("lora", 73, "benchmarks.gpu_8b_24gb", configs=("lora-8b", "lora-dpo-8b")),
    Step("apollo", 72, "benchmarks.gpu_8b_24gb", configs=("apollo-8b", "apollo-r32-8b", "full-in-backward")),
    Step("long", 65, "benchmarks.gpu_8b_24gb", configs=("long-16k",)),
    # In one process (addopts without pyproject's `-n 2`): the box's wheels carry no pytest-xdist.
    Step("gpu-tests", 18, "pytest", args=("-q", "-p", "no:cacheprovider", "-o", "addopts=--strict-markers", "-m", "gpu",
                                          *gpu_test_files()), writes_out=False),
)
# What one 540 s plan cannot hold, least valuable per device second: a second lent session's plan.
LEFT_OUT = {
    "equality": "CUDA's numerics against CPU-proven equalities (benchmarks/gpu_equality.py), no 8B memory claim; "
                "left for the GRPO recipe's",
    "resume": "resuming bit for bit on CUDA (benchmarks/gpu_resume.py); every path's resume is tested on CPU",
    "qlora-8b": "most of it writing and reading back 16 GB of random weights to quantize them",
    "peer": "a speed comparison with HF Trainer (benchmarks/gpu_peer.py), no memory claim",
    "packing": "packing's speed at 1.1B (benchmarks/packing_bench.py --gpu-size), no memory claim",
}


def left_out() -> list[str]:
    """One line per claim the plan leaves out, with the time it would take."""
    from benchmarks.gpu_8b_24gb import BY_NAME

    return [f"{name} ({(BY_NAME[name].expected if name in BY_NAME else _small(name))['seconds']:.0f} s): {why}"
            for name, why in LEFT_OUT.items()]


def plan() -> list[dict]:
    return [{"step": s.name, "budget_s": s.budget_s, "expected_s": round(s.expected()["seconds"], 1)}
            for s in STEPS]


def check(rows: list[dict]) -> list[str]:
    """What would make the GPU run skip or cut a named run: the plan's faults, one line each."""
    faults = [f"{r['step']}: expected {r['expected_s']} s over its budget of {r['budget_s']} s"
              for r in rows if r["expected_s"] > r["budget_s"]]
    total = sum(r["budget_s"] for r in rows)
    if total > TOTAL_S:
        faults.append(f"the budgets sum to {total} s, over {TOTAL_S} s")
    return faults


# Each run's headline in the summary, beside every other step's: the LISA recipe's tokens/s and
# NVML peak next to the full recipe's under each accumulation path, GRPO's generation and training
# apart.
HEADLINE = ("tokens_per_s", "nvml_peak_used_bytes", "peak_rss_bytes", "offload_accumulation", "offload_counts",
            "generation_tokens_per_s", "training_tokens_per_s", "nvml_phase_peak_bytes")  # the last three: GRPO's


def _runs(step: Step, out: Path) -> tuple[list[str], dict]:
    """The step's named runs its JSON says were skipped for time, and each run's headline."""
    path = out / f"{step.name}.json"
    if not step.configs or not path.exists():
        return [], {}
    runs = json.loads(path.read_text()).get("runs", [])
    return ([r["run"] for r in runs if r.get("skipped")],
            {r["run"]: {k: r[k] for k in HEADLINE if r.get(k) is not None} for r in runs if not r.get("skipped")})


def pack(work: Path, out: Path, summary: dict) -> None:
    """Everything the steps wrote into one archive, beside the summary: two files in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{ARCHIVE}.partial"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            if f.is_file() and f.suffix in (".json", ".md", ".log"):
                tar.add(f, arcname=str(f.relative_to(work)))
    tmp.replace(out / ARCHIVE)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))


def run(out: Path, work: Path, dry: bool) -> int:
    rows = plan()
    summary: dict = {"mode": "dry-run" if dry else "gpu", "plan": rows, "faults": check(rows), "steps": {}}
    for fault in summary["faults"]:
        print(f"plan: {fault}")
    if summary["faults"]:
        pack(work, out, summary)
        return 1
    failed = False
    if dry:
        preload()  # once, for every step forked from here
    for step in STEPS:
        # The dry run's box is the CI machine's, not the GPU's: a loaded CPU must not cut it.
        box = 900 if dry else step.budget_s
        print(f"== {step.name} (at most {step.budget_s} s)", flush=True)
        t0 = time.monotonic()
        with (work / f"{step.name}.log").open("w") as log:
            argv = step.argv(work, dry, time.time())
            rc = run_forked(argv, box, log, REPO) if dry else run_boxed(argv, box, cwd=REPO, stdout=log,
                                                                  stderr=subprocess.STDOUT)[0]
        skipped, headlines = _runs(step, work)
        seconds = round(time.monotonic() - t0, 1)
        summary["steps"][step.name] = {"exit": rc, "seconds": seconds, "skipped_runs": skipped,
                                       **({"runs": headlines} if headlines else {})}
        print(f"{step.name}: {seconds} s, exit {rc}" + (f", skipped for time: {', '.join(skipped)}" if skipped else ""),
              flush=True)
        failed |= rc != 0 or bool(skipped)
        pack(work, out, summary)
    summary["complete"] = True
    pack(work, out, summary)
    print(f"results in {out / ARCHIVE} and {out / SUMMARY}")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("plan", "run"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, help="where the steps write (default: a temporary folder)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.command == "plan":
        rows = plan()
        for r in rows:
            print(json.dumps(r))
        for line in left_out():
            print(f"left out: {line}", file=sys.stderr)
        for fault in check(rows):
            print(f"plan: {fault}", file=sys.stderr)
        return 1 if check(rows) else 0
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        return run(args.out, args.work, args.dry_run)
    with tempfile.TemporaryDirectory(prefix="lisaft-gpu-") as work:
        return run(args.out, Path(work), args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
