"""Does a busy CPU stall training? benchmarks/threads_bench.py.

Runs `lisaft train recipes/quickstart.yaml` (in its own process, as a user would) under several
thread settings, each on a quiet machine and next to a competing process, side by side:

    lisaft        the quickstart as shipped: training.threads 1 (its 0.9M-parameter model's
                  operations are too small to split), OMP_WAIT_POLICY=PASSIVE
    passive_auto  lisaft's default for a recipe that sets no threads: training.threads auto
                  (one thread per usable CPU), idle OpenMP threads sleep at once (PASSIVE)
    spin_300k     GNU OpenMP's own default (GOMP_SPINCOUNT=300000: idle threads spin about 300k
                  rounds before they sleep), one thread per usable CPU: lisaft before issue 23
    spin_30k ... spin_300   shorter spins, one thread per usable CPU (--settings to choose)
    one_thread    OMP_NUM_THREADS=1: the workaround issue 23 found

The competing processes:

    quiet        none (other users of the machine still count: the load average is recorded)
    python_spin  one single-threaded pure-Python busy loop
    torch        another torch process doing small matmuls with torch's default threads,
                 as a second training run would

Per run: tokens/s (the median of the run's train records after the first, from
metrics.jsonl), the wall time of the whole command (start-up, the end-of-run estimate and
saving included; a run still going after --limit-s is stopped, and its rate is what it logged by
then) and the load average when it started. Runs are interleaved, setting by setting, so a
change in the machine's load touches every setting alike.

    python -m benchmarks.threads_bench                  # 100 steps, evaluation off, 2 rounds
    python -m benchmarks.threads_bench --full           # the quickstart as shipped (800 steps)

Writes threads.json and threads.md into --out (default benchmarks/results/threads).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.yaml"
# The variables that steer OpenMP; each setting starts from an environment without them.
OPENMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "MKL_NUM_THREADS")
# Each setting: the OpenMP environment, and whether `training.threads` is set to auto (lisaft's
# default, for recipes that do not set it) or left as the quickstart ships it (1).
SETTINGS = {
    "lisaft": ({}, False),
    "passive_auto": ({}, True),
    "spin_300k": ({"GOMP_SPINCOUNT": "300000"}, True),
    "spin_30k": ({"GOMP_SPINCOUNT": "30000"}, True),
    "spin_10k": ({"GOMP_SPINCOUNT": "10000"}, True),
    "spin_3k": ({"GOMP_SPINCOUNT": "3000"}, True),
    "spin_1k": ({"GOMP_SPINCOUNT": "1000"}, True),
    "spin_300": ({"GOMP_SPINCOUNT": "300"}, True),
    "one_thread": ({"OMP_NUM_THREADS": "1"}, True),
}
DEFAULT_SETTINGS = ["lisaft", "passive_auto", "spin_300k"]
CONTENDERS = {
    "quiet": None,
    "python_spin": "while True: pass",
    "torch": ("import torch\na = torch.randn(256, 256)\n"
              "while True:\n    a = torch.tanh(a @ a)\n"),
}


def _environment(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _train_records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    lines = metrics.read_text().splitlines()
    return [r for r in map(json.loads, (line for line in lines if line.endswith("}"))) if "tokens_per_s" in r]


def run_once(setting: str, steps: int | None, out: Path, limit_s: float) -> dict:
    """One run; a run still going after `limit_s` is stopped, and its rate is what it logged by
    then (a stalled run would otherwise hold the benchmark for most of an hour)."""
    env, auto_threads = SETTINGS[setting]
    overrides = [f"training.output_dir={out}", "training.log_every=5"]
    if auto_threads:
        overrides.append("training.threads=auto")
    if steps is not None:
        overrides += [f"training.max_steps={steps}", "training.eval_every=0", "training.save_every=0"]
    cmd = [sys.executable, "-m", "lisaft", "train", str(RECIPE), "--overwrite"]
    for item in overrides:
        cmd += ["--set", item]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=_environment(env), capture_output=True, text=True,
                              check=False, timeout=limit_s)
        finished = True
    except subprocess.TimeoutExpired:
        done, finished = None, False
    wall = time.perf_counter() - start
    if done is not None and done.returncode != 0:
        raise SystemExit(f"{setting}: lisaft train failed:\n{done.stderr[-2000:]}")
    records = _train_records(out / "metrics.jsonl")
    rates = [r["tokens_per_s"] for r in records]
    return {"tokens_per_s": statistics.median(rates[1:] or rates) if rates else 0.0,
            "steps_done": records[-1]["step"] if records else 0, "finished": finished,
            "wall_s": wall, "load_at_start": load}


def run_contended(contender: str, settings: list, steps: int | None, work: Path, limit_s: float) -> dict:
    code = CONTENDERS[contender]
    proc = None
    if code is not None:
        proc = subprocess.Popen([sys.executable, "-c", code], env=_environment({}))
        time.sleep(1.0)  # let it import torch and start competing
    try:
        return {s: run_once(s, steps, work / f"{contender}-{s}", limit_s) for s in settings}
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def summarise(rounds: list, settings: list, contenders: list) -> dict:
    table = {}
    for c in contenders:
        for s in settings:
            runs = [r[c][s] for r in rounds]
            table[f"{c}/{s}"] = {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
                "wall_s": statistics.median(x["wall_s"] for x in runs),
                "finished": all(x["finished"] for x in runs),
                "runs": runs,
            }
    return table


def _cell(entry: dict) -> str:
    wall = f"{entry['wall_s']:.0f} s" if entry["finished"] else f"stopped at {entry['wall_s']:.0f} s"
    return f"{entry['tokens_per_s']:,.0f} ({wall})"


def markdown(table: dict, settings: list, contenders: list, args) -> str:
    what = "the quickstart as shipped" if args.full else f"{args.steps} steps, evaluation off"
    lines = [f"# threads_bench: {what}, median of {args.rounds} round(s)", "",
             "tokens/s (wall time of the command) | " + " | ".join(contenders),
             "---|" + "|".join("---" for _ in contenders)]
    for s in settings:
        cells = [_cell(table[f"{c}/{s}"]) for c in contenders]
        lines.append(f"{s} | " + " | ".join(cells))
    loads = [x["load_at_start"] for entry in table.values() for x in entry["runs"]]
    lines += ["", (f"Load average (1 min) when the runs started: {min(loads):.1f} to {max(loads):.1f} "
                   f"on {len(os.sched_getaffinity(0))} usable CPUs.")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--full", action="store_true", help="the quickstart as shipped")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit-s", type=float, default=150.0,
                        help="stop a run after this long; its rate is what it logged by then")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "threads")
    args = parser.parse_args()
    steps = None if args.full else args.steps
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            rounds.append({c: run_contended(c, args.settings, steps, Path(tmp), args.limit_s)
                           for c in args.contenders})
            print(f"round {i + 1}/{args.rounds} done", flush=True)
    table = summarise(rounds, args.settings, args.contenders)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "threads_full" if args.full else "threads"
    result = {"machine": {"cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                          "platform": platform.platform()},
              "steps": steps, "rounds": args.rounds, "results": table}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(table, args.settings, args.contenders, args)
    (args.out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
