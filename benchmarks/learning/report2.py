"""The second protocol's results: lr picked on validation, test reported; the depth table, the
equal-memory comparison, uniform against cyclic sampling, and the learning-forgetting fronts."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.learning.protocol2 import APOLLO_ARMS, DEPTH_ARMS

TEST = ("test_token_accuracy", "test_exact_match", "old_token_accuracy", "old_exact_match")


def _mean_sd(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": values}


def swept(runs: list[dict]) -> list[dict]:
    """The runs of the seeds that ran more than one lr (all runs if none did)."""
    seeds = {r["seed"] for r in runs if sum(q["seed"] == r["seed"] for q in runs) > 1}
    return [r for r in runs if r["seed"] in seeds] or runs


def lr_means(runs: list[dict], measure: str) -> dict[float, float]:
    return {lr: statistics.fmean(r["final"][measure] for r in runs if r["lr"] == lr)
            for lr in sorted({r["lr"] for r in runs})}


def best_lr(runs: list[dict]) -> float:
    """The lr with the best mean validation token accuracy on the sweep seeds."""
    means = lr_means(swept(runs), "val_token_accuracy")
    return max(means, key=means.get)


def summarise_arm(runs: list[dict]) -> dict:
    sweep = swept(runs)
    best = best_lr(runs)
    grid = sorted({r["lr"] for r in sweep})
    rs = [r for r in runs if r["lr"] == best]
    return {
        "best_lr": best, "grid": grid, "best_lr_at_grid_edge": len(grid) > 1 and best in (grid[0], grid[-1]),
        "sweep_seeds": sorted({r["seed"] for r in sweep}), "seeds": sorted(r["seed"] for r in rs),
        # The front: every lr's test B and A means over the sweep seeds.
        "front": {str(lr): {m: v for m in ("val_token_accuracy", "test_token_accuracy", "old_token_accuracy")
                            for v in [lr_means(sweep, m)[lr]]} for lr in grid},
        **{m: _mean_sd([r["final"][m] for r in rs]) for m in (*TEST, "val_token_accuracy")},
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
        "peak_optimizer_state_bytes": max(r["peak_optimizer_state_bytes"] for r in rs),
        "peak_grad_bytes": max(r["peak_grad_bytes"] for r in rs),
        "peak_master_copy_bytes": max(r["peak_master_copy_bytes"] for r in rs),
        "trainable_params_last": rs[0]["trainable_params_last"], "lora_rank": rs[0].get("lora_rank"),
        "steps": rs[0]["steps"], "curve": _mean_curve(rs),
    }


def _mean_curve(runs: list[dict]) -> list[dict]:
    return [{"step": c["step"], **{k: statistics.fmean(r["curve"][i][k] for r in runs)
                                   for k in ("val_token_accuracy", "old_token_accuracy")}}
            for i, c in enumerate(runs[0]["curve"])]


def _group(runs: list[dict], steps: int) -> dict:
    out: dict = {}
    for r in runs:
        name = r["arm"] + (f"_x{r['steps'] // steps}" if r["steps"] != steps else "")  # more steps: its own row
        out.setdefault(r["task"], {}).setdefault(str(r["depth"]), {}).setdefault(name, []).append(r)
    return out


def summarise(mode: str, s: dict, pretrained: dict, runs: list[dict], env: dict) -> dict:
    results = {task: {depth: {arm: summarise_arm(rs) for arm, rs in arms.items()}
                      for depth, arms in sorted(by_depth.items(), key=lambda kv: int(kv[0]))}
               for task, by_depth in _group(runs, s["steps"]).items()}
    return {"benchmark": "learning", "protocol": 2, "mode": mode, "settings": s, "environment": env,
            "pretraining": {str(d): rec for d, rec in sorted(pretrained.items())}, "results": results,
            "depth_gap": depth_gap(results), "equal_memory": equal_memory(results),
            "sampling": sampling(results), "apollo": apollo(results), "runs": runs}


def _acc(a: dict, m: str = "test_token_accuracy") -> float:
    return a[m]["mean"]


def depth_gap(results: dict) -> dict:
    """Per task and depth: each depth arm's test B token accuracy minus full fine-tuning's."""
    return {task: {depth: {arm: _acc(arms[arm]) - _acc(arms["full"]) for arm in DEPTH_ARMS[1:] if arm in arms}
                   for depth, arms in by_depth.items() if "full" in arms}
            for task, by_depth in results.items()}


def equal_memory(results: dict) -> dict:
    """LISA γ=2 (each sampling) against the LoRA with its optimizer-state bytes."""
    out = {}
    for task, by_depth in results.items():
        for depth, arms in by_depth.items():
            if "lora_eq_g2" not in arms:
                continue
            row = {a: {"test_token_accuracy": _acc(arms[a]), "old_token_accuracy": _acc(arms[a], "old_token_accuracy"),
                       "optimizer_state_bytes": arms[a]["peak_optimizer_state_bytes"]}
                   for a in ("lisa_g2_uniform", "lisa_g2_cyclic", "lora_eq_g2") if a in arms}
            row["winner"] = max((a for a in row), key=lambda a: row[a]["test_token_accuracy"])
            out[f"{task}/{depth}"] = row
    return out


# Issue 30's bar: the best APOLLO arm ahead of LISA γ=2 and equal-memory LoRA by this much.
APOLLO_MARGIN = 0.15
APOLLO_BASELINES = ("lisa_g2_uniform", "lisa_g2_cyclic", "lora_eq_g2")


def apollo(results: dict) -> dict:
    """Per task and depth: the best APOLLO arm (picked on validation, as the lr is) against each
    equal-memory baseline present, in test B token accuracy points, and whether it clears the bar."""
    out = {}
    for task, by_depth in results.items():
        for depth, arms in by_depth.items():
            mine = [a for a in APOLLO_ARMS if a in arms]
            bases = [b for b in APOLLO_BASELINES if b in arms]
            if not mine or not bases:
                continue
            best = max(mine, key=lambda a: _acc(arms[a], "val_token_accuracy"))
            margins = {b: _acc(arms[best]) - _acc(arms[b]) for b in bases}
            out[f"{task}/{depth}"] = {
                "best": best, "test_token_accuracy": arms[best]["test_token_accuracy"],
                "optimizer_state_bytes": arms[best]["peak_optimizer_state_bytes"],
                "baselines": {b: arms[b]["test_token_accuracy"] for b in bases},
                "margins": margins, "clears_margin": min(margins.values()) >= APOLLO_MARGIN}
    return out


def sampling(results: dict) -> dict:
    """Cyclic minus uniform, per γ present: test B, retention A, and the spread over seeds."""
    out = {}
    for task, by_depth in results.items():
        for depth, arms in by_depth.items():
            for name in arms:
                if not name.endswith("_uniform") or name.replace("_uniform", "_cyclic") not in arms:
                    continue
                u, c = arms[name], arms[name.replace("_uniform", "_cyclic")]
                out[f"{task}/{depth}/{name.removesuffix('_uniform')}"] = {
                    "test_token_accuracy": [_acc(u), _acc(c)],
                    "old_token_accuracy": [_acc(u, "old_token_accuracy"), _acc(c, "old_token_accuracy")],
                    "test_sd": [u["test_token_accuracy"]["sd"], c["test_token_accuracy"]["sd"]],
                    "seeds": [u["test_token_accuracy"]["n"], c["test_token_accuracy"]["n"]]}
    return out


def _pct(x: dict) -> str:
    return f"{100 * x['mean']:.1f} ± {100 * x['sd']:.1f}"


def _memory_cell(row: dict, arm: str) -> str:
    if arm not in row:
        return "-"
    r = row[arm]
    return (f"{100 * r['test_token_accuracy']:.1f} (A {100 * r['old_token_accuracy']:.1f}, "
            f"{r['optimizer_state_bytes'] / 2**20:.2f} MiB)")


def markdown(summary: dict) -> str:
    lines = [f"Learning benchmark, second protocol ({summary['mode']} mode). lr picked by validation B token "
             "accuracy; test split reported, mean ± sample sd over the seeds at that lr (n in the seeds column). "
             "Accuracies in %.", ""]
    for depth, rec in summary["pretraining"].items():
        sc = next(iter(rec["scores"].values()))
        lines.append(f"- depth {depth} pre-trained {rec['steps']} steps: "
                     f"A token acc {100 * sc['old_token_accuracy']:.1f}, "
                     f"A exact match {100 * sc['old_exact_match']:.1f}; before fine-tuning, test token acc "
                     + ", ".join(f"{k} {100 * v['test_token_accuracy']:.1f}" for k, v in rec["scores"].items()))
    for task, by_depth in summary["results"].items():
        for depth, arms in by_depth.items():
            lines += ["", f"### {task}, {depth} layers", "",
                      "| arm | best lr (grid) | seeds | B test token acc | B test exact match | A token acc | "
                      "A exact match | optimizer state MiB | trainable params | tokens/s |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for name, a in sorted(arms.items(), key=lambda kv: -_acc(kv[1])):
                edge = " edge" if a["best_lr_at_grid_edge"] else ""
                rank = f" (r={a['lora_rank']})" if a["lora_rank"] else ""
                lines.append(f"| {name}{rank} | {a['best_lr']:g}{edge} ({', '.join(f'{x:g}' for x in a['grid'])}) | "
                             f"{len(a['seeds'])} | {_pct(a['test_token_accuracy'])} | {_pct(a['test_exact_match'])} | "
                             f"{_pct(a['old_token_accuracy'])} | {_pct(a['old_exact_match'])} | "
                             f"{a['peak_optimizer_state_bytes'] / 2**20:.2f} | {a['trainable_params_last']:,} | "
                             f"{a['tokens_per_s_median']:.0f} |")
    lines += ["", "### Gap to full fine-tuning (B test token accuracy, points)", "",
              "| task | depth | " + " | ".join(DEPTH_ARMS[1:]) + " |", "|---|---|" + "---|" * (len(DEPTH_ARMS) - 1)]
    for task, by_depth in summary["depth_gap"].items():
        for depth, gaps in by_depth.items():
            lines.append(f"| {task} | {depth} | " + " | ".join(
                f"{100 * gaps[a]:+.1f}" if a in gaps else "-" for a in DEPTH_ARMS[1:]) + " |")
    lines += ["", "### Equal optimizer-state bytes: LISA γ=2 against LoRA", "",
              "| task/depth | lisa_g2_uniform | lisa_g2_cyclic | lora_eq_g2 | winner |", "|---|---|---|---|---|"]
    for where, row in summary["equal_memory"].items():
        cells = " | ".join(_memory_cell(row, a) for a in ("lisa_g2_uniform", "lisa_g2_cyclic", "lora_eq_g2"))
        lines.append(f"| {where} | {cells} | {row['winner']} |")
    if summary.get("apollo"):
        lines += ["", f"### The best APOLLO arm against equal-memory LISA and LoRA (bar: {100 * APOLLO_MARGIN:.0f} "
                  "points of B test token accuracy)", "",
                  "| task/depth | best APOLLO arm (on validation) | its B test | " + " | ".join(
                      f"minus {b}" for b in APOLLO_BASELINES) + " | clears the bar |", "|---|---|---|---|---|---|---|"]
        for where, r in summary["apollo"].items():
            cells = " | ".join(f"{100 * r['margins'][b]:+.1f}" if b in r["margins"] else "-" for b in APOLLO_BASELINES)
            lines.append(f"| {where} | {r['best']} | {_pct(r['test_token_accuracy'])} | {cells} | "
                         f"{'yes' if r['clears_margin'] else 'no'} |")
    lines += ["", "### Uniform against cyclic sampling (B test, A retention, sd of B over seeds)", "",
              "| task/depth/arm | B uniform | B cyclic | A uniform | A cyclic | sd uniform | sd cyclic | seeds |",
              "|---|---|---|---|---|---|---|---|"]
    for where, r in summary["sampling"].items():
        b, a, sd = r["test_token_accuracy"], r["old_token_accuracy"], r["test_sd"]
        lines.append(f"| {where} | {100 * b[0]:.1f} | {100 * b[1]:.1f} | {100 * a[0]:.1f} | {100 * a[1]:.1f} | "
                     f"{100 * sd[0]:.1f} | {100 * sd[1]:.1f} | {r['seeds'][0]}, {r['seeds'][1]} |")
    return "\n".join(lines) + "\n"


def plots(summary: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task, by_depth in summary["results"].items():
        for depth, arms in by_depth.items():
            fig, ax = plt.subplots(figsize=(7.5, 5))
            for name, a in arms.items():
                pts = sorted(a["front"].items(), key=lambda kv: float(kv[0]))
                xs = [100 * v["test_token_accuracy"] for _, v in pts]
                ys = [100 * v["old_token_accuracy"] for _, v in pts]
                ax.plot(xs, ys, marker="o", label=name, linestyle="--" if "cyclic" in name else "-")
                for x, y, (lr, _) in zip(xs, ys, pts):
                    ax.annotate(f"{float(lr):g}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
            ax.set(xlabel="B test token accuracy (%)", ylabel="A token accuracy, retention (%)",
                   title=f"{task}, {depth} layers: every lr (sweep seeds)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            name = f"front_{task}_d{depth}.png"
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            written.append(name)
    for task, by_depth in summary["depth_gap"].items():
        if len(by_depth) < 2:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        depths = sorted(by_depth, key=int)
        for arm in DEPTH_ARMS[1:]:
            xs = [int(d) for d in depths if arm in by_depth[d]]
            ax.plot(xs, [100 * by_depth[str(d)][arm] for d in xs], marker="o", label=arm)
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xlabel="decoder layers (equal parameter count)", ylabel="B test token acc minus full FT (points)",
               title=f"{task}: gap to full fine-tuning against depth", xticks=[int(d) for d in depths])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"depth_gap_{task}.png", dpi=100)
        plt.close(fig)
        written.append(f"depth_gap_{task}.png")
    return written


def write(summary: dict, out: Path) -> None:
    import importlib.util

    out.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("matplotlib") is not None:
        summary["plots"] = plots(summary, out)
    (out / "learning2.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "learning2.md").write_text(markdown(summary))
