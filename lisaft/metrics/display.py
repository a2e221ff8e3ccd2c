"""What a person watching the run sees: the progress bar, the train and eval lines. (The records
themselves go to the run log, lisaft/metrics/log.py.)"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

from lisaft.distributed import dist


def _count(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 10_000 else f"{n:.0f}"


def _memory(n: float) -> str:
    # One decimal is enough to watch a peak; the full figure is in metrics.jsonl.
    return f"{n / 2**30:.1f}GiB" if n >= 2**30 else f"{n / 2**20:.0f}MiB"


def _cut(text: str, room: int) -> str:
    return text if len(text) <= room else text[: max(room - 1, 1)] + "…"


def train_line(rec: dict, total: int, width: int = 80) -> str:
    """One train record in at most `width` columns: step, loss, lr, gradient norm (before
    clipping), tok/s, memory, layers. Fields are spaced by two, or by one when that makes the
    layers fit; a layer list that still does not fit is cut."""
    rewards = []
    if "reward_accuracy" in rec:  # a preference run: how often chosen outscores rejected, and by how much
        rewards = [f"acc {_reward_accuracy(rec, 'reward', '.0%')}", f"margin {rec['reward_margin']:.3g}"]
    elif "reward_std" in rec:  # GRPO: the reward is what to watch, its loss sits near 0 (docs/grpo.md)
        rewards = [f"reward {rec['reward']:.3g}", f"±{rec['reward_std']:.2g}"]
        if "generation_share" in rec:  # the share of the step spent sampling: what a faster step would cut
            rewards.append(f"gen {rec['generation_share']:.0%}")
    layers = "all" if rec.get("active_layers") is None else ",".join(map(str, rec["active_layers"]))
    # Spacing is chosen for the widest step counter, so it does not change as the run goes on.
    widest = len(str(total)) - len(str(rec["step"]))
    while True:  # the reward fields give way, margin first, where the line would not fit
        fields = [f"step {rec['step']}/{total}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.1e}", *rewards]
        if rec.get("grad_norm") is not None:
            fields.append(f"gn {rec['grad_norm']:.2g}")
        fields += [f"{_count(rec['tokens_per_s'])} tok/s", f"mem {_memory(rec['peak_memory_bytes'])}"]
        for sep in ("  ", " "):
            head = sep.join(fields) + sep + "layers "
            if len(head) + widest + len(layers) <= width:
                break
        if len(head) + widest + 2 <= width or not rewards:
            return head + _cut(layers, width - len(head))
        rewards.pop()


def _reward_accuracy(rec: dict, prefix: str, spec: str) -> str:
    """The share of pairs whose chosen answer outscores the rejected one; when every pair tied (DPO
    before its first update) there is no preference to count, which 0% would misread."""
    ties = rec.get(f"{prefix}_ties", 0.0)
    if ties >= 1:
        return "— (all tied)"
    return f"{rec[f'{prefix}_accuracy']:{spec}}" + (f" ({ties:{spec}} tied)" if ties > 0 else "")


def eval_line(rec: dict) -> str:
    if "eval_reward_std" in rec:
        return f"eval step {rec['step']}  reward {rec['eval_reward']:.4g}  ±{rec['eval_reward_std']:.2g}"
    if "eval_reward_accuracy" in rec:
        return (f"eval step {rec['step']}  loss {rec['eval_loss']:.4f}  "
                f"reward accuracy {_reward_accuracy(rec, 'eval_reward', '.1%')}  "
                f"margin {rec['eval_reward_margin']:.3g}")
    return (f"eval step {rec['step']}  loss {rec['eval_loss']:.4f}  "
            f"token accuracy {rec['eval_token_accuracy']:.1%}")


class Display:
    """What a person watching the run sees. On a terminal: one line per logged step kept as
    history, each eval on its own line, and a live bar with ETA at the bottom. Elsewhere (CI,
    files, pipes): the same lines, plain, with the ETA on each step line."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.enabled = enabled and dist.is_main()
        self.console = Console(highlight=False, soft_wrap=True)
        self.live = self.enabled and self.console.is_terminal
        self.total = total_steps
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Display:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=None),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=True,
            )
            progress.start()
            self._task = progress.add_task("train", total=self.total, completed=self.start_step)
            self._progress = progress
        return self

    def __exit__(self, *exc) -> None:
        self._stop_bar()

    def _stop_bar(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

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
        if self._progress is None:
            # Plain lines may be read long after, in a log file: no width to fit, the ETA helps.
            self.print(f"{train_line(rec, self.total, width=200)}  eta {self._eta(rec['step'])}")
            return
        self.print(train_line(rec, self.total, width=self.console.width))
        assert self._task is not None  # added with the bar
        self._progress.update(self._task, completed=rec["step"])
        if rec["step"] >= self.total:
            self._stop_bar()  # what follows (final save, memory table) prints below a still screen

    def eval(self, rec: dict) -> None:
        self.print(eval_line(rec))


class PassBar:
    """A bar for a pass before training (DPO's reference log-probs): on a terminal a live bar,
    elsewhere one line when it starts and one when it ends."""

    def __init__(self, what: str, total: int, enabled: bool = True):
        self.what, self.total = what, total
        self.enabled = enabled and dist.is_main()
        self.console = Console(highlight=False, soft_wrap=True)
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self.t0 = time.perf_counter()

    def __enter__(self) -> PassBar:
        if self.enabled and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn(self.what), MofNCompleteColumn(), BarColumn(bar_width=None),
                                      TimeRemainingColumn(), console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.what, total=self.total)
        elif self.enabled:
            self.console.print(f"{self.what}: {self.total} batches", markup=False)
        return self

    def advance(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.enabled and exc[0] is None:
            self.console.print(f"{self.what}: done in {time.perf_counter() - self.t0:.1f} s", markup=False)
