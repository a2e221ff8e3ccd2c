"""How often a 2-rank gloo run aborts at exit: "terminate called without an active exception".

The tiniest data-parallel run lisaft has (a 4-layer Llama of width 32, two ranks on the CPU,
2 optimizer steps, its final export), launched with torchrun --runs times. A run counts as an
abort when it ends by a signal or its output has the terminate line, after the training itself
finished (its run folder has final/).

    nice -n 10 python -m benchmarks.exit_abort --runs 50 --out benchmarks/results/exit_abort.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "recipes" / "quickstart" / "tokenizer"
TERMINATE = "terminate called without an active exception"


def make_run_folder(folder: Path) -> Path:
    """The model config, data and recipe of the tests' tiny run; returns the recipe."""
    from transformers import AutoTokenizer, LlamaConfig

    cfg = LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(TOKENIZER)), hidden_size=32,
                      intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False)
    cfg.save_pretrained(folder / "model")
    rng = random.Random(1)
    with (folder / "train.jsonl").open("w") as f:
        for _ in range(32):
            s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
            f.write(json.dumps({"instruction": "Reverse", "input": s, "output": s[::-1]}) + "\n")
    recipe = {
        "model": {"config": "model/config.json", "tokenizer": str(TOKENIZER), "dtype": "float32", "attention": "sdpa"},
        "data": {"train": "train.jsonl", "format": "instruction", "max_seq_len": 32},
        "optimizer": {"name": "adamw_32bit", "lr": 3e-3},
        "scheduler": {"name": "constant"},
        "lisa": {"enabled": True, "active_layers": 2, "interval_steps": 1},
        "training": {"seed": 0, "batch_size": 2, "max_steps": 2, "log_every": 1, "output_dir": "run"},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def one_run(folder: Path, recipe: Path, i: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lisaft", "train", str(recipe), "--set", f"training.output_dir=run{i}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    return {"rc": proc.returncode, "terminate": TERMINATE in out, "signal": "Signal" in out or "SIGABRT" in out,
            "trained": (folder / f"run{i}" / "final").is_dir(), "seconds": round(time.perf_counter() - start, 1),
            "tail": out.strip().splitlines()[-3:] if proc.returncode else []}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        recipe = make_run_folder(folder)
        for i in range(args.runs):
            r = one_run(folder, recipe, i)
            runs.append(r)
            print(f"run {i + 1}: rc {r['rc']}, terminate {r['terminate']}, {r['seconds']} s", flush=True)
    aborts = [r for r in runs if r["rc"] != 0 and r["trained"]]
    summary = {"runs": len(runs), "aborts_after_training": len(aborts),
               "terminate_lines": sum(r["terminate"] for r in runs), "failed_before_the_end": sum(
                   r["rc"] != 0 and not r["trained"] for r in runs),
               "median_seconds": sorted(r["seconds"] for r in runs)[len(runs) // 2],
               "first_abort": aborts[0]["tail"] if aborts else None}
    print(json.dumps(summary))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
