"""How much of the CPU step the training loop still waits for: benchmarks/hidden_step_bench.py.

optimizer.cpu_offload (lisaft/optim/cpu_offload.py) on a small Llama in bfloat16 (one unit per
decoder layer, embeddings and head), the loop's order of calls (forward, backward, clip_and_step;
the next forward waits, module by module, for the units it reads). Two modes:

    after      every unit steps after backward (what training.max_grad_norm needs)
    as_ready   each unit steps as soon as its gradients are in (max_grad_norm null, exact)

Per mode: seconds per training step, and the tail: from the end of the last backward until every
unit's step is done (`wait()`), the part of the host step not covered by backward. Without a GPU
the "device" is the same CPU, so backward and the host step share its cores: the figures show
the ordering, not a GPU's overlap (docs/memory.md says what a GPU would see).

    python -m benchmarks.hidden_step_bench --json                        # ~1 minute on 2 cores
    python -m benchmarks.hidden_step_bench --layers 2 --steps 2 --hidden 128   # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lisaft.config.schema import OptimizerSection
from lisaft.model.parts import model_parts
from lisaft.model.units import model_units
from lisaft.optim import host_step
from lisaft.optim.cpu_offload import OffloadedOptimizers


def build(hidden: int, layers: int, name: str, folder: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 7 // 2, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    parts = model_parts(model)
    units = model_units(parts)
    opts = OffloadedOptimizers(units, OptimizerSection(name=name, lr=1e-5, cpu_offload=True), torch.device("cpu"),
                               folder, seed=0)
    opts.wait_in_forward(model, parts.layers)
    return model, units, opts


def one_step(model, units, opts, x: torch.Tensor, s: int) -> tuple[float, float]:
    """The loop's calls for one step; (the whole step, its tail after backward) in seconds."""
    t0 = time.perf_counter()
    opts.set_lr(1e-5, s)
    opts.arm(units, measure_norm=False)
    model(input_ids=x, labels=x).loss.backward()
    t1 = time.perf_counter()
    opts.clip_and_step(units, None, measure_norm=False)
    opts.wait()  # the whole step done: the next forward could not go further than this
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def run_modes(args, folder: Path) -> tuple[int, dict]:
    """Both modes side by side, step by step alternating, so that both see the same load."""
    runs = {}
    for mode in ("after", "as_ready"):
        model, units, opts = build(args.hidden, args.layers, args.optimizer, folder / mode)
        opts.step_as_ready = mode == "as_ready"
        runs[mode] = (model, units, opts, [])
    gen = torch.Generator().manual_seed(1)
    for s in range(args.steps + 1):  # the first step creates the moments: not timed
        x = torch.randint(0, 8192, (1, args.seq), generator=gen)
        for model, units, opts, times in runs.values():
            t = one_step(model, units, opts, x, s)
            if s:
                times.append(t)
    params = sum(p.numel() for p in runs["after"][0].parameters())
    return params, {mode: {"s_per_step": round(statistics.median(t[0] for t in r[3]), 3),
                           "tail_s": round(statistics.median(t[1] for t in r[3]), 3)} for mode, r in runs.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--optimizer", default="adamw_8bit", choices=["adamw_8bit", "adamw_32bit"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, help="write hidden_step_<optimizer>.json into this folder")
    args = ap.parse_args(argv)
    load = [round(os.getloadavg()[0], 2)]
    with tempfile.TemporaryDirectory() as tmp:
        params, modes = run_modes(args, Path(tmp))
    load.append(round(os.getloadavg()[0], 2))
    result = {"params": params, "hidden": args.hidden, "layers": args.layers, "seq": args.seq,
              "optimizer": args.optimizer, "kernel": host_step.available(), "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "load_avg_1min": load, "modes": modes}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"hidden_step_{args.optimizer}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
