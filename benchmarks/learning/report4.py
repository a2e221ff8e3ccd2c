"""The fourth protocol's tables (OUT/learning4.md) from its run files (OUT/runs/*.json), the base
model's scores (OUT/base.json) and the SFT start's (OUT/start-sft.json): per (objective, start,
method), the picked lr's new skill and forgetting, mean ± sample standard deviation over the seeds
run, beside the start's; GRPO's rows add the mean reward of the first and last five steps."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.learning.report3 import _mean_sd, measures


def summarise(out: Path) -> list[dict]:
    """One row per cell run so far: its lr picked on the seed-0 runs (validation exact accuracy)."""
    from benchmarks.learning.protocol3 import best_lr, load_done
    from benchmarks.learning.protocol4 import CELLS, METHODS

    done = list(load_done(out).values())
    rows = []
    for objective, start in CELLS:
        for method in METHODS:
            mine = [r for r in done if (r["objective"], r["start"], r["method"]) == (objective, start, method)]
            sweep = [r for r in mine if r["seed"] == 0]
            if not sweep:
                continue
            lr = best_lr(sweep)
            rows.append({"objective": objective, "start": start, "method": method, "lr": lr,
                         "grid": sorted({r["lr"] for r in sweep}), "runs": [r for r in mine if r["lr"] == lr]})
    return rows


def start_scores(out: Path) -> dict[str, dict]:
    starts = {"base": json.loads((out / "base.json").read_text())}
    if (out / "start-sft.json").is_file():
        starts["sft"] = json.loads((out / "start-sft.json").read_text())
    return starts


def _reward(runs: list[dict], part: slice) -> str:
    if "rewards" not in runs[0]:
        return "–"
    return _mean_sd([statistics.mean(r["rewards"][part]) for r in runs], 1.0, 2)


def table(out: Path) -> str:
    starts = start_scores(out)
    lines = [f"Start `{name}`: held-out exact {100 * s['test']['exact']:.1f}% "
             f"(lenient {100 * s['test']['lenient']:.1f}%), instructions NLL {s['instructions_nll']:.3f}, "
             f"facts {100 * s.get('facts', 1.0):.1f}%." for name, s in starts.items()]
    lines += ["", "| objective | start | method | lr (grid) | seeds | exact % | lenient % | instructions NLL | "
              "facts % | reward first 5 → last 5 steps | train s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summarise(out):
        rs, grid = row["runs"], ", ".join(f"{x:g}" for x in row["grid"])
        lines.append(
            f"| {row['objective']} | {row['start']} | {row['method']} | {row['lr']:g} ({grid}) | {len(rs)} | "
            f"{' | '.join(measures(rs))} | {_reward(rs, slice(0, 5))} → {_reward(rs, slice(-5, None))} | "
            f"{statistics.mean(r['train_s'] for r in rs):.0f} |")
    return "\n".join(lines) + "\n"


def write(out: Path) -> None:
    if (out / "base.json").is_file():
        (out / "learning4.md").write_text("# Protocol 4: DPO, KTO and GRPO on SmolLM2-135M-Instruct (two-digit "
                                          "addition)\n\n" + table(out))
