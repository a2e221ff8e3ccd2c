"""The preference protocol's results (benchmarks/learning/preference.py): per loss and arm, the
held-out scores after training, mean ± sample sd over seeds, against the pre-trained model's."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

MEASURES = ("reward_accuracy", "logp_accuracy", "exact_match")


def _mean_sd(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": values}


def before_reward_accuracy(before: dict, loss: str) -> float | None:
    """The pre-trained model's reward accuracy under `loss`'s rewards; None for DPO, whose
    rewards are 0 there (the policy is its reference)."""
    return before.get(f"{loss}_reward_accuracy")


def summarise_cell(runs: list[dict], before: dict) -> dict:
    """One (loss, arm): each measure's mean ± sd over its seeds and the exact match's gain."""
    rs = sorted(runs, key=lambda r: r["seed"])
    cell = {m: _mean_sd([r["after"][m] for r in rs]) for m in MEASURES}
    gains = [r["after"]["exact_match"] - before["exact_match"] for r in rs]
    cell.update(exact_match_gain=_mean_sd(gains), seeds=[r["seed"] for r in rs], lr=rs[0]["lr"],
                lora_rank=rs[0].get("lora_rank"), trainable_params_last=rs[0]["trainable_params_last"],
                peak_optimizer_state_bytes=max(r["peak_optimizer_state_bytes"] for r in rs),
                wall_s_median=statistics.median(r["wall_s"] for r in rs),
                # Learned a systematic preference: most held-out pairs ordered right, in every seed.
                learned_preference=all(r["after"]["reward_accuracy"] > 0.5 for r in rs))
    return cell


def winners(cells: dict[str, dict[str, dict]]) -> dict[str, dict[str, str]]:
    """Per loss, the arm with the best mean of each measure."""
    return {loss: {m: max(arms, key=lambda a: arms[a][m]["mean"]) for m in MEASURES}
            for loss, arms in cells.items() if arms}


def summarise(mode: str, s: dict, pre: dict, runs: list[dict], lrs: dict[str, float], env: dict) -> dict:
    cells: dict[str, dict[str, dict]] = {}
    for loss in dict.fromkeys(r["loss"] for r in runs):
        for arm in dict.fromkeys(r["arm"] for r in runs if r["loss"] == loss):
            cells.setdefault(loss, {})[arm] = summarise_cell(
                [r for r in runs if r["loss"] == loss and r["arm"] == arm], pre["before"])
    planned = {(loss, arm, seed) for loss, arm in s["grid"] for seed in s["seeds"]}
    ran = {(r["loss"], r["arm"], r["seed"]) for r in runs}
    return {"benchmark": "learning", "protocol": "preference", "mode": mode, "settings": s, "environment": env,
            "pretraining": pre, "lrs": lrs, "results": cells, "winners": winners(cells),
            "not_run": sorted(planned - ran), "runs": runs}


def _pct(x: dict) -> str:
    return f"{100 * x['mean']:.1f} ± {100 * x['sd']:.1f}"


def markdown(summary: dict) -> str:
    pre, before = summary["pretraining"], summary["pretraining"]["before"]
    s = summary["settings"]
    lines = [
        f"Learning benchmark, preference protocol ({summary['mode']} mode): {s['layers']}-layer model pre-trained "
        f"{pre['steps']} steps on family A; {s['train_pairs']} train pairs, {s['eval_pairs']} held-out pairs, "
        f"{s['steps']} steps of {s['batch_size']} pairs. Held-out figures in %, mean ± sample sd over the seeds.",
        "",
        f"Before training: greedy exact match {100 * before['exact_match']:.1f}, log-prob accuracy "
        f"{100 * before['logp_accuracy']:.1f}, SimPO reward accuracy {100 * before['simpo_reward_accuracy']:.1f}, "
        f"ORPO reward accuracy {100 * before['orpo_reward_accuracy']:.1f} (DPO's: every margin 0).",
        "",
        "| loss | arm | lr | seeds | reward acc | log-prob acc | greedy exact match | gain (points) "
        "| optimizer state MiB | trainable params | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for loss, arms in summary["results"].items():
        for arm, c in arms.items():
            name = f"{arm} (r={c['lora_rank']})" if c["lora_rank"] else arm
            gain = c["exact_match_gain"]
            lines.append(f"| {loss} | {name} | {c['lr']:g} | {len(c['seeds'])} | {_pct(c['reward_accuracy'])} | "
                         f"{_pct(c['logp_accuracy'])} | {_pct(c['exact_match'])} | {100 * gain['mean']:+.1f} | "
                         f"{c['peak_optimizer_state_bytes'] / 2**20:.2f} | {c['trainable_params_last']:,} | "
                         f"{c['wall_s_median']:.0f} |")
    lines += ["", "| loss | best reward acc | best log-prob acc | best greedy exact match |", "|---|---|---|---|"]
    lines += [f"| {loss} | {w['reward_accuracy']} | {w['logp_accuracy']} | {w['exact_match']} |"
              for loss, w in summary["winners"].items()]
    if summary["not_run"]:
        lines += ["", f"Not run: {len(summary['not_run'])} of the planned (loss, arm, seed) runs: "
                  + ", ".join(f"{a}/{b}/{c}" for a, b, c in summary["not_run"])]
    return "\n".join(lines) + "\n"


def write(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning-pref.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "learning-pref.md").write_text(markdown(summary))
