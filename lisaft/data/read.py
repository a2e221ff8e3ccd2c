"""Reading rows: local files (jsonl/json/csv/parquet), saved dataset folders and hub datasets,
each row a dict, with the words an error message needs to point at one row."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from lisaft.config.hub import DATA_FILE_SUFFIXES, can_only_be_path
from lisaft.console import first_line
from lisaft.errors import LisaftError

_FILE_KINDS = {suffix: suffix[1:] for suffix in DATA_FILE_SUFFIXES}  # ".jsonl" -> "jsonl"


class Rows:
    """Rows of one source, with the words an error message needs to point at one of them."""

    def __init__(self, rows: list[dict], key: str, source: str, unit: str):
        self.rows = rows
        self.key = key  # recipe key the source came from: data.train / data.eval
        self.source = source
        self.unit = unit  # "line" for jsonl (numbers count every line), "row" otherwise
        self.numbers: list[int] = list(range(1, len(rows) + 1))

    def where(self, i: int) -> str:
        return f"{self.key}: {self.source}: {self.unit} {self.numbers[i]}"

    def subset(self, indices: list[int]) -> Rows:
        out = Rows([self.rows[i] for i in indices], self.key, self.source, self.unit)
        out.numbers = [self.numbers[i] for i in indices]
        return out


def _read_jsonl(path: Path, key: str) -> Rows:
    # Read by hand rather than through datasets: an error can then name the exact line, and a
    # field whose type changes between rows is reported at that row instead of failing pyarrow's
    # schema inference for the whole file.
    rows, numbers = [], []
    try:
        # split("\n"), not splitlines(): U+2028 and friends may sit raw inside JSON strings.
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError:
        raise LisaftError(f"{key}: {path}: not UTF-8 text") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LisaftError(f"{key}: {path}: line {lineno}: not valid JSON ({_json_problem(e, line)})"
                              f"{_more_bad_lines(lines, lineno)}") from None
        if not isinstance(row, dict):
            raise LisaftError(f"{key}: {path}: line {lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        numbers.append(lineno)
    out = Rows(rows, key, str(path), "line")
    out.numbers = numbers
    return out


def _more_bad_lines(lines: list[str], first: int) -> str:
    """How many lines after the first bad one are not JSON either: one fix or many."""
    bad = []
    for n, line in enumerate(lines[first:], first + 1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError:
                bad.append(n)
    if not bad:
        return ""
    shown = ", ".join(map(str, bad[:3])) + (", ..." if len(bad) > 3 else "")
    return f"; after it, {len(bad)} more not valid JSON (line{'s' if len(bad) > 1 else ''} {shown})"


def _json_problem(e: json.JSONDecodeError, line: str) -> str:
    """json's own words end in "at" and leave the place to its position fields: say where."""
    if e.pos >= len(line.rstrip()):
        return "the line ends before its JSON object does; was the file cut short?"
    where = f"column {e.colno}"
    return f"{e.msg} {where}" if e.msg.endswith(" at") else f"{e.msg} at {where}"


def _read_json(path: Path, key: str) -> Rows:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise LisaftError(f"{key}: {path}: not UTF-8 text") from None
    except json.JSONDecodeError:
        # Many ".json" files are JSON lines in fact.
        return _read_jsonl(path, key)
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise LisaftError(f"{key}: {path}: columns have different lengths {sorted(lengths)}")
        cols = list(data)
        data = [dict(zip(cols, vals)) for vals in zip(*data.values())]
    if not isinstance(data, list):
        raise LisaftError(f"{key}: {path}: expected a list of objects (or JSON lines)")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise LisaftError(f"{key}: {path}: row {i + 1}: expected a JSON object, got {type(row).__name__}")
    return Rows(data, key, str(path), "row")


def _pick_split(ds: Any, key: str, source: str, split: str | None = None) -> Any:
    """A Dataset from whatever load_dataset/load_from_disk returned."""
    from datasets import DatasetDict

    if not isinstance(ds, DatasetDict):
        return ds
    if split is not None:
        if split not in ds:
            which = "data.train_split" if key == "data.train" else "data.eval_split"
            raise LisaftError(f"{which}: {source} has no split {split!r}; it has {', '.join(sorted(ds))}")
        return ds[split]
    wanted = ("train",) if key == "data.train" else ("validation", "test", "eval")
    for name in wanted:
        if name in ds:
            return ds[name]
    if len(ds) == 1:
        return next(iter(ds.values()))
    raise LisaftError(f"{key}: {source}: has splits {sorted(ds)}, none of {list(wanted)}")


