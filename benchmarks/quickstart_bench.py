"""The README's quickstart, as a user runs it: `lisaft train recipes/quickstart.yaml` in its own
process, then `lisaft generate RUN --input-file recipes/quickstart/eval.jsonl --json` over the
whole eval set. Records the wall time of the training command (start-up, the end-of-run table and
saving included), the load average around it, eval token accuracy at every evaluation and how
many of the eval answers are exact.

    python -m benchmarks.quickstart_bench                # the recipe as shipped (800 steps)
    python -m benchmarks.quickstart_bench --steps 120    # shorter, its own schedule

Writes quickstart.json into --out (default benchmarks/results/quickstart).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.yaml"
EVAL = REPO / "recipes" / "quickstart" / "eval.jsonl"


def summarise(records: list[dict], answers: list[dict]) -> dict:
    """Eval token accuracy by step (in %, one decimal) and the exact answers, from metrics.jsonl's
    records and generate's --json lines."""
    accuracy = {str(r["step"]): round(100 * r["eval_token_accuracy"], 1) for r in records if "eval_token_accuracy" in r}
    exact = sum(bool(a["exact"]) for a in answers)
    return {"eval_token_accuracy_pct": accuracy, "exact": exact, "answers": len(answers),
            "exact_of_first_20": sum(bool(a["exact"]) for a in answers[:20])}


def run(steps: int | None, folder: Path) -> dict:
    lisaft = [sys.executable, "-m", "lisaft"]
    sets = ["--set", f"training.output_dir={folder / 'run'}"]
    if steps is not None:
        sets += ["--set", f"training.max_steps={steps}"]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    subprocess.run([*lisaft, "train", str(RECIPE), *sets], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    out = subprocess.run([*lisaft, "generate", str(folder / "run"), "--input-file", str(EVAL), "--json"],
                         check=True, cwd=REPO, capture_output=True, text=True).stdout
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    answers = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {"benchmark": "quickstart_bench", "steps": steps or "as shipped", "train_wall_s": round(wall, 1),
            "loadavg_1min_before": round(load_before, 2), "loadavg_1min_after": round(load_after, 2),
            "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            **summarise(records, answers)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="training.max_steps (default: the recipe's)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quickstart")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.steps, Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quickstart.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
