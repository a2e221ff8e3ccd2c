"""The third protocol's tables (OUT/learning3.md) from its run files (OUT/runs/*.json) and the
base model's scores (OUT/base.json): per arm, the picked lr's new skill and forgetting, mean ±
sample standard deviation over the seeds run, beside the base model's."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def _mean_sd(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    if len(values) == 1:
        return f"{scale * values[0]:.{digits}f}"
    return f"{scale * statistics.mean(values):.{digits}f} ± {scale * statistics.stdev(values):.{digits}f}"


def summarise(out: Path) -> dict:
    """Per arm: the lr picked on the seed-0 sweep (validation exact accuracy) and its runs."""
    from benchmarks.learning.protocol3 import ARMS, best_lr, load_done

    done = list(load_done(out).values())
    arms = {}
    for arm in ARMS:
        sweep = [r for r in done if r["arm"] == arm and r["seed"] == 0]
        if not sweep:
            continue
        lr = best_lr(sweep)
        runs = [r for r in done if r["arm"] == arm and r["lr"] == lr]
        arms[arm] = {"lr": lr, "grid": sorted({r["lr"] for r in sweep}), "seeds": sorted(r["seed"] for r in runs),
                     "runs": runs}
    return arms


def table(out: Path) -> str:
    base = json.loads((out / "base.json").read_text())
    arms = summarise(out)
    lines = [
        f"Base model: held-out exact {100 * base['test']['exact']:.1f}% "
        f"(lenient {100 * base['test']['lenient']:.1f}%), "
        f"instructions NLL {base['instructions_nll']:.3f}, facts kept {len(base['facts_kept'])} of "
        f"{base['facts_candidates']} (100% by construction).", "",
        "| arm | lr (grid) | seeds | new skill: exact % | lenient % | instructions NLL (base "
        f"{base['instructions_nll']:.3f}) | facts % | train s |",
        "|---|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        rs = a["runs"]
        grid = ", ".join(f"{x:g}" for x in a["grid"])
        lines.append(
            f"| {arm} | {a['lr']:g} ({grid}) | {len(rs)} | {' | '.join(measures(rs))} | "
            f"{statistics.mean(r['train_s'] for r in rs):.0f} |")
    return "\n".join(lines) + "\n"


def measures(runs: list[dict]) -> list[str]:
    """A cell's scores over its seeds, as the tables show them: held-out exact and lenient %,
    instructions NLL, facts kept %."""
    return [_mean_sd([r["test"]["exact"] for r in runs]), _mean_sd([r["test"]["lenient"] for r in runs]),
            _mean_sd([r["instructions_nll"] for r in runs], 1.0, 3), _mean_sd([r["facts"] for r in runs])]


def offload_check(out: Path) -> str:
    """Whether optimizer.cpu_offload's run gave full fine-tuning's scores at the same lr and seed."""
    from benchmarks.learning.protocol3 import load_done, run_name

    done = load_done(out)
    pairs = [(r, done.get(run_name("full", r["lr"], r["seed"]))) for r in done.values()
             if r["arm"] == "full_cpu_offload"]
    keys = ("test", "instructions_nll", "facts", "train_loss_last")
    lines = [f"full_cpu_offload at lr {r['lr']:g}, seed {r['seed']}: "
             + ("full's run not yet done" if f is None else
                "the same scores and last loss as full's" if all(r[k] == f[k] for k in keys) else
                f"differs from full's (last loss {r['train_loss_last']:.6f} against {f['train_loss_last']:.6f})")
             for r, f in pairs]
    return "\n".join(lines) + ("\n" if lines else "")


def write(out: Path) -> None:
    if (out / "base.json").is_file():
        (out / "learning3.md").write_text("# Protocol 3: SmolLM2-135M-Instruct learns two-digit addition\n\n"
                                          + table(out) + "\n" + offload_check(out))
