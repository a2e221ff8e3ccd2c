"""The exact path end to end on CPU: the same full fine-tuning resident, and with
optimizer.cpu_offload summing the micro-batches layer-major (`device`) and micro-batch-major
(`host`), through lisaft's own trainer step: benchmarks/offload_e2e_bench.py.

Three sessions of one recipe (a random Llama, bfloat16 weights, gradient checkpointing as the 8B
recipe has it, adamw_32bit, clipping at 1.0) differ only in optimizer.cpu_offload and
optimizer.offload_accumulation, at grad_accum_steps 8 and 32 (--quick: 4). On a CPU the training
device and the host are one memory, so whatever an offloaded run spends beyond the resident one
is its own overhead: the copies (counted: the train record's offload_d2h_bytes,
offload_h2d_bytes, host_grad_additions), the host additions, the layer-major recompute's
bookkeeping. The sessions advance in lockstep, one step of each in turn (the order rotated every
step), so load from other work falls on all alike; tokens/s comes from the median step time
after the warm-up steps. With checkpointing every arm computes each layer's forward twice (the
layer-major backward's first forward keeps no graph, its recompute does), so the comparison is
of the paths' own costs. All three must end with the same weights bit for bit (checked: `device`
in one group sums in the resident run's order).

    python -m benchmarks.offload_e2e_bench           # writes benchmarks/results/offload_e2e/paths.json
    python -m benchmarks.offload_e2e_bench --quick   # seconds, nothing written
    python -m benchmarks.offload_e2e_bench --quick --device cuda  # the same three arms on a GPU
        # (pinned copies, the side streams): each arm's largest weight difference from the resident
        # run is reported beside the bit-for-bit check, since CUDA's backward kernels may sum in
        # another order from run to run
    python -m benchmarks.offload_e2e_bench --from-bandwidth  # no timing: the 8B recipe's step on
        # an RTX 4090, PCIe 4 and DDR5 for both paths, worked out by the estimator
        # (lisaft/memory/layer_major.py), written to benchmarks/results/offload_e2e/from_bandwidth.json
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
OUT = REPO / "benchmarks" / "results" / "offload_e2e"
FULL = {"hidden": 384, "layers": 6, "vocab": 4096, "seq": 256, "batch": 1, "accum": [8, 32], "steps": 5, "warmup": 1}
QUICK = {"hidden": 64, "layers": 2, "vocab": 256, "seq": 32, "batch": 1, "accum": [4], "steps": 2, "warmup": 1}
ARMS = {"resident": {"cpu_offload": False}, "device": {"cpu_offload": True, "offload_accumulation": "device"},
        "host": {"cpu_offload": True, "offload_accumulation": "host"}}
FULL_RECIPE = REPO / "recipes" / "llama3.1-8b-full-24gb.yaml"


def session(cfg: dict, accum: int, folder: Path, arm: str, device: str = "cpu"):
    from transformers import LlamaConfig

    h = cfg["hidden"]
    model_dir = folder / "model"
    LlamaConfig(vocab_size=cfg["vocab"], hidden_size=h, intermediate_size=h * 7 // 2, num_hidden_layers=cfg["layers"],
                num_attention_heads=max(1, h // 64), num_key_value_heads=max(1, h // 256),
                max_position_embeddings=cfg["seq"], tie_word_embeddings=False).save_pretrained(model_dir)
    recipe = recipe_from_dict({
        "model": {"config": str(model_dir), "tokenizer": "unused", "dtype": "bfloat16", "attention": "sdpa",
                  "gradient_checkpointing": True},
        "data": {"train": "unused", "max_seq_len": cfg["seq"]},
        "optimizer": {"name": "adamw_32bit", "lr": 1e-4, **ARMS[arm]},
        "training": {"seed": 0, "batch_size": cfg["batch"], "grad_accum_steps": accum, "max_grad_norm": 1.0,
                     "max_steps": cfg["steps"], "output_dir": str(folder / arm), "device": device},
    })
    rows = cfg["steps"] * cfg["batch"] * accum
    examples = synthetic_examples(rows, cfg["seq"], cfg["vocab"], seed=1)
    return build_session(recipe, folder / arm, tokenizer=PadOnly(), train_examples=examples, eval_examples=None)


def measure(cfg: dict, accum: int, folder: Path, device: str = "cpu") -> dict:
    runs = {arm: session(cfg, accum, folder / f"accum-{accum}", arm, device) for arm in ARMS}
    seconds: dict[str, list[float]] = {arm: [] for arm in runs}
    last: dict = {}
    for step in range(cfg["steps"]):
        order = list(runs)[step % len(runs):] + list(runs)[:step % len(runs)]
        for arm in order:
            s = runs[arm]
            t = time.perf_counter()
            result = train_step(s, step, measure_norm=True)
            s.optimizers.wait()  # an offloaded step in flight is that step's cost
            if device == "cuda":
                torch.cuda.synchronize()
            seconds[arm].append(time.perf_counter() - t)
            last[arm] = result
    weights = {arm: list(s.model.parameters()) for arm, s in runs.items()}
    out: dict = {"params": sum(p.numel() for p in weights["resident"]),
                 "same_weights_bit_for_bit": {arm: all(torch.equal(a, b) for a, b in zip(weights["resident"], w))
                                              for arm, w in weights.items() if arm != "resident"},
                 "max_abs_diff": {arm: max(float((a.float() - b.float()).abs().max())
                                           for a, b in zip(weights["resident"], w))
                                  for arm, w in weights.items() if arm != "resident"}}
    median = {arm: statistics.median(ts[cfg["warmup"]:]) for arm, ts in seconds.items()}
    for arm, ts in seconds.items():
        out[arm] = {"median_step_s": round(median[arm], 3), "tokens_per_s": round(last[arm].tokens / median[arm], 1),
                    "over_resident": round(median["resident"] / median[arm], 3),
                    "step_s": [round(t, 3) for t in ts], **(last[arm].offload or {})}
    return out


def from_bandwidth() -> dict:
    """The shipped 8B full recipe's step for both paths at 64 GiB of RAM (the estimator's group),
    with clipping as the recipe has it and without (where each unit steps as it is shipped)."""
    from lisaft.config.schema import load_recipe
    from lisaft.memory.command import settings_from_recipe
    from lisaft.memory.estimate import compute
    from lisaft.memory.layer_major import RTX_4090_PCIE4_DDR5, step_seconds
    from lisaft.memory.settings import GiB

    recipe = load_recipe(FULL_RECIPE)
    est = compute(settings_from_recipe(recipe).with_(host_budget_bytes=64 * GiB))
    t = est.layer_major
    assert t is not None
    accum, n = recipe.training.grad_accum_steps, est.trainable_params
    tokens = recipe.training.batch_size * recipe.data.max_seq_len * accum
    paths = {}
    for clipping in (True, False):
        for name, groups in (("device", t.groups), ("host", 0)):
            p = step_seconds(n, 2 * n, tokens, accum, RTX_4090_PCIE4_DDR5, t.saved_inputs, groups, clipping)
            paths[f"{name}{'' if clipping else '_no_clipping'}"] = {k: round(v, 3) for k, v in p.items()}
    m = RTX_4090_PCIE4_DDR5
    return {"recipe": FULL_RECIPE.relative_to(REPO).as_posix(), "host_ram_gib": 64, "machine": m.name,
            "matmul_flops_per_s": m.matmul_flops_per_s, "link_bytes_per_s": m.link_bytes_per_s,
            "host_bytes_per_s": m.host_bytes_per_s, "cpu_step_s_per_param": m.cpu_step_s_per_param,
            "params": n, "tokens_per_step": tokens, "group": t.group, "groups": t.groups,
            "gpu_estimate_gib": round(est.total_bytes / GiB, 2), "host_estimate_gib": round(est.host_bytes / GiB, 2),
            "paths": paths}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--from-bandwidth", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.from_bandwidth:
        result, name = from_bandwidth(), "from_bandwidth.json"
    else:
        cfg = QUICK if args.quick else FULL
        with tempfile.TemporaryDirectory() as tmp:
            result = timed_on_this_machine(
                cfg, lambda: {f"accum_{a}": measure(cfg, a, Path(tmp), args.device) for a in cfg["accum"]})
        name = None if args.quick else "paths.json" if args.device == "cpu" else "paths_cuda.json"
    if name is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
