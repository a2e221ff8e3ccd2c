"""From runs to results: best learning rate per arm, mean ± spread over seeds, the targets, the
markdown table and the plots."""

from __future__ import annotations

import statistics
from pathlib import Path

MEASURES = ("new_token_accuracy", "new_exact_match", "old_token_accuracy", "old_exact_match",
            "new_loss", "old_loss")
# Which lr is best for an arm: the mean final new-task token accuracy over the sweep seeds.
SELECT_BY = "new_token_accuracy"


def _mean_sd(values: list[float]) -> dict:
    """Mean and spread; the spread is the sample standard deviation over seeds (0 for one seed)."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": values}


def _mean_curve(runs: list[dict], baseline: dict) -> list[dict]:
    steps = [c["step"] for c in runs[0]["curve"]]
    out = [{"step": 0, "new_token_accuracy": baseline["new_token_accuracy"],
            "old_token_accuracy": baseline["old_token_accuracy"]}]
    for i, step in enumerate(steps):
        out.append({"step": step, **{k: statistics.fmean(r["curve"][i][k] for r in runs)
                                     for k in ("new_token_accuracy", "old_token_accuracy")}})
    return out


def sweep_seeds(s: dict) -> list[int]:
    """The seeds that run every lr of the grid: all, or (to save time) only the first, the
    others then running at the best lr alone."""
    return s["seeds"] if s.get("sweep_all_seeds") else s["seeds"][:1]


def sweep_means(sweep_runs: list[dict], measure: str) -> dict[float, float]:
    lrs = sorted({r["lr"] for r in sweep_runs})
    return {lr: statistics.fmean(r["final"][measure] for r in sweep_runs if r["lr"] == lr) for lr in lrs}


def best_lr(sweep_runs: list[dict]) -> float:
    """The lr whose runs on the sweep seeds have the best mean final SELECT_BY."""
    means = sweep_means(sweep_runs, SELECT_BY)
    return max(means, key=means.get)


def summarise_arm(runs: list[dict], s: dict, baseline: dict) -> dict:
    """Runs of one arm: the lr sweep on the sweep seeds, and every seed at the best lr."""
    sweep_runs = [r for r in runs if r["seed"] in sweep_seeds(s)]
    best, lrs = best_lr(sweep_runs), s["lrs"]
    rs = [r for r in runs if r["lr"] == best]
    out = {
        "best_lr": best,
        "best_lr_at_grid_edge": len(lrs) > 1 and best in (min(lrs), max(lrs)),
        "sweep_seeds": sweep_seeds(s),
        "sweep_new_token_accuracy": {str(lr): v for lr, v in sweep_means(sweep_runs, SELECT_BY).items()},
        "sweep_old_token_accuracy": {str(lr): v for lr, v in sweep_means(sweep_runs, "old_token_accuracy").items()},
        "seeds": [r["seed"] for r in rs],
        **{m: _mean_sd([r["final"][m] for r in rs]) for m in MEASURES},
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
        "tokens_per_run": rs[0]["tokens"],
        "peak_rss_bytes": max((r["peak_rss_bytes"] or 0) for r in rs) or None,
        "trainable_params_last": rs[0]["trainable_params_last"],
        "curve": _mean_curve(rs, baseline),
    }
    for k in ("peak_optimizer_state_bytes", "peak_grad_bytes", "peak_master_copy_bytes"):
        out[k] = max(r[k] for r in rs)
    return out


def targets(arms: dict) -> dict:
    """The issue's targets, read off the results (reported, never asserted)."""
    out = {}
    if {"full", "lisa_g2"} <= set(arms):
        full, lisa = arms["full"], arms["lisa_g2"]
        gap = lisa["new_token_accuracy"]["mean"] - full["new_token_accuracy"]["mean"]
        out["lisa_g2_minus_full_new_token_accuracy"] = gap
        out["lisa_g2_minus_full_new_exact_match"] = lisa["new_exact_match"]["mean"] - full["new_exact_match"]["mean"]
        out["lisa_g2_within_1pt_of_full"] = gap >= -0.01
        out["lisa_g2_minus_full_old_token_accuracy"] = \
            lisa["old_token_accuracy"]["mean"] - full["old_token_accuracy"]["mean"]
        out["lisa_g2_retention_at_least_full"] = out["lisa_g2_minus_full_old_token_accuracy"] >= 0
    if {"lora_r16", "lisa_g2"} <= set(arms):
        d = arms["lisa_g2"]["new_token_accuracy"]["mean"] - arms["lora_r16"]["new_token_accuracy"]["mean"]
        out["lisa_g2_minus_lora_r16_new_token_accuracy"] = d
        out["lisa_g2_beats_lora_r16"] = d > 0
    return out


