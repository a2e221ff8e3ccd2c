"""The run log: where a run's records go. metrics.jsonl always, TensorBoard and W&B when the
recipe asks. (What a person watching the run sees is lisaft/metrics/display.py.)

`RunLog` is the one object the loop writes to. Each backend receives the same train and eval
records, the resolved recipe as hyperparameters, and the end-of-run memory table. Only rank 0
writes anything. A resumed run continues the same TensorBoard run (same folder, events past the
checkpoint purged) and the same W&B run id (kept in RUN/logs/wandb-run.json), so no step appears
twice.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from lisaft.config.schema import LoggingSection, Recipe, flatten
from lisaft.distributed import dist
from lisaft.env import quiet
from lisaft.errors import LisaftError
from lisaft.run_folder import naming, write_atomic


class MetricsLog:
    """Append-only metrics.jsonl, written by rank 0. Every record is flushed to the kernel, so a
    killed process loses nothing that was shown; it reaches the disk (fsync) when the run
    checkpoints (`sync`): a resume keeps only the records up to its checkpoint, and an fsync per
    record cost a step on a small model as much as its optimizer (5 ms on a virtual disk)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def write(self, record: dict) -> None:
        if not dist.is_main():
            return
        with naming(self.path), self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def sync(self) -> None:
        """The records written so far, on disk."""
        if not dist.is_main() or not self.path.exists():
            return
        with self.path.open("a") as f:
            os.fsync(f.fileno())

    def truncate_after(self, step: int) -> int:
        """Drop records past `step` (logged after the checkpoint a resume starts from), so the
        resumed run appends without duplicate steps. Returns how many were dropped."""
        if not dist.is_main() or not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                dropped += 1  # a line cut short by a kill
                continue
            if rec.get("step", 0) > step:
                dropped += 1
            else:
                kept.append(line)
        write_atomic(self.path, "".join(k + "\n" for k in kept), tmp=self.path.with_suffix(".jsonl.tmp"))
        return dropped


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]



LOGS = "logs"  # RUN/logs/: everything the optional backends write
# backend -> (module that must import, extra that installs it)
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_backends(section: LoggingSection) -> None:
    """Fail at start-up, before any model loads, when a backend's package is missing."""
    for name in section.backends:
        if name not in _NEEDS:
            continue
        module, extra = _NEEDS[name]
        if importlib.util.find_spec(module) is None:
            raise LisaftError(f"logging.backends: {name} needs the {module} package; "
                              f"pip install 'lisaft[{extra}]' (or remove {name} from logging.backends)")


def scalars(record: dict) -> tuple[str, dict[str, float]]:
    """A record's numeric fields under backend names: train/loss, eval/token_accuracy, ..."""
    is_eval = "eval_loss" in record
    prefix = "eval" if is_eval else "train"
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # lists (active_layers) and nulls (grad_norm when not computed) have no curve
        name = key.removeprefix("eval_") if is_eval else key
        out[f"{prefix}/{name}"] = float(value)
    return prefix, out


def memory_rows(estimate, measured: dict) -> dict[str, dict[str, int | None]]:
    from lisaft.memory.render import estimated_vs_measured_rows

    return {name: {"estimated": est, "measured": meas}
            for name, est, meas in estimated_vs_measured_rows(estimate, measured)}


