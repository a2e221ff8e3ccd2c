"""The second protocol's two kinds of fine-tuning task, each with a validation and a test split.

new_skill   task family B (Shift, Rotate, Double): string skills the pre-trained model cannot do.
new_format  task family A's own skills (Reverse, Uppercase, Sort), asked for with a new
            instruction ("Reverse as list") and answered in a template the model never saw:
            the answer's letters joined by '-' inside '<' '>' ("abc" reversed: "<c-b-a>"). The
            model already knows the content; the fine-tune teaches a format, as instruction
            tuning does in LISA's paper.

Every kind's eval inputs are disjoint from its train inputs; the validation split picks the lr
and the test split, never looked at until then, is reported. Retention is A in its original
format on A's held-out eval rows (the quickstart's eval.jsonl inputs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

KINDS = ("new_skill", "new_format")


def _as_list(fn):
    return lambda s: "<" + "-".join(fn(s)) + ">"


def format_tasks() -> dict:
    from scripts import make_quickstart_assets as gen

    return {f"{name} as list": _as_list(fn) for name, fn in gen.TASKS.items()}


def write_task_data(kind: str, data_dir: Path, s: dict) -> None:
    """new_train / new_val / new_test for `kind`, A_train (pre-training) and old_test (retention)."""
    from scripts import make_quickstart_assets as gen

    data_dir.mkdir(parents=True, exist_ok=True)
    a_train, a_eval = gen.make_rows(random.Random(gen.SEED))
    tasks, salt = (gen.FAMILIES["B"], 1) if kind == "new_skill" else (format_tasks(), 2)
    n = s["eval_rows"]
    train, held_out = gen.task_rows(tasks, random.Random(gen.SEED + salt), s["new_train_rows"], 2 * n)
    for name, rows in (("A_train", a_train), ("old_test", a_eval[:n]), ("new_train", train),
                       ("new_val", held_out[:n]), ("new_test", held_out[n:])):
        gen.write_jsonl(data_dir / f"{name}.jsonl", rows)


@dataclass
class TaskData:
    """Tokenized splits; `new_eval` (the validation split) is what a lisaft session is handed."""
    tokenizer: object
    new_train: list
    new_val: list
    new_test: list
    old_test: list

    @property
    def new_eval(self) -> list:
        return self.new_val


_CACHE: dict[str, TaskData] = {}


def load_task_data(data_dir: str, tokenizer_dir: str, max_seq_len: int) -> TaskData:
    """Read once per process."""
    if data_dir not in _CACHE:
        from lisaft.config.schema import DataSection, ModelSection
        from lisaft.data.examples import load_splits
        from lisaft.model.load import load_tokenizer

        tok = load_tokenizer(ModelSection(config="unused", tokenizer=tokenizer_dir))
        d = Path(data_dir)

        def split(name: str) -> list:
            sec = DataSection(train=str(d / f"{name}.jsonl"), format="instruction", max_seq_len=max_seq_len)
            return load_splits(sec, tok, 0)[0]

        _CACHE[data_dir] = TaskData(tok, split("new_train"), split("new_val"), split("new_test"), split("old_test"))
    return _CACHE[data_dir]