def _pct(x: dict) -> str:
    return f"{100 * x['mean']:.1f} ± {100 * x['sd']:.1f}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def markdown(summary: dict) -> str:
    s = summary["settings"]
    lines = [
        f"Learning benchmark ({summary['mode']} mode): fine-tuning on task family B after pre-training on A; "
        f"{s['steps']} steps x {s['batch_size']} examples; lr grid {s['lrs']} on seeds {sweep_seeds(s)}, "
        f"best lr per arm by mean final B token accuracy over them"
        + (f", then rerun on seeds {s['seeds'][1:]}" if not s.get("sweep_all_seeds") and len(s["seeds"]) > 1 else "")
        + f". Accuracies in %, mean ± sample sd over seeds {s['seeds']}.",
        "",
        f"Pre-trained model before fine-tuning: B token acc {100 * summary['baseline']['new_token_accuracy']:.1f}, "
        f"A token acc {100 * summary['baseline']['old_token_accuracy']:.1f}, "
        f"A exact match {100 * summary['baseline']['old_exact_match']:.1f}.",
        "",
        "| arm | best lr | B token acc | B exact match | A token acc (retention) | A exact match | "
        "tokens/s | peak RSS MiB | optimizer state MiB | grads MiB | trainable params |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in summary["arms"].items():
        if a.get("status") == "skipped":
            lines.append(f"| {name} | skipped: {a['note']} |" + " |" * 9)
            continue
        edge = " (edge)" if a["best_lr_at_grid_edge"] else ""
        state = _mib(a["peak_optimizer_state_bytes"])
        if a["peak_master_copy_bytes"]:
            state += f" + {_mib(a['peak_master_copy_bytes'])} fp32 copy"
        lines.append(
            f"| {name} | {a['best_lr']:g}{edge} | {_pct(a['new_token_accuracy'])} | {_pct(a['new_exact_match'])} | "
            f"{_pct(a['old_token_accuracy'])} | {_pct(a['old_exact_match'])} | {a['tokens_per_s_median']:.0f} | "
            f"{_mib(a['peak_rss_bytes'])} | {state} | {_mib(a['peak_grad_bytes'])} | {a['trainable_params_last']:,} |")
    p = summary["precision"]
    lines += ["", f"Precision arm (LISA γ=2, lr {p.get('lr', '-')}, seed {p.get('seed', '-')}):"]
    if p["status"] == "skipped":
        lines.append(f"skipped: {p['note']}")
    else:
        lines += ["", "| weights / update rounding | B token acc | B loss | A token acc | A loss |",
                  "|---|---|---|---|---|"]
        for name, r in p["runs"].items():
            f = r["final"]
            lines.append(f"| {name} | {100 * f['new_token_accuracy']:.2f} | {f['new_loss']:.4f} | "
                         f"{100 * f['old_token_accuracy']:.2f} | {f['old_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def _tradeoff(plt, arms: dict, path: Path, summary_seeds: list[int]) -> str:
    """Every lr of the sweep as a point (new-task accuracy, retention): which arm gives up least
    of A for what it learns of B, whatever lr the table picked."""
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, a in arms.items():
        lrs = list(a["sweep_new_token_accuracy"])
        x = [100 * a["sweep_new_token_accuracy"][lr] for lr in lrs]
        y = [100 * a["sweep_old_token_accuracy"][lr] for lr in lrs]
        ax.plot(x, y, marker="o", label=name)
        for xi, yi, lr in zip(x, y, lrs):
            ax.annotate(f"{float(lr):g}", (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="new task (B) token accuracy (%)", ylabel="old task (A) token accuracy (%)",
           title=f"learning vs forgetting, every lr (mean over seeds {summary_seeds})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plots(summary: dict, out_dir: Path) -> list[str]:
    """Accuracy on B and on A against steps (best lr per arm, mean over seeds) and memory bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {k: a for k, a in summary["arms"].items() if a.get("status") != "skipped"}
    written = []
    for key, title, fname in (("new_token_accuracy", "new task (B): eval token accuracy", "accuracy_new_task.png"),
                              ("old_token_accuracy", "old task (A): eval token accuracy (retention)",
                               "accuracy_old_task.png")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, a in arms.items():
            ax.plot([c["step"] for c in a["curve"]], [100 * c[key] for c in a["curve"]],
                    marker=".", label=f"{name} (lr {a['best_lr']:g})")
        ax.set(xlabel="fine-tuning step", ylabel="token accuracy (%)", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        written.append(fname)

    written.append(_tradeoff(plt, arms, out_dir / "tradeoff.png", sweep_seeds(summary["settings"])))
    names = list(arms)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    bottom = [0.0] * len(names)
    for key, label in (("peak_optimizer_state_bytes", "optimizer state"), ("peak_grad_bytes", "gradients"),
                       ("peak_master_copy_bytes", "fp32 master copy (BAdam)")):
        vals = [arms[n][key] / 2**20 for n in names]
        ax1.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set(ylabel="MiB (peak over the run)", title="optimizer state + gradients")
    ax1.legend(fontsize=8)
    ax2.bar(names, [(arms[n]["peak_rss_bytes"] or 0) / 2**20 for n in names], color="grey")
    ax2.set(ylabel="MiB", title="peak RSS of the process during the run")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=110)
    plt.close(fig)
    written.append("memory.png")
    return written
