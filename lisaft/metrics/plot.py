"""`lisaft plot`: one PNG of a run's metrics.jsonl, or of several runs overlaid.

Panels: train loss (raw and smoothed) with eval loss, eval token accuracy, learning rate,
gradient norm (when logged), tokens/s, device memory against the estimate, and which LISA layers
trained at each step. Reads a running run as well as a finished one: a last line cut short by a
writer in mid-record is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

from lisaft.errors import LisaftError

SMOOTHING = 0.8  # weight of the past in the exponential moving average of the train loss


def read_records(run_dir: Path) -> list[dict]:
    """The run's records. Only the last line may be cut short (the record being written now); a
    bad line before it, or a file with nothing to plot, is an error: an empty grid would say the
    run logged nothing, which a corrupt file does not show."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise LisaftError(f"{run_dir}: not a lisaft run (no metrics.jsonl)")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise LisaftError(f"{path}: not a text file (corrupt?)") from None
    except OSError as e:
        raise LisaftError(f"{path}: cannot read it: {e.strerror or e}") from None
    lines = text.splitlines()
    # A writer appends a record and its newline together: a last line without one is in progress.
    in_progress = len(lines) if text and not text.endswith("\n") else None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
            if number == in_progress:
                continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise LisaftError(f"{path}: line {number} is not a metrics record (a corrupt file?)")
        records.append(record)
    if not any("loss" in r or "eval_loss" in r or "eval_reward" in r for r in records):
        raise LisaftError(f"{path}: no train or eval records yet: nothing to plot")
    return records


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average, debiased so the first points are not pulled toward 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


class RunData:
    def __init__(self, run_dir: Path, label: str):
        self.dir = Path(run_dir)
        self.label = label
        records = read_records(self.dir)
        self.train = [r for r in records if "loss" in r]
        self.eval = [r for r in records if "eval_loss" in r or "eval_reward" in r]
        self.pairs = any("reward_accuracy" in r or "eval_reward_accuracy" in r for r in records)
        self.grpo = any("reward_std" in r for r in self.train)  # GRPO: the reward is the curve to read
        self.estimate_bytes, self.estimate_note, self.layer_count = _estimate(self.dir)

    def series(self, key: str, records: list[dict] | None = None) -> tuple[list[int], list[float]]:
        pairs = [(r["step"], r[key]) for r in (self.train if records is None else records)
                 if r.get(key) is not None]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def untied(self, key: str, records: list[dict] | None = None) -> tuple[list[int], list[float]]:
        """A reward accuracy's series without the records where every pair tied (no preference to
        count, not 0%): DPO's step 0, where the policy is its reference."""
        ties = key.replace("_accuracy", "_ties")
        return self.series(key, [r for r in (self.train if records is None else records) if r.get(ties, 0.0) < 1])


def _estimate(run_dir: Path) -> tuple[int | None, str, int | None]:
    """The estimator's peak for the run's recipe, at data.max_seq_len (an upper bound: batches
    are padded only to their longest row), and the model's layer count."""
    from lisaft.config.schema import load_recipe
    from lisaft.memory.command import estimate_for_recipe
    from lisaft.memory.counts import param_counts

    try:
        recipe = load_recipe(run_dir / "recipe.yaml", resolve_paths=False)
        est = estimate_for_recipe(recipe, device=recipe.training.device)
    except LisaftError as e:
        return None, f"no estimate: {e}", None
    note = f"estimate ({est.settings.device}, seq {recipe.data.max_seq_len})"
    return est.comparable_peak_bytes, note, param_counts(est.settings.config, recipe.model.layers_path).layer_count


