"""Does a busy CPU stall training? benchmarks/threads_bench.py.

Runs `lisaft train recipes/quickstart.yaml` (in its own process, as a user would) under several
thread settings, each on a quiet machine and next to a competing process, side by side:

    lisaft       lisaft as shipped: training.threads auto (one thread per usable CPU), idle
                 OpenMP threads sleep at once (OMP_WAIT_POLICY=PASSIVE)
    spin_300k    GNU OpenMP's own default (GOMP_SPINCOUNT=300000: idle threads spin about 300k
                 rounds before they sleep), one thread per usable CPU: lisaft before issue 23
    one_thread   OMP_NUM_THREADS=1: the workaround the issue found

The competing processes:

    quiet        none (other users of the machine still count: the load average is recorded)
    python_spin  one single-threaded pure-Python busy loop
    torch        another torch process doing small matmuls with torch's default threads,
                 as a second training run would

Per run: tokens/s (the median of the run's train records after the first, from
metrics.jsonl), the wall time of the whole command (start-up, the end-of-run estimate and
saving included) and the load average when it started. Runs are interleaved, setting by
setting, so a change in the machine's load touches every setting alike.

    python benchmarks/threads_bench.py                  # 100 steps, evaluation off, 2 rounds
    python benchmarks/threads_bench.py --full           # the quickstart as shipped (800 steps)

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
SETTINGS = {
    "lisaft": {},
    "spin_300k": {"GOMP_SPINCOUNT": "300000"},
    "one_thread": {"OMP_NUM_THREADS": "1"},
}
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


def _tokens_per_s(metrics: Path) -> float:
    rates = [r["tokens_per_s"] for r in map(json.loads, metrics.read_text().splitlines())
             if "tokens_per_s" in r]
    return statistics.median(rates[1:] or rates)


def run_once(setting: str, steps: int | None, out: Path) -> dict:
    overrides = [f"training.output_dir={out}"]
    if steps is not None:
        overrides += [f"training.max_steps={steps}", "training.eval_every=0", "training.save_every=0"]
    cmd = [sys.executable, "-m", "lisaft", "train", str(RECIPE), "--overwrite"]
    for item in overrides:
        cmd += ["--set", item]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=_environment(SETTINGS[setting]), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{setting}: lisaft train failed:\n{done.stderr[-2000:]}")
    return {"tokens_per_s": _tokens_per_s(out / "metrics.jsonl"), "wall_s": wall, "load_at_start": load}


def run_contended(contender: str, settings: list, steps: int | None, work: Path) -> dict:
    code = CONTENDERS[contender]
    proc = None
    if code is not None:
        proc = subprocess.Popen([sys.executable, "-c", code], env=_environment({}))
        time.sleep(1.0)  # let it import torch and start competing
    try:
        return {s: run_once(s, steps, work / f"{contender}-{s}") for s in settings}
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
                "runs": runs,
            }
    return table


def markdown(table: dict, settings: list, contenders: list, args) -> str:
    what = "the quickstart as shipped" if args.full else f"{args.steps} steps, evaluation off"
    lines = [f"# threads_bench: {what}, median of {args.rounds} round(s)", "",
             "tokens/s (wall s) | " + " | ".join(contenders),
             "---|" + "|".join("---" for _ in contenders)]
    for s in settings:
        cells = [f"{table[f'{c}/{s}']['tokens_per_s']:,.0f} ({table[f'{c}/{s}']['wall_s']:.1f})"
                 for c in contenders]
        lines.append(f"{s} | " + " | ".join(cells))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--full", action="store_true", help="the quickstart as shipped")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "threads")
    args = parser.parse_args()
    steps = None if args.full else args.steps
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            rounds.append({c: run_contended(c, args.settings, steps, Path(tmp)) for c in args.contenders})
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
