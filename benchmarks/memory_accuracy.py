"""How close is `lisaft estimate-memory` to what a training step really holds? (CPU)

Each configuration trains a randomly initialised Llama-shaped model for a few steps in a fresh
subprocess (so peak RSS belongs to that configuration alone) and compares the estimator with:
- weights, gradients, optimizer states: tensor bytes of the live tensors (target: within 1%);
- activations: bytes saved for backward, from saved-tensor hooks (target: within 10%);
- peak: the process's peak RSS (target: within 15%).

    python -m benchmarks.memory_accuracy                 # all configurations, ~5-10 min on 2 cores
    python -m benchmarks.memory_accuracy --quick         # one tiny configuration, seconds
    python -m benchmarks.memory_accuracy --out results.json

The JSON result (default benchmarks/results/memory_accuracy/memory_accuracy.json) holds every
configuration's estimated and measured figures and whether each target was met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

TARGETS = {"weights": 0.01, "gradients": 0.01, "optimizer_states": 0.01, "activations": 0.10, "peak": 0.15}

# name, model shape, training shape. Shapes run from a toy to ~200M parameters.
_SMALL = dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
              num_hidden_layers=4, vocab_size=32000)
_MID = dict(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
            num_hidden_layers=8, vocab_size=32000)
_LARGE = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
              num_hidden_layers=12, vocab_size=32000)
CONFIGS = [
    dict(name="tiny-adamw32-full", model=dict(hidden_size=64, intermediate_size=160, num_attention_heads=4,
         num_key_value_heads=2, num_hidden_layers=2, vocab_size=256), dtype="float32",
         optimizer="adamw_32bit", lisa=0, checkpointing=False, batch=2, seq=32),
    dict(name="small-adamw32-full", model=_SMALL, dtype="float32", optimizer="adamw_32bit", lisa=0,
         checkpointing=False, batch=4, seq=256),
    dict(name="mid-adamw8-lisa2-ckpt", model=_MID, dtype="float32", optimizer="adamw_8bit", lisa=2,
         checkpointing=True, batch=2, seq=512),
    dict(name="mid-paged32-lisa2", model=_MID, dtype="float32", optimizer="paged_adamw_32bit", lisa=2,
         checkpointing=False, batch=2, seq=256),
    dict(name="mid-paged8-full-ckpt", model=_MID, dtype="float32", optimizer="paged_adamw_8bit", lisa=0,
         checkpointing=True, batch=4, seq=256),
    # bf16 matmuls are slow on CPUs without bf16 units: a small shape keeps this one short.
    dict(name="small-bf16-adamw8-full", model=_SMALL, dtype="bfloat16", optimizer="adamw_8bit", lisa=0,
         checkpointing=False, batch=2, seq=128),
    dict(name="large-adamw32-lisa2-ckpt", model=_LARGE, dtype="float32", optimizer="adamw_32bit", lisa=2,
         checkpointing=True, batch=2, seq=256),
]
# Step 1 creates the optimizer state; step 2 is a steady-state step, measured.
STEPS = 2


def _make_optimizer(name: str, params, lr: float = 1e-4):
    """lisaft's own optimizer (one unit over the trainable set), so the state measured is
    what a lisaft run keeps."""
    from lisaft.config.schema import OptimizerSection
    from lisaft.optim.adamw import Rounding
    from lisaft.optim.build import build_unit_optimizer

    params = list(params)
    return build_unit_optimizer(params, OptimizerSection(name=name, lr=lr), params[0].device,
                                Rounding("stochastic", 0), 0, None)


def run_one(cfg: dict) -> dict:
    """Train `cfg` for a few steps in this process and measure; called in a fresh subprocess."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lisaft.config.optimizers import optimizer_kind
    from lisaft.memory.estimate import compute
    from lisaft.memory.settings import settings_for_config
    from lisaft.metrics.measure import (
        grad_bytes,
        optimizer_state_bytes,
        peak_rss_bytes,
        saved_activations,
        weight_bytes,
    )
    from lisaft.model.loss import token_loss_sum
    from lisaft.model.parts import DTYPES, model_parts

    torch.manual_seed(0)
    config = LlamaConfig(**cfg["model"], max_position_embeddings=4096, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg["dtype"]], attn_implementation="sdpa")
    if cfg["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    gamma = cfg["lisa"]
    if gamma:
        # LISA's active set for one interval: γ middle layers, embeddings and head train.
        parts = model_parts(model)
        n = len(parts.layers)
        active = set(range(n // 2 - gamma // 2, n // 2 - gamma // 2 + gamma))
        for i, layer in enumerate(parts.layers):
            layer.requires_grad_(i in active)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = _make_optimizer(cfg["optimizer"], trainable)
    ids = torch.randint(0, config.vocab_size, (cfg["batch"], cfg["seq"]))
    # lisaft's own loss, which the estimator models (chunked above 2^24 logits), not the model's.
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}

    measured: dict = {}
    t0 = time.perf_counter()
    for step in range(STEPS):
        if step == STEPS - 1:
            with saved_activations(model) as meter:
                loss = token_loss_sum(model, batch) / ids.numel()
            measured["activations"] = meter.bytes
        else:
            loss = token_loss_sum(model, batch) / ids.numel()
        loss.backward()
        if step == STEPS - 1:
            measured["gradients"] = grad_bytes(model)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    measured["weights"] = weight_bytes(model)
    # The two 8-bit code books are shared by every unit, outside any optimizer's state.
    code_books = 2 * 256 * 4 if optimizer_kind(cfg["optimizer"]).eight_bit else 0
    measured["optimizer_states"] = optimizer_state_bytes(opt) + code_books
    measured["peak"] = peak_rss_bytes()
    seconds = time.perf_counter() - t0

    est = compute(settings_for_config(config, {
        "model.dtype": cfg["dtype"], "model.attention": "sdpa", "model.gradient_checkpointing": cfg["checkpointing"],
        "optimizer.name": cfg["optimizer"], "lisa.enabled": bool(gamma), "lisa.active_layers": gamma or 2,
        "training.batch_size": cfg["batch"], "data.max_seq_len": cfg["seq"], "training.max_grad_norm": 1.0,
        # This loop keeps the embedding's gradient dense; the sparse term is tested in
        # tests/unit/test_memory_estimate.py and tests/integration/test_precision.py.
        "model.sparse_embedding_grad": False,
    }, cfg["name"], device="cpu", budget_bytes=1 << 50, full_rows=True))  # every row full: no padding mask
    estimated = {
        "weights": est.weights_bytes, "gradients": est.grad_bytes,
        "optimizer_states": est.optimizer_state_bytes, "activations": est.saved_activation_bytes,
        "peak": est.total_bytes,
    }
    rows = {}
    for key, tol in TARGETS.items():
        e, m = estimated[key], measured[key]
        err = (e - m) / m if m else 0.0
        rows[key] = {"estimated": e, "measured": m, "error": round(err, 4), "target": tol,
                     "met": abs(err) <= tol}
    return {
        "name": cfg["name"], "params": est.total_params, "trainable_params": est.trainable_params,
        "settings": {k: v for k, v in cfg.items() if k != "name"}, "peak_phase": est.peak_phase,
        "components": est.components, "train_seconds": round(seconds, 2), "figures": rows,
    }


def _run_in_subprocess(cfg: dict) -> dict:
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory_accuracy", "--run-one", json.dumps(cfg)],
                          cwd=root, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"configuration {cfg['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Estimated vs measured (error = estimated / measured - 1)")
    t.add_column("configuration")
    t.add_column("params", justify="right")
    for key in TARGETS:
        t.add_column(f"{key} (±{TARGETS[key]:.0%})", justify="right")
    for r in results:
        cells = []
        for key in TARGETS:
            f = r["figures"][key]
            colour = "green" if f["met"] else "red"
            cells.append(f"[{colour}]{f['error']:+.1%}[/]")
        t.add_row(r["name"], f"{r['params'] / 1e6:.1f}M", *cells)
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny configuration (for tests)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "memory_accuracy" / "memory_accuracy.json")
    parser.add_argument("--only", help="run the configurations whose name contains this")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        print(json.dumps(run_one(json.loads(args.run_one))))
        return 0
    configs = CONFIGS[:1] if args.quick else [c for c in CONFIGS if not args.only or args.only in c["name"]]
    started = time.time()
    results = []
    for cfg in configs:
        results.append(_run_in_subprocess(cfg))
        _write(args, results, started)
        print(f"{cfg['name']}: done at {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    out = _write(args, results, started)
    _print_table(results)
    print(f"wrote {args.out} in {out['seconds']} s")
    return 0


def _write(args, results: list[dict], started: float) -> dict:
    """Written after every configuration, so an interrupted run keeps what it measured."""
    from importlib.metadata import version

    out = {
        "benchmark": "memory_accuracy", "device": "cpu", "quick": args.quick,
        "command": "python -m benchmarks.memory_accuracy" + (" --quick" if args.quick else ""),
        "torch": version("torch"), "transformers": version("transformers"),
        "bitsandbytes": version("bitsandbytes"), "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "steps": STEPS,
        "targets": TARGETS, "seconds": round(time.time() - started, 1), "results": results,
        "all_met": all(f["met"] for r in results for f in r["figures"].values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(main())
