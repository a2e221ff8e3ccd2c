"""metrics.jsonl and what a person watching the run sees."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from rich.console import Console

from lisaft import dist


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator peak on GPU; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    from lisaft.memory.measure import peak_rss_bytes

    return peak_rss_bytes()


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


class MetricsLog:
    """Append-only metrics.jsonl, written by rank 0, flushed after every record so that a crash
    loses nothing that was shown."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def write(self, record: dict) -> None:
        if not dist.is_main():
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
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
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)
        return dropped


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Display:
    """A live progress line on a terminal; plain log lines otherwise (CI, files, pipes)."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.enabled = enabled and dist.is_main()
        self.console = Console(highlight=False, soft_wrap=True)
        self.live = self.enabled and self.console.is_terminal
        self.total = total_steps
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self._progress = None
        self._task = None
        self._last_eval = ""

    def __enter__(self) -> "Display":
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                console=self.console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start_step, info="")
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, markup=False)

    def _eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        left = (time.perf_counter() - self.t0) / done * (self.total - step)
        return time.strftime("%H:%M:%S", time.gmtime(left))

    def train(self, rec: dict) -> None:
        if not self.enabled:
            return
        layers = rec.get("active_layers")
        layer_txt = "all" if layers is None else ",".join(map(str, layers))
        info = (f"loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  {rec['tokens_per_s']:.0f} tok/s  "
                f"mem {fmt_bytes(rec['peak_memory_bytes'])}  layers [{layer_txt}]{self._last_eval}")
        if self.live:
            self._progress.update(self._task, completed=rec["step"], info=info)
        else:
            self.console.print(f"step {rec['step']}/{self.total}  {info}  eta {self._eta(rec['step'])}",
                               markup=False)

    def eval(self, rec: dict) -> None:
        if not self.enabled:
            return
        self._last_eval = f"  eval_loss {rec['eval_loss']:.4f} acc {rec['eval_token_accuracy']:.1%}"
        msg = f"eval @ step {rec['step']}: loss {rec['eval_loss']:.4f}  token accuracy {rec['eval_token_accuracy']:.1%}"
        if self.live:
            self._progress.console.print(msg, markup=False)
        else:
            self.console.print(msg, markup=False)
