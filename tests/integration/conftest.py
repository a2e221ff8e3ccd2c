"""A tiny run set up from scratch in a temporary folder: a 4-layer Llama config, the shipped
quickstart tokenizer, and a small instruction dataset written by the test."""

import json
import random
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "recipes" / "quickstart" / "tokenizer"


def _vocab_size() -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(TOKENIZER))


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
        rows.append({"instruction": "Reverse", "input": s, "output": s[::-1]})
    return rows


@pytest.fixture
def tiny_run(tmp_path: Path, monkeypatch):
    """Returns a function(**sections) that writes a recipe and returns its path. The test runs in
    the recipe's folder, so a relative path given with --set lands there too."""
    monkeypatch.chdir(tmp_path)
    return make_tiny_run(tmp_path)


@pytest.fixture(scope="module")
def shared_tiny_run(tmp_path_factory):
    """tiny_run for a module whose tests share runs (one folder for the whole module), which
    the module's tests run in."""
    folder = tmp_path_factory.mktemp("shared")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        yield make_tiny_run(folder)


def make_tiny_run(tmp_path: Path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=_vocab_size(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False)
    cfg.save_pretrained(tmp_path / "model")
    for name, n, seed in (("train", 96, 1), ("eval", 16, 2)):
        with (tmp_path / f"{name}.jsonl").open("w") as f:
            for row in _rows(n, seed):
                f.write(json.dumps(row) + "\n")

    def make(name: str = "recipe.yaml", **sections) -> Path:
        recipe = {
            "model": {"config": "model/config.json", "tokenizer": str(TOKENIZER), "dtype": "float32",
                      "attention": "sdpa"},
            "data": {"train": "train.jsonl", "eval": "eval.jsonl", "format": "instruction", "max_seq_len": 32},
            "optimizer": {"name": "adamw_32bit", "lr": 3e-3},
            "scheduler": {"name": "cosine", "warmup_steps": 2},
            "lisa": {"enabled": True, "active_layers": 2, "interval_steps": 3},
            "training": {"seed": 0, "batch_size": 4, "max_steps": 8, "log_every": 1, "eval_every": 4,
                         "eval_batches": 2, "output_dir": "run"},
        }
        for section, values in sections.items():
            recipe.setdefault(section, {}).update(values)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(recipe))
        return path

    make.dir = tmp_path
    return make
