"""How often a finished 2-rank gloo run aborts at exit ("terminate called without an active
exception", SIGABRT), with and without lisaft's fix (lisaft/distributed/dist.py _WORLD_DEFAULTS).

The cause: torch modules whose functions default to `group=group.WORLD`, imported after the
process group exists (transformers imports them lazily), hold the group, so destroy_process_group
cannot free it; its gloo threads live on into interpreter exit, where the group is freed late and
a thread sometimes aborts the process. lisaft imports those modules before it joins the group.
The arms alternate, run by run, so both see the same load:

  before   the fix undone in the ranks (the modules imported after the group exists, as before)
  after    lisaft as it is

Kinds of run, each launched with torchrun on two CPU ranks:

  group    the smallest: lisaft joins the group (dist.init_from_env), imports torch.distributed.nn
           as transformers does when it loads a model config, one barrier and one all-reduce,
           and leaves (dist.shutdown): seconds
  lisaft   the tiniest data-parallel training, `lisaft train` (a 4-layer Llama of width 32,
           2 optimizer steps, its export): tens of seconds on a loaded 2-core machine

    nice -n 10 python -m benchmarks.exit_abort --kind group --runs 50 --out benchmarks/results/exit_abort.json
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

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "recipes" / "quickstart" / "tokenizer"
TERMINATE = "terminate called without an active exception"


def make_run_folder(folder: Path) -> Path:
    """The model config, data and recipe of the tests' tiny run; returns the recipe."""
    import yaml
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


def rank_main(kind: str, undo_fix: bool, args: list[str]) -> int:
    """One rank, under torchrun."""
    from lisaft.env import configure_process

    configure_process()
    from lisaft.distributed import dist

    if undo_fix:
        dist._WORLD_DEFAULTS = ()  # noqa: SLF001 - the arm without the fix
    if kind == "lisaft":
        from lisaft import cli

        sys.argv = ["lisaft", *args]
        return cli.main()
    import importlib

    import torch

    dist.init_from_env()
    importlib.import_module("torch.distributed.nn")  # what transformers imports loading a config
    dist.barrier()
    dist.all_reduce_sum(torch.ones(8))
    dist.shutdown()
    return 0


def one_run(folder: Path, kind: str, arm: str, i: int) -> dict:
    rank = [sys.executable, "-m", "benchmarks.exit_abort", "--rank", kind] + (["--undo-fix"] if arm == "before" else [])
    if kind == "lisaft":
        rank += ["--", "train", "recipe.yaml", "--set", f"training.output_dir=run-{arm}-{i}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
           *rank]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    finished = kind == "group" or (folder / f"run-{arm}-{i}" / "final").is_dir()
    return {"rc": proc.returncode, "terminate": TERMINATE in out, "finished": finished,
            "seconds": round(time.perf_counter() - start, 1),
            "tail": out.strip().splitlines()[-4:] if proc.returncode else []}


def summary(runs: list[dict]) -> dict:
    aborts = [r for r in runs if r["rc"] != 0 and r["finished"]]
    return {"runs": len(runs), "aborted_after_finishing": len(aborts),
            "terminate_lines": sum(r["terminate"] for r in runs),
            "failed_before_finishing": sum(r["rc"] != 0 and not r["finished"] for r in runs),
            "median_seconds": sorted(r["seconds"] for r in runs)[len(runs) // 2] if runs else None,
            "first_abort": aborts[0]["tail"] if aborts else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["group", "lisaft"], default="group")
    ap.add_argument("--runs", type=int, default=50, help="per arm")
    ap.add_argument("--arms", default="before,after")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rank", choices=["group", "lisaft"], help=argparse.SUPPRESS)
    ap.add_argument("--undo-fix", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        return rank_main(args.rank, args.undo_fix, args.rest)
    arms = args.arms.split(",")
    runs: dict[str, list] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_run_folder(folder)
        for i in range(args.runs):
            for arm in arms:
                r = one_run(folder, args.kind, arm, i)
                runs[arm].append(r)
                print(f"{arm} {i + 1}: rc {r['rc']}, terminate {r['terminate']}, {r['seconds']} s", flush=True)
    result = {"kind": args.kind, "command": " ".join(["python -m benchmarks.exit_abort", *(argv or sys.argv[1:])]),
              "arms": {arm: summary(rs) for arm, rs in runs.items()}}
    print(json.dumps(result["arms"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
