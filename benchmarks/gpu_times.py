"""How long each GPU-suite run should take on the lent H200, computed before it runs.

No lisaft figure on a GPU exists yet, so every expected time is computed from named parts, each
measured (on the lent machine by others, or by this project's benchmarks on the build CPU) or
assumed, and the plan (benchmarks/gpu_plan.py) fits its budgets to them:

    run   = START_S + steps x step + extra (DPO's reference pass; NF4's quantizing; numba's compile;
            GRPO's generations: a prefill and DECODE_STEP_S per token of max_completion_length each)
    step  = micro-batches x FLOPs / (BF16_RATE x TRAIN_SHARE)
            (a preference pair is two sequences in one micro-batch)
    cpu_offload's step: the estimator's step model (lisaft/memory/layer_major.py step_seconds) on
            the lent machine's parts (LENT), none of them overlapped (its serial bound): the GPU,
            the link's larger direction, the host memory's traffic and the CPU step. Its path is
            the run's own (config/compat.py offload_accumulation): `host` ships every
            micro-batch's gradient and adds it on the host; `device` (layer-major) ships each
            group's gradient once and every layer's saved input out and back, at the estimator's
            group on LENT_HOST_RAM, the recompute of each layer in its FLOPs as checkpointing's

Once the suite has run, its JSON holds each run's step time, share of the FLOP bound and wall
time: the assumptions below are then to be replaced by those figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

# Measured on the lent kind (the device notes, 2026-10-28): an 8192^3 bf16 product through
# PyTorch at 788 TFLOP/s on random data.
BF16_RATE = 788e12
# Assumed: the share of that bound a checkpointed 8B training step reaches (the suite measures
# it: share_of_flop_bound). 25% is below what checkpointed Llama training reports at this size.
TRAIN_SHARE = 0.25
# Assumed: 4-bit layers dequantize their weight on every use (bitsandbytes): matmul time x 1.5.
NF4_SLOWDOWN = 1.5
# Assumed: the host link, the 25 GB/s recipes/llama3.1-8b-full-24gb.yaml states for PCIe.
LINK_BYTES_PER_S = 25e9
# The lent machine's RAM (the device notes: 128 GiB), which sets the layer-major group.
LENT_HOST_RAM = 128 * 2**30
# A child's start, in parts: Python with torch, transformers and lisaft imported (6.6 s of CPU
# on the build machine, measured with /usr/bin/time), the CUDA context (2 s, assumed), an 8B
# model of random bf16 weights built on the GPU (5 s, assumed: init kernels over 16 GB), the
# estimate and the bf16 rate probe (2 s, assumed).
IMPORT_S = 6.6
START_S = IMPORT_S + 2 + 5 + 2
# Assumed: one new token of transformers' generate on an 8B model, eager (GRPO's sampling): a
# launch-bound decode of 32 layers of about 15 kernels each and the sampling loop's Python; the
# 16 GB of weights read at the H200's 4.8 TB/s would be 3.4 ms. Random weights never sample EOS,
# so every completion runs to max_completion_length.
DECODE_STEP_S = 0.03
# Assumed: numba compiling the host kernel on first use (cached on disk afterwards).
HOST_KERNEL_COMPILE_S = 10.0
# Assumed: quantizing 8B random weights to NF4 on the GPU, after building them.
NF4_QUANTIZE_S = 5.0
# Assumed: the lent machine's disk, for the random weights a quantized base is loaded from
# (model.quantize needs a pretrained folder): written at 1 GB/s, read back at 2 GB/s.
DISK_WRITE_BYTES_PER_S, DISK_READ_BYTES_PER_S = 1e9, 2e9


def recipe_values(recipe: Path, overrides: tuple[str, ...]) -> dict:
    """The recipe as a plain mapping with dotted overrides applied (the values YAML parses them
    to): what the time model reads, without pydantic, so `--plan` runs on a bare machine."""
    data = yaml.safe_load(recipe.read_text())
    for o in overrides:
        key, _, value = o.partition("=")
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return data


def model_shape(config: Path) -> dict:
    """Matmul weights per decoder layer and in the head, from a config.json."""
    c = json.loads(config.read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = h * c.get("num_key_value_heads", c["num_attention_heads"]) // c["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * inter
    total = c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * h  # embeddings and head
    return {"layers": c["num_hidden_layers"], "hidden": h, "layer": layer, "head": c["vocab_size"] * h,
            "params": total}


def flops_per_token(shape: dict, seq: int, kind: str, gamma: int = 0, recompute: bool = True) -> float:
    """Matmul FLOPs per token, counted as benchmarks/lisa_bench.py counts them: 2P forward, 2P
    input gradient, 2P weight gradient; attention 4·L·d forward, 8·L·d backward; checkpointing
    runs each layer's forward again. kind: full, lisa (γ layers and the head take weight
    gradients; all layers input gradients, the embeddings training) or lora (no weight gradient
    but the adapters', which are negligible)."""
    n, layer, head = shape["layers"], shape["layer"], shape["head"]
    attn = 4 * seq * shape["hidden"]
    again = (2 * layer + attn) * recompute
    if kind == "full":
        return n * (6 * layer + 3 * attn + again) + 6 * head
    if kind == "lisa":
        return n * (4 * layer + 3 * attn + again) + gamma * 2 * layer + 6 * head
    return n * (4 * layer + 3 * attn + again) + 4 * head


def lent_machine():
    """The lent machine as the estimator's step model takes it (lisaft/memory/layer_major.py
    Machine): BF16_RATE at TRAIN_SHARE, LINK_BYTES_PER_S, and the cpu_offload host parts measured
    on the build machine (2 threads; the lent machine has 16 cores: a bound from above): the fused
    8-bit host step (benchmarks/results/host_step/host_step.json), and the host memory's rate from
    the accumulation of a micro-batch's gradients (benchmarks/results/offload/offload.json, 218.1M
    parameters, adamw_8bit), taken as the three bf16 gradients an addition moves, as step_seconds
    counts it."""
    from lisaft.memory.layer_major import Machine

    host = json.loads((RESULTS / "host_step" / "host_step.json").read_text())
    offload = json.loads((RESULTS / "offload" / "offload.json").read_text())
    rows = [r for r in offload["results"] if r["optimizer"] == "adamw_8bit" and r["threads"] == 2]
    accumulate = max(rows, key=lambda r: r["params"])["seconds_per_1e9_params"]["accumulate"]
    step = host["moments"]["8bit"]["kernel"]["s_per_1e9_params"]
    return Machine("the lent GPU (assumed parts)", BF16_RATE * TRAIN_SHARE, LINK_BYTES_PER_S, 3 * 2 * 1e9 / accumulate,
                   step / 1e9)


def offload_step(recipe: Path, overrides: tuple[str, ...], params: int, tokens: int) -> dict:
    """cpu_offload's step on the lent machine, on the path the run resolves to, with its parts."""
    from lisaft.config.compat import offload_accumulation
    from lisaft.config.schema import load_recipe
    from lisaft.memory.command import settings_from_recipe
    from lisaft.memory.estimate import compute
    from lisaft.memory.layer_major import step_seconds

    rec = load_recipe(recipe, overrides)
    path, accum = offload_accumulation(rec), rec.training.grad_accum_steps
    saved, groups = 0, 0
    if path == "device":
        t = compute(settings_from_recipe(rec).with_(host_budget_bytes=LENT_HOST_RAM)).layer_major
        assert t is not None, "device resolves to the layer-major terms"
        saved, groups = t.saved_inputs, t.groups
    p = step_seconds(params, 2 * params, tokens, accum, lent_machine(), saved, groups,
                     rec.training.max_grad_norm is not None)
    return {"offload_accumulation": path, "groups": groups, **{f"offload_{k}": v for k, v in p.items()}}


def run_seconds(recipe: Path, overrides: tuple[str, ...], steps: int, config: Path) -> dict:
    """The expected wall time of one run of `steps` optimizer steps, with its parts."""
    r = recipe_values(recipe, overrides)
    model, lisa, lora, opt = r["model"], r.get("lisa", {}), r.get("lora", {}), r["optimizer"]
    t = r["training"]
    shape = model_shape(config)
    seq, micro = r["data"]["max_seq_len"], t.get("grad_accum_steps", 1) * t.get("batch_size", 1)
    pref = r.get("preference") or {}
    sequences = 2 if pref else 1  # a pair's chosen and rejected answers, one forward
    kind = "lora" if lora.get("enabled") else "lisa" if lisa.get("enabled") else "full"
    flops = flops_per_token(shape, seq, kind, lisa.get("active_layers", 2) or 2,
                            model.get("gradient_checkpointing", False))
    rate = BF16_RATE * TRAIN_SHARE / (NF4_SLOWDOWN if model.get("quantize") else 1.0)
    compute = sequences * flops * seq / rate
    parts = {"start_s": START_S, "compute_per_micro_batch_s": compute}
    per_step = micro * compute
    extra = 0.0
    if pref.get("loss") == "dpo":
        # The reference pass: one forward (2P a token, and attention) over every pair trained on.
        forward = shape["layers"] * (2 * shape["layer"] + 4 * seq * shape["hidden"]) + 2 * shape["head"]
        parts["reference_pass_s"] = extra = steps * micro * sequences * forward * seq / rate
    if r.get("grpo"):
        parts["generation_s"] = steps * _generation_seconds(r, shape, rate)
        extra += parts["generation_s"]
    if model.get("quantize"):
        weights = 2 * shape["params"]
        extra += NF4_QUANTIZE_S + weights / DISK_WRITE_BYTES_PER_S + weights / DISK_READ_BYTES_PER_S
    if opt.get("cpu_offload"):
        parts.update(offload_step(recipe, overrides, shape["params"], micro * sequences * seq))
        per_step = parts["offload_serial_s"]
        extra += HOST_KERNEL_COMPILE_S
    parts.update(step_s=per_step, steps=steps, extra_s=extra)
    return {"seconds": START_S + steps * per_step + extra, "parts": parts}


def _generation_seconds(r: dict, shape: dict, rate: float) -> float:
    """A GRPO step's generations: each a prefill of its prompts (a forward, 2P a token, at the
    training's rate) and one decode step per completion token."""
    g, t = r["grpo"], r["training"]
    accum, batch = t.get("grad_accum_steps", 1), t.get("batch_size", 1)
    spg = g.get("steps_per_generation") or accum
    completion = g.get("max_completion_length", 512)
    prompt = r["data"]["max_seq_len"] - completion
    generations = max(1, accum // spg)
    prefill = batch * spg * prompt * 2 * shape["params"] / rate
    return generations * (prefill + completion * DECODE_STEP_S)


def in_sequence(expected: list[dict]) -> list[float]:
    """The seconds of runs made one after another on one machine (run_seconds' results, in
    order): numba caches the host kernel on disk, so only the first cpu_offload run compiles it."""
    seconds, compiled = [], False
    for e in expected:
        offload = "offload_accumulation" in e["parts"]
        seconds.append(e["seconds"] - HOST_KERNEL_COMPILE_S * (compiled and offload))
        compiled |= offload
    return seconds