def _read_with_datasets(ref: str, kind: str, key: str, split: str | None = None,
                        subset: str | None = None) -> Rows:
    try:
        import datasets
    except ImportError:
        raise LisaftError(
            f"{key}: {ref}: reading {kind} data needs the `datasets` package (pip install datasets)"
        ) from None
    if kind == "hub":
        from huggingface_hub import constants

        from lisaft.config.hub import hub_offline

        # With HF_HUB_OFFLINE set, datasets answers from its cache at once; without it, an
        # unreachable hub would cost a long series of retries before the same answer.
        if hub_offline() and not constants.HF_HUB_OFFLINE:
            raise LisaftError(f"{key}: {ref!r} is not a local file or folder, and the hub cannot be "
                              "reached from here (offline); point it to a local file")
    # Progress bars for reading a local file are noise on the run's display.
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if kind == "disk":
            ds = datasets.load_from_disk(ref)
        elif kind == "csv":
            # Every column as text: an `output` column of numbers stays "42", not 42.
            with open(ref, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [])
            features = datasets.Features({name: datasets.Value("string") for name in header})
            ds = datasets.load_dataset("csv", data_files=ref, split="train", features=features)
        elif kind == "parquet":
            ds = datasets.load_dataset("parquet", data_files=ref, split="train")
        else:
            ds = datasets.load_dataset(ref, subset)
    except LisaftError:
        raise
    except Exception as e:  # datasets and pyarrow raise many types for unreadable input
        if kind == "hub":
            raise LisaftError(
                f"{key}: {ref!r} is not a local file or folder and could not be loaded from the hub "
                f"(offline, or no such dataset): {first_line(e)}"
            ) from None
        what = "a saved dataset folder (datasets.save_to_disk)" if kind == "disk" else f"a {kind} file"
        raise LisaftError(f"{key}: {ref}: cannot read it as {what}: {first_line(e)}") from None
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    ds = _pick_split(ds, key, ref, split)
    return Rows(ds.to_list(), key, ref, "row")


def read_rows(ref: str, key: str, subset: str | None = None, split: str | None = None) -> Rows:
    """The rows of a local file, saved dataset folder or hub dataset, as a list of dicts."""
    path = Path(ref).expanduser()
    if path.exists() and not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise LisaftError(f"{key}: {path}: permission denied; make it readable (chmod a+r) or point "
                          f"{key} to a copy you can read")
    if path.is_dir():
        rows = _read_with_datasets(str(path), "disk", key, split)
    elif path.is_file():
        kind = _FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise LisaftError(
                f"{key}: {path}: unsupported file type {path.suffix or '(none)'!r}; "
                "use .jsonl, .json, .csv, .parquet or a saved dataset folder"
            )
        if kind == "jsonl":
            rows = _read_jsonl(path, key)
        elif kind == "json":
            rows = _read_json(path, key)
        else:
            rows = _read_with_datasets(str(path), kind, key)
    elif can_only_be_path(ref, data_file=True):
        raise LisaftError(f"{key}: {ref}: no such file or folder")
    else:
        rows = _read_with_datasets(ref, "hub", key, split, subset)
    if not rows.rows:
        raise LisaftError(f"{key}: {rows.source}: the dataset is empty")
    return rows


def rename_columns(rows: Rows, columns: dict[str, str]) -> Rows:
    """data.columns: rename row fields, and the fields of chat turns (ShareGPT's from/value)."""
    if not columns:
        return rows

    def rename(d: dict) -> dict:
        return {columns.get(k, k): v for k, v in d.items()}

    out = []
    for row in rows.rows:
        row = rename(row)
        for k, v in row.items():
            if isinstance(v, list) and any(isinstance(m, dict) for m in v):
                row[k] = [rename(m) if isinstance(m, dict) else m for m in v]
        out.append(row)
    rows.rows = out
    return rows
