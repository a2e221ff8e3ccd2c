"""The learning benchmark's second protocol: which method learns most within a memory budget?

    python -m benchmarks.learning_bench --protocol 2             # the designed protocol (hours)
    python -m benchmarks.learning_bench --protocol 2 --reduced   # what fits in about an hour here
    python -m benchmarks.learning_bench --protocol 2 --quick     # tiny: the tests run this
    python -m benchmarks.learning_bench --protocol 2 --apollo    # APOLLO against LISA and LoRA (2 hours)

Per depth (6, 12, 24 decoder layers at equal parameter count, narrower as deeper) a model is
pre-trained on task family A; then each arm fine-tunes it on each kind of task
(benchmarks/learning/tasks.py). The lr is picked per (depth, task, arm) by the mean validation
B token accuracy over the sweep seeds; an arm whose best lr is at an edge of the grid gets the
next lr beyond it (x or / 3, once), and the report says so. The other seeds then run at the
picked lr, and everything is reported on the test split. The work is run in stages, most
informative first; each finished run is appended to OUT/work/runs.jsonl, and OUT/learning2.json
and .md are rewritten after every stage, so an interrupted run keeps what it finished and
`--resume` runs only the rest.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

# Depths at equal decoder parameter count: 13 h^2 per layer (4 h^2 attention, 9 h^2 MLP at i = 3h).
DEPTHS = {6: dict(hidden=128, intermediate=384), 12: dict(hidden=88, intermediate=288),
          24: dict(hidden=64, intermediate=192)}


def lisa(gamma: int, sampling: str, **extra) -> dict:
    return {"kind": "lisaft", "lisa": {"active_layers": gamma, "state_policy": "discard", "sampling": sampling,
                                       **extra}}


ARMS = {
    "full": {"kind": "lisaft", "lisa": None},
    **{f"lisa_g{g}_{m}": lisa(g, m) for g in (1, 2, 3) for m in ("uniform", "cyclic")},
    # LoRA arms run through lisaft's product path (recipe section lora, docs/lora.md).
    "lora_r16": {"kind": "lisaft", "lisa": None, "lora": {"rank": 16}},
    # LoRA whose optimizer state is LISA γ=2's (discard): its rank is worked out per depth.
    "lora_eq_g2": {"kind": "lisaft", "lisa": None, "lora": {"rank": "equal_state_lisa_g2"}},
    # The same rank with DoRA's magnitudes (a little more state), and on a 4-bit NF4 base (QLoRA).
    "dora_eq_g2": {"kind": "lisaft", "lisa": None, "lora": {"rank": "equal_state_lisa_g2", "dora": True}},
    "qlora_eq_g2": {"kind": "lisaft", "lisa": None, "lora": {"rank": "equal_state_lisa_g2", "quantize": "nf4"}},
    "badam": {"kind": "badam"},
    "emb_head": {"kind": "emb_head"},
    # Deep-model questions: more intervals (K=5) or more layers per interval (γ=4, 6).
    **{f"lisa_g2_{m}_k5": lisa(2, m, interval_steps=5) for m in ("uniform", "cyclic")},
    **{f"lisa_g{g}_cyclic": lisa(g, "cyclic") for g in (4, 6)},
    # Every weight trains, AdamW's moments on a random projection (lisaft/optim/apollo.py): rank 1
    # (APOLLO-Mini), and APOLLO at the rank whose optimizer state is LISA γ=2's (worked out per depth).
    "apollo_mini": {"kind": "lisaft", "lisa": None, "optimizer": {"name": "apollo_mini"}},
    "apollo_eq_g2": {"kind": "lisaft", "lisa": None, "optimizer": {"name": "apollo", "rank": "equal_state_lisa_g2"}},
}
APOLLO_ARMS = ["apollo_mini", "apollo_eq_g2"]
DEPTH_ARMS = ["full", "lisa_g2_uniform", "lisa_g2_cyclic", "lora_r16", "lora_eq_g2", *APOLLO_ARMS]
LORA_VARIANTS = ["dora_eq_g2", "qlora_eq_g2"]
MAIN_ARMS = ["full", *(f"lisa_g{g}_{m}" for g in (1, 2, 3) for m in ("uniform", "cyclic")), "lora_r16",
             "lora_eq_g2", *LORA_VARIANTS, "badam", "emb_head", *APOLLO_ARMS]
APOLLO_COMPARED = [*APOLLO_ARMS, "lisa_g2_uniform", "lora_eq_g2"]
REDUCED_DEPTH_ARMS = ["full", "lisa_g2_uniform", "lisa_g2_cyclic", "lora_eq_g2"]
DEEP_EXTRAS = ["lisa_g2_uniform_k5", "lisa_g2_cyclic_k5", "lisa_g4_cyclic", "lisa_g6_cyclic"]

_BASE = dict(pretrain_batch_size=32, pretrain_lr=3e-3, pretrain_warmup_steps=50, new_train_rows=3000,
             eval_rows=200, batch_size=16, interval_steps=20, warmup_steps=20, eval_every=25, curve_examples=60,
             max_seq_len=64, pretrain_steps=1200, steps=200)
# A stage: (name, depth, task kinds, arms, lr grid, sweep seeds, rerun seeds, steps multiplier).
SETTINGS = {
    "full": dict(_BASE, stages=[
        ("depth 6", 6, ["new_skill", "new_format"], MAIN_ARMS, [3e-4, 1e-3, 3e-3, 1e-2], [0, 1], [2, 3, 4], 1),
        ("depth 24", 24, ["new_skill", "new_format"], DEPTH_ARMS + DEEP_EXTRAS + LORA_VARIANTS,
         [3e-4, 1e-3, 3e-3, 1e-2], [0, 1],
         [2, 3, 4], 1),
        ("depth 12", 12, ["new_skill", "new_format"], DEPTH_ARMS, [3e-4, 1e-3, 3e-3, 1e-2], [0, 1], [2, 3, 4], 1),
        ("depth 24, 3x steps", 24, ["new_skill"], DEPTH_ARMS, [1e-3, 3e-3], [0, 1], [2, 3, 4], 3),
    ], extend_edges=True),
    # What ran on the shared 2-core machine (docs/learning.md says what this cuts).
    "reduced": dict(_BASE, pretrain_steps=500, stages=[
        ("depth 6", 6, ["new_skill"], REDUCED_DEPTH_ARMS, [1e-3, 3e-3], [0], [1, 2], 1),
        ("depth 24", 24, ["new_skill"], REDUCED_DEPTH_ARMS, [3e-3], [0, 1], [], 1),
        ("depth 6, other arms", 6, ["new_skill"], [a for a in MAIN_ARMS if a not in REDUCED_DEPTH_ARMS], [3e-3],
         [0, 1], [], 1),
        ("depth 6, new format", 6, ["new_format"], REDUCED_DEPTH_ARMS, [3e-3], [0, 1], [], 1),
        ("depth 24, K=5", 24, ["new_skill"], ["lisa_g2_uniform_k5", "lisa_g2_cyclic_k5"], [3e-3], [0, 1], [], 1),
        # Every arm's best at depth 6 was the grid's top: one lr beyond it, on the sweep seed.
        ("depth 6, lr edge", 6, ["new_skill"], REDUCED_DEPTH_ARMS, [1e-2], [0], [], 1),
        ("depth 12", 12, ["new_skill"], REDUCED_DEPTH_ARMS, [3e-3], [0, 1], [], 1),
    ], extend_edges=False),
    # APOLLO's arms against LISA γ=2 and equal-memory LoRA at the reduced run's pre-training: every
    # arm on an lr grid (one lr beyond an edge), three seeds at the picked lr, both depths and task
    # kinds; then full fine-tuning as the ceiling and the DoRA and QLoRA arms (about two hours here).
    "apollo": dict(_BASE, pretrain_steps=500, stages=[
        ("depth 24", 24, ["new_skill"], APOLLO_COMPARED, [1e-3, 3e-3, 1e-2], [0], [1, 2], 1),
        ("depth 24, full", 24, ["new_skill"], ["full"], [3e-3], [0, 1, 2], [], 1),
        ("depth 6", 6, ["new_skill"], APOLLO_COMPARED, [1e-3, 3e-3, 1e-2], [0], [1, 2], 1),
        ("depth 6, full", 6, ["new_skill"], ["full"], [1e-3], [0, 1, 2], [], 1),
        ("depth 24, new format", 24, ["new_format"], APOLLO_COMPARED, [1e-3, 3e-3], [0], [1, 2], 1),
        ("depth 6, new format", 6, ["new_format"], APOLLO_COMPARED, [1e-3, 3e-3], [0], [1, 2], 1),
        ("depth 24, DoRA and QLoRA", 24, ["new_skill"], LORA_VARIANTS, [3e-3], [0, 1, 2], [], 1),
        ("depth 6, DoRA and QLoRA", 6, ["new_skill"], LORA_VARIANTS, [3e-3], [0, 1, 2], [], 1),
    ], extend_edges=True),
    # The LoRA arms through the product path in about ten minutes on the shared 2-core machine: one
    # depth, one task, one lr, one seed, a shorter pre-training (docs/learning.md says what it cuts).
    "lora-smoke": dict(_BASE, pretrain_steps=150, new_train_rows=1000, eval_rows=100, steps=60, eval_every=20,
                       curve_examples=20, stages=[
                           ("depth 6", 6, ["new_skill"], ["lisa_g2_uniform", "lora_eq_g2", *LORA_VARIANTS], [3e-3],
                            [0], [], 1),
                       ], extend_edges=False),
    # A smoke of every code path (the test asserts shapes and splits, not learning): half the
    # steps it once had cut its CPU from 36.7 s to 24.1 s.
    "quick": dict(_BASE, pretrain_steps=30, pretrain_warmup_steps=3, new_train_rows=400, eval_rows=24, steps=10,
                  interval_steps=3, warmup_steps=2, eval_every=5, curve_examples=24, stages=[
                      ("depth 4", 4, ["new_skill", "new_format"],
                       ["full", "lisa_g2_uniform", "lisa_g2_cyclic", "lora_eq_g2"], [3e-3], [0], [], 1),
                      ("depth 8", 8, ["new_skill"], ["full", "lisa_g2_cyclic"], [3e-3], [0], [], 1),
                  ], extend_edges=False),
}
QUICK_DEPTHS = {4: dict(hidden=64, intermediate=192), 8: dict(hidden=48, intermediate=144)}


def depth_settings(s: dict, depth: int) -> dict:
    dims = {**DEPTHS, **QUICK_DEPTHS}[depth]
    return {**{k: v for k, v in s.items() if k != "stages"}, "layers": depth, **dims}


def lisa_trainable_params(cfg: dict, gamma: int) -> int:
    """Trainable parameters of LISA at γ with embeddings and head (untied, llama shapes, MHA)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layer = 4 * h * h + 3 * h * i + 2 * h
    return gamma * layer + 2 * v * h + h


