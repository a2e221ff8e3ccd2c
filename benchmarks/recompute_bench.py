"""LISA's step with gradient checkpointing, with and without the recompute of frozen layers:
benchmarks/recompute_bench.py.

One randomly initialised Llama (float32, on the CPU) with lisaft's model settings
(lisaft/model/load.py apply_model_settings: non-reentrant checkpointing, then `frozen_inputs`),
trained the LISA way with frozen embeddings (lisa.train_embeddings false): γ sampled layers and
the head train, everything else is frozen. Each of LayerSampler's first --intervals active sets is
timed twice, forward and backward of one micro-batch:

    after    lisaft now: the embeddings' output does not require grad, so backward stops at the
             lowest active layer and nothing below it is recomputed
    before   the same model with transformers' enable_input_require_grads hook put back (what
             checkpointing enabled before frozen_inputs): every layer below is recomputed and
             back-propagated

The two alternate on one model (the hook added and removed), best of --reps each, so load from
other work falls on both alike. Each set's recomputed layers are counted as well.

    python -m benchmarks.recompute_bench            # writes benchmarks/results/recompute/recompute.json
    python -m benchmarks.recompute_bench --quick    # a few seconds, nothing written
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.common import timed_on_this_machine
from lisaft.config.schema import ModelSection
from lisaft.lisa import LayerSampler
from lisaft.model.load import apply_model_settings
from lisaft.model.parts import model_parts

REPO = Path(__file__).resolve().parents[1]
FULL = {"layers": 8, "hidden": 512, "seq": 512, "batch": 2, "gamma": 2, "intervals": 8, "reps": 3}
QUICK = {"layers": 4, "hidden": 64, "seq": 32, "batch": 2, "gamma": 1, "intervals": 2, "reps": 1}


def build(layers: int, hidden: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=4096,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    apply_model_settings(model, ModelSection(name_or_path="unused", gradient_checkpointing=True), torch.device("cpu"))
    return model


def train_only(model: torch.nn.Module, active: list[int]) -> None:
    """LISA with frozen embeddings: the active layers, the final norm and the head train."""
    parts = model_parts(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for i in active:
        parts.layers[i].requires_grad_(True)
    for p in parts.head:
        p.requires_grad_(True)


def step(model: torch.nn.Module, x: torch.Tensor) -> float:
    t = time.perf_counter()
    model(input_ids=x, labels=x).loss.backward()
    seconds = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    return seconds


def measure(cfg: dict) -> dict:
    model = build(cfg["layers"], cfg["hidden"])
    layers = model_parts(model).layers
    calls: Counter = Counter()
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.update([i]))
    x = torch.randint(3, 2048, (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(1))
    sampler = LayerSampler(cfg["layers"], cfg["gamma"], seed=0)
    rows = []
    for interval in range(cfg["intervals"]):
        active = sampler.active_set(interval)
        train_only(model, active)
        times: dict[str, list[float]] = {"before": [], "after": []}
        recomputed = {}
        for rep in range(cfg["reps"] + 1):  # the first of each is a warm-up
            for mode in ("before", "after") if rep % 2 == 0 else ("after", "before"):
                if mode == "before":
                    model.enable_input_require_grads()
                calls.clear()
                seconds = step(model, x)
                recomputed[mode] = sum(n - 1 for n in calls.values())
                model.disable_input_require_grads()
                if rep:
                    times[mode].append(seconds)
        rows.append({"active_layers": active, "before_s": round(min(times["before"]), 4),
                     "after_s": round(min(times["after"]), 4), "recomputed_before": recomputed["before"],
                     "recomputed_after": recomputed["after"]})
    before = sum(r["before_s"] for r in rows) / len(rows)
    after = sum(r["after_s"] for r in rows) / len(rows)
    return {"mean_step_s_before": round(before, 4), "mean_step_s_after": round(after, 4),
            "speedup": round(before / after, 3), "sets": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "recompute")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    result = timed_on_this_machine(cfg, lambda: measure(cfg))
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "recompute.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "sets"}, indent=1))
    return result


if __name__ == "__main__":
    main()
