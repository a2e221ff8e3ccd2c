"""QLoRA against LoRA on the CPU: a tiny Llama base (bf16, 4 layers, --hidden wide) trained for
20 steps by `lisaft train` with rank-4 adapters on every linear layer, once on the bf16 base and
once on the same base in 4-bit NF4 (model.quantize: nf4), alternating --rounds times after one
warm-up run. Prints each run's train() wall time and its median tokens/s over steps 2-20 (one
eval at step 10 included in the wall time), then the QLoRA/LoRA ratio of the medians.

    OMP_NUM_THREADS=1 python -m benchmarks.qlora_cpu_speed --hidden 64 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from lisaft.metrics.log import read_metrics
from lisaft.train import train

TOKENIZER = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "tokenizer"


def _base(folder: Path, hidden: int) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(TOKENIZER)), hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder / "base")
    rng = random.Random(0)
    for name, n in (("train", 96), ("eval", 16)):
        with (folder / f"{name}.jsonl").open("w") as f:
            for _ in range(n):
                s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
                f.write(json.dumps({"instruction": "Reverse", "input": s, "output": s[::-1]}) + "\n")
    return folder / "base"


def _run(folder: Path, base: Path, quantize: str | None, name: str) -> tuple[float, float]:
    recipe = {
        "model": {"name_or_path": str(base), "tokenizer": str(TOKENIZER), "dtype": "bfloat16",
                  "quantize": quantize, "attention": "sdpa"},
        "data": {"train": str(folder / "train.jsonl"), "eval": str(folder / "eval.jsonl"),
                 "format": "instruction", "max_seq_len": 32},
        "optimizer": {"name": "adamw_32bit", "lr": 1e-2},
        "lisa": {"enabled": False},
        "lora": {"enabled": True, "rank": 4},
        "training": {"seed": 0, "batch_size": 4, "max_steps": 20, "log_every": 1, "eval_every": 10,
                     "eval_batches": 2, "save_every": 0, "output_dir": str(folder / name)},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    start = time.perf_counter()
    if train(path, show=False) != 0:
        raise SystemExit(f"{name} failed")
    wall = time.perf_counter() - start
    rows = [r for r in read_metrics(folder / name / "metrics.jsonl") if "loss" in r]
    return wall, statistics.median(r["tokens_per_s"] for r in rows[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        base = _base(folder, args.hidden)
        _run(folder, base, None, "warm-up")
        speeds: dict[str, list[float]] = {"lora": [], "qlora": []}
        for i in range(args.rounds):
            for kind, quantize in (("qlora", "nf4"), ("lora", None)):
                wall, tps = _run(folder, base, quantize, f"{kind}-{i}")
                speeds[kind].append(tps)
                print(f"{kind} round {i}: train() {wall:.2f} s, median {tps:.0f} tokens/s")
    lora, qlora = statistics.median(speeds["lora"]), statistics.median(speeds["qlora"])
    print(json.dumps({"hidden": args.hidden, "lora_tokens_per_s": round(lora), "qlora_tokens_per_s": round(qlora),
                      "qlora_slowdown": round(lora / qlora, 2)}))


if __name__ == "__main__":
    main()