def lora_params_per_rank(cfg: dict) -> int:
    """LoRA parameters per unit of rank on every linear layer of every decoder layer."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    return cfg["num_hidden_layers"] * (4 * 2 * h + 3 * (h + i))


def apollo_rank_equal_state(cfg: dict) -> int:
    """APOLLO's rank whose state is LISA γ=2's (8 B per trainable parameter): 8 B per rank per
    channel of each decoder matrix (its larger side), plus the other tensors' adamw_8bit moments
    (embeddings and head 2 B per parameter, norms under 4096 elements 8 B)."""
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    rest = 2 * 2 * v * h + 8 * (2 * n + 1) * h
    per_rank = 8 * n * (4 * h + 3 * i)
    return max(1, round((8 * lisa_trainable_params(cfg, 2) - rest) / per_rank))


def arm_spec(arm: str, cfg: dict) -> dict:
    spec = dict(ARMS[arm])
    if "lora" in spec:
        spec["lora"] = dict(spec["lora"])
        if spec["lora"]["rank"] == "equal_state_lisa_g2":
            # Both keep two float32 moments per trainable parameter: equal parameters, equal bytes.
            spec["lora"]["rank"] = max(1, round(lisa_trainable_params(cfg, 2) / lora_params_per_rank(cfg)))
    if spec.get("optimizer", {}).get("rank") == "equal_state_lisa_g2":
        spec["optimizer"] = {**spec["optimizer"], "rank": apollo_rank_equal_state(cfg)}
        spec["rank"] = spec["optimizer"]["rank"]  # reported as the run's rank
    return spec


def run_job(job: dict) -> dict:
    """Train one arm at one lr and seed; validation and test scores at the end, a curve on the way."""
    import tempfile
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    from benchmarks.learning.arms import _make_arm
    from benchmarks.learning.measure import peak_rss_bytes, reset_peak_rss
    from benchmarks.learning.tasks import load_task_data

    torch.set_num_threads(job["threads"])
    hf_logging.disable_progress_bar()
    s = job["settings"]
    data = load_task_data(job["data_dir"], job["tokenizer"], s["max_seq_len"])
    reset_peak_rss()
    with tempfile.TemporaryDirectory(prefix="learning2-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arm = _make_arm(job, job["spec"], data, Path(tmp))
        curve, peaks, tokens, train_s = [], {}, 0, 0.0
        for step in range(s["steps"]):
            t0 = time.perf_counter()
            loss, n = arm.step(step)
            train_s += time.perf_counter() - t0
            tokens += n
            for k, v in arm.memory().items():
                peaks[k] = max(peaks.get(k, 0), v)
            if (step + 1) % s["eval_every"] == 0 or step + 1 == s["steps"]:
                curve.append({"step": step + 1, **split_scores(arm.model, data, s["curve_examples"], False)})
        final = split_scores(arm.model, data, None, True)
    return {"task": job["task"], "depth": s["layers"], "arm": job["arm"], "lr": job["lr"], "seed": job["seed"],
            "steps": s["steps"], "tokens": tokens, "train_s": train_s, "tokens_per_s": tokens / train_s,
            "peak_rss_bytes": peak_rss_bytes(), "lora_rank": job["spec"].get("lora", {}).get("rank"),
            "trainable_params_last": arm.trainable_params(), **{f"peak_{k}": v for k, v in peaks.items()},
            "train_loss_last": loss, "curve": curve, "final": final}


def split_scores(model, data, n: int | None, final: bool) -> dict:
    """val_*: the new task's validation split (picks the lr); test_*: its test split; old_*: A."""
    from benchmarks.learning.measure import exact_match, token_accuracy

    pad, eos = data.tokenizer.pad_token_id, data.tokenizer.eos_token_id
    splits = (("val", data.new_val), ("test", data.new_test), ("old", data.old_test)) if final else \
        (("val", data.new_val), ("old", data.old_test))
    out = {}
    for name, examples in splits:
        ex = examples[:n] if n else examples
        acc = token_accuracy(model, ex, pad)
        out[f"{name}_token_accuracy"], out[f"{name}_loss"] = acc["token_accuracy"], acc["loss"]
        if final and name != "val":
            out[f"{name}_exact_match"] = exact_match(model, ex, pad, eos)
    return out


def key(job: dict) -> str:
    return json.dumps([job["task"], job["arm"], job["lr"], job["seed"], job["settings"]], sort_keys=True)