def _labels(run_dirs: list[Path]) -> list[str]:
    names = [p.resolve().name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{p.resolve().parent.name}/{p.resolve().name}" for p in run_dirs]


def plot_command(run_dirs: list[Path], out: Path | None = None) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LisaftError("lisaft plot needs matplotlib: pip install 'lisaft[plot]'") from None
    runs = [RunData(d, label) for d, label in zip(run_dirs, _labels(run_dirs))]
    if out is None:
        out = runs[0].dir / "plot.png" if len(runs) == 1 else Path("plot.png")
    fig = _figure(plt, runs)
    try:
        fig.savefig(out, dpi=72)
    except OSError as e:
        raise LisaftError(f"--out: cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    print(f"wrote {out}")
    return 0


def _figure(plt, runs: list[RunData]):
    rasters = [r for r in runs if _samples_layers(r)]
    rows = 3 + len(rasters)
    fig = plt.figure(figsize=(11, 2.6 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, 2)
    panels = [fig.add_subplot(grid[i // 2, i % 2]) for i in range(6)]
    loss, acc, lr, gnorm, speed, mem = panels
    for i, run in enumerate(runs):
        color = f"C{i}"
        steps, values = run.series("loss")
        loss.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
        loss.plot(steps, smooth(values), color=color, label=f"{run.label} train (smoothed)")
        loss.plot(*run.series("eval_loss", run.eval), "o--", color=color, markersize=3, label=f"{run.label} eval")
        if run.grpo:  # GRPO: the reward (its loss sits near 0) and how long the completions grow
            _reward(acc, run, color)
        elif run.pairs:  # a preference run: how often chosen outscores rejected
            acc.plot(*run.untied("reward_accuracy"), color=color, alpha=0.3, linewidth=0.8)
            acc.plot(*run.untied("eval_reward_accuracy", run.eval), "o-", color=color, markersize=3,
                     label=f"{run.label} eval reward accuracy")
        else:
            acc.plot(*run.series("eval_token_accuracy", run.eval), "o-", color=color, markersize=3, label=run.label)
        lr.plot(*run.series("lr"), color=color, label=run.label)
        if run.series("grad_norm")[0]:
            gnorm.plot(*run.series("grad_norm"), color=color, label=run.label)
        speed.plot(*run.series("tokens_per_s"), color=color, label=run.label)
        steps, values = run.series("peak_memory_bytes")
        mem.plot(steps, [v / 2**20 for v in values], color=color, label=f"{run.label} measured peak")
        if run.estimate_bytes is not None:
            mem.axhline(run.estimate_bytes / 2**20, color=color, linestyle=":",
                        label=f"{run.label} {run.estimate_note}")
        else:
            mem.text(0.02, 0.9 - 0.1 * i, run.estimate_note, transform=mem.transAxes, fontsize=7)
    accuracy = "eval reward accuracy" if all(r.pairs for r in runs) else \
        "eval token accuracy" if not any(r.pairs for r in runs) else "eval token / reward accuracy"
    if all(r.grpo for r in runs):
        accuracy = "reward (completion length dotted, right axis)"
    for ax, title in ((loss, "loss"), (acc, accuracy), (lr, "learning rate"),
                      (gnorm, "grad norm (before clipping)"), (speed, "tokens/s"), (mem, "device memory (MiB)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=7)
    mem.set_ylim(bottom=0)
    if not gnorm.lines:
        gnorm.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=gnorm.transAxes)
    for j, run in enumerate(rasters):
        _raster(fig.add_subplot(grid[3 + j, :]), run)
    return fig


def _reward(ax, run: RunData, color: str) -> None:
    steps, values = run.series("reward")
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
    ax.plot(steps, smooth(values), color=color, label=f"{run.label} reward (smoothed)")
    ax.plot(*run.series("eval_reward", [r for r in run.eval if "eval_reward" in r]), "o-", color=color,
            markersize=3, label=f"{run.label} eval reward")
    length = ax.twinx()
    length.plot(*run.series("completion_length"), ":", color=color)
    length.tick_params(labelsize=7)


def _samples_layers(run: RunData) -> bool:
    """Whether some step trained a subset of the layers: a run that trains every layer (no LISA,
    or γ equal to the layer count) has no pattern to draw, only a black panel."""
    sets = [r["active_layers"] for r in run.train if r.get("active_layers")]
    n_layers = max([run.layer_count or 0] + [i + 1 for a in sets for i in a])
    return any(len(set(a)) < n_layers for a in sets)


def _raster(ax, run: RunData) -> None:
    """Layer x step: a filled cell where the layer trained over that logging window."""
    import numpy as np

    records = [r for r in run.train if r.get("active_layers") is not None]
    n_layers = max([run.layer_count or 0] + [i + 1 for r in records for i in r["active_layers"]])
    cells = np.zeros((n_layers, len(records)))
    for col, r in enumerate(records):
        cells[r["active_layers"], col] = 1
    steps = [r["step"] for r in records]
    # A record covers the log_every steps up to its own.
    first = steps[0] - (steps[1] - steps[0] if len(steps) > 1 else 1)
    ax.imshow(cells, aspect="auto", origin="lower", cmap="Greys", interpolation="nearest",
              extent=(first, steps[-1], -0.5, n_layers - 0.5), vmin=0, vmax=1)
    ax.set_yticks(range(n_layers))
    ax.set_title(f"{run.label}: active LISA layers", fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    ax.tick_params(labelsize=7)