class _TensorBoard:
    def __init__(self, run_dir: Path, recipe: Recipe, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run drops whatever the earlier process logged past the
        # checkpoint it resumes from, so TensorBoard shows each step once.
        self.writer = SummaryWriter(str(run_dir / LOGS / "tensorboard"),
                                    purge_step=start_step + 1 if start_step else None)
        self.writer.add_text("recipe", "```yaml\n" + recipe.to_yaml() + "```", start_step)
        self._hparams(recipe)

    def _hparams(self, recipe: Recipe) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
                for k, v in flatten(recipe.model_dump(mode="json")).items()}
        # Written into this run's own event file (SummaryWriter.add_hparams would open a
        # separate run folder), so the HPARAMS tab links the recipe to these curves.
        events = self.writer.file_writer
        assert events is not None  # opened by SummaryWriter's constructor
        for summary in hparams(flat, {"eval/loss": 0.0, "eval/token_accuracy": 0.0}):
            events.add_summary(summary)

    def log(self, step: int, prefix: str, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def memory(self, step: int, rows: dict) -> None:
        from lisaft.memory.render import human

        lines = ["| | estimated | measured |", "| --- | --- | --- |"]
        lines += [f"| {name} | {human(r['estimated'])} | {human(r['measured'])} |" for name, r in rows.items()]
        self.writer.add_text("memory", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, recipe: Recipe, start_step: int, verbose: bool):
        import wandb

        self.wandb = wandb
        self.state_file = run_dir / LOGS / "wandb-run.json"
        state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        run_id = state.get("id") if start_step else None  # None: W&B makes a new id
        # Steps already sent before a crash (past the checkpoint this process resumes from) are
        # not sent again: W&B keeps one value per step. Train and eval are counted apart because
        # a process can die between the train record of a step and that step's eval.
        sent = state.get("logged_through", {}) if start_step else {}
        self.skip_through = {"train": sent.get("train", -1), "eval": sent.get("eval", -1)}
        self.logged_through = dict(self.skip_through)
        (run_dir / LOGS).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=recipe.logging.wandb_project, name=run_dir.name, id=run_id, resume="allow",
            dir=str(run_dir / LOGS), mode=recipe.logging.wandb_mode,
            settings=wandb.Settings(silent=not verbose, console="off"),
        )
        # A resume may change cadence keys (max_steps, eval_every, ...): the config follows.
        self.run.config.update(flatten(recipe.model_dump(mode="json")), allow_val_change=True)
        self._save_state()

    def _save_state(self) -> None:
        write_atomic(self.state_file, json.dumps({"id": self.run.id, "logged_through": self.logged_through}))

    def log(self, step: int, prefix: str, values: dict[str, float]) -> None:
        if step <= self.skip_through[prefix]:
            return
        self.run.log(values, step=step)
        self.logged_through[prefix] = step
        self._save_state()

    def memory(self, step: int, rows: dict) -> None:
        table = self.wandb.Table(columns=["quantity", "estimated_bytes", "measured_bytes"],
                                 data=[[name, r["estimated"], r["measured"]] for name, r in rows.items()])
        self.run.log({"memory": table}, step=max(step, *self.logged_through.values()))
        for name, r in rows.items():
            self.run.summary[f"memory/{name}/estimated_bytes"] = r["estimated"]
            self.run.summary[f"memory/{name}/measured_bytes"] = r["measured"]

    def close(self) -> None:
        self.run.finish()


class RunLog:
    """metrics.jsonl plus the recipe's optional backends. Use as a context manager: backends are
    flushed and closed however the loop ends."""

    def __init__(self, run_dir: Path, recipe: Recipe, start_step: int = 0):
        self.jsonl = MetricsLog(Path(run_dir) / "metrics.jsonl")
        self.backends: list = []
        self.step = start_step
        if not dist.is_main():
            return
        names = recipe.logging.backends
        if "tensorboard" in names:
            self.backends.append(_TensorBoard(Path(run_dir), recipe, start_step))
        if "wandb" in names:
            self.backends.append(_WandB(Path(run_dir), recipe, start_step, quiet.verbose()))

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sync(self) -> None:
        """metrics.jsonl on disk before a checkpoint that a resume truncates it to."""
        self.jsonl.sync()

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        self.step = max(self.step, int(record.get("step", 0)))
        prefix, values = scalars(record)
        for backend in self.backends:
            backend.log(record["step"], prefix, values)

    def memory(self, estimate, measured: dict) -> None:
        """The end-of-run estimated-vs-measured table, in every backend."""
        if not self.backends:
            return
        rows = memory_rows(estimate, measured)
        for backend in self.backends:
            backend.memory(self.step, rows)

    def close(self) -> None:
        self.jsonl.sync()
        for backend in self.backends:
            backend.close()
        self.backends = []
