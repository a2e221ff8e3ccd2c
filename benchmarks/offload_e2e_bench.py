"""The exact path end to end on CPU: the same full fine-tuning with optimizer.cpu_offload and
with the optimizer resident, through lisaft's own trainer step: benchmarks/offload_e2e_bench.py.

Two sessions of one recipe (a random Llama, bfloat16 weights, adamw_32bit, grad_accum_steps 8,
clipping at 1.0) differ only in optimizer.cpu_offload. On a CPU the training device and the host
are one memory, so whatever the offloaded run spends beyond the resident one is its own overhead:
the host accumulators (lisaft/optim/host_step.accumulate), the weights copied back, the step's
hand-off. The sessions advance in lockstep, one step of each in turn (the order swapped every
step), so load from other work falls on both alike; tokens/s comes from the median step time
after --warmup steps. The two runs must end with the same weights bit for bit (checked).

    python -m benchmarks.offload_e2e_bench          # writes benchmarks/results/offload_e2e/offload_e2e.json
    python -m benchmarks.offload_e2e_bench --quick  # seconds, nothing written
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import PadOnly, synthetic_examples, timed_on_this_machine
from lisaft.config.schema import recipe_from_dict
from lisaft.train import build_session, train_step

REPO = Path(__file__).resolve().parents[1]
FULL = {"hidden": 384, "layers": 6, "vocab": 4096, "seq": 256, "batch": 1, "accum": 8, "steps": 6, "warmup": 1}
QUICK = {"hidden": 64, "layers": 2, "vocab": 256, "seq": 32, "batch": 1, "accum": 2, "steps": 2, "warmup": 1}


def session(cfg: dict, folder: Path, offload: bool):
    from transformers import LlamaConfig

    h = cfg["hidden"]
    model_dir = folder / "model"
    LlamaConfig(vocab_size=cfg["vocab"], hidden_size=h, intermediate_size=h * 7 // 2, num_hidden_layers=cfg["layers"],
                num_attention_heads=max(1, h // 64), num_key_value_heads=max(1, h // 256),
                max_position_embeddings=cfg["seq"], tie_word_embeddings=False).save_pretrained(model_dir)
    name = "offload" if offload else "resident"
    recipe = recipe_from_dict({
        "model": {"config": str(model_dir), "tokenizer": "unused", "dtype": "bfloat16", "attention": "sdpa"},
        "data": {"train": "unused", "max_seq_len": cfg["seq"]},
        "optimizer": {"name": "adamw_32bit", "lr": 1e-4, "cpu_offload": offload},
        "training": {"seed": 0, "batch_size": cfg["batch"], "grad_accum_steps": cfg["accum"], "max_grad_norm": 1.0,
                     "max_steps": cfg["steps"], "output_dir": str(folder / name), "device": "cpu"},
    })
    rows = cfg["steps"] * cfg["batch"] * cfg["accum"]
    examples = synthetic_examples(rows, cfg["seq"], cfg["vocab"], seed=1)
    return build_session(recipe, folder / name, tokenizer=PadOnly(), train_examples=examples, eval_examples=None)


def measure(cfg: dict, folder: Path) -> dict:
    runs = {"resident": session(cfg, folder, False), "offload": session(cfg, folder, True)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens = {}
    for step in range(cfg["steps"]):
        for name in list(runs) if step % 2 == 0 else list(runs)[::-1]:
            s = runs[name]
            t = time.perf_counter()
            result = train_step(s, step, measure_norm=True)
            if name == "offload":
                s.optimizers.wait()  # the step in flight is the offloaded step's cost
            seconds[name].append(time.perf_counter() - t)
            tokens[name] = result.tokens
    same = all(torch.equal(a, b) for a, b in zip(runs["resident"].model.parameters(),
                                                  runs["offload"].model.parameters()))
    params = sum(p.numel() for p in runs["resident"].model.parameters())
    out: dict = {"params": params, "same_weights_bit_for_bit": same}
    for name, ts in seconds.items():
        steady = statistics.median(ts[cfg["warmup"]:])
        out[name] = {"median_step_s": round(steady, 3), "tokens_per_s": round(tokens[name] / steady, 1),
                     "step_s": [round(t, 3) for t in ts]}
    out["offload_over_resident"] = round(out["offload"]["tokens_per_s"] / out["resident"]["tokens_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "offload_e2e")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        result = timed_on_this_machine(cfg, lambda: measure(cfg, Path(tmp)))
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offload_e2e.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
