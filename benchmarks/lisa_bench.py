"""LISA side by side on CPU: lisaft against the Hugging Face Trainer, LMFlow-style LISA as the
reference. benchmarks/lisa_bench.py.

One run trains the same randomly initialised Llama (float32, same seed, so the same initial
weights) on the same synthetic token rows, in the same order, for the same number of steps,
eight ways:

  lisaft_full               full fine-tuning, lisaft trainer, adamw_32bit (torch fused AdamW)
  hf_full                   full fine-tuning, transformers Trainer, adamw_torch_fused
  hf_lisa_lmflow            LISA the way LMFlow ships it: the Trainer plus a callback that every
                            K steps samples γ layers with the global NumPy RNG and only toggles
                            requires_grad; the optimizer was built over every parameter, so the
                            moments of every layer ever sampled stay resident (reference,
                            written here from that description)
  lisaft_lisa_<policy>      lisaft LISA γ=2 with lisa.state_policy discard, offload_cpu,
                            offload_disk and keep
  lisaft_lisa_discard_frozen_emb
                            the same with lisa.train_embeddings false: backward stops at the
                            lowest sampled layer (not the paper's default; shows what that saves)
  lisaft_lisa_discard_compiled
                            lisaft LISA discard with training.compile: true (each decoder layer
                            compiled; off by default; not in --quick unless named with --only)

The runs advance in lockstep, one step of each in turn (the order rotated every step), so load
from other work on a shared machine falls on all of them alike.

All use the same learning rate (constant, no warmup), no weight decay, gradient clipping at 1.0,
batch of B rows of exactly L tokens (no padding), no eval, no checkpoints, no logging. For each
run it records every step's wall time (and the process CPU time, to show contention from other
work on the machine), the optimizer state held for the training device after every interval of K
steps (lisaft: `UnitOptimizers.state_bytes()`; Trainer: the bytes of the tensors in
`trainer.optimizer.state`), what lisaft holds off the device, and for lisaft LISA the time of each
switch (`activate_for_step`) as a fraction of its interval's time.

tokens/s is steady state: the first --warmup steps are left out and the median step time is
used (the mean over the same steps is reported too).

Lockstep keeps the comparison fair under load but times only the step inside one process. With
--processes R (default 2; 0 with --quick) each of PROCESS_RUNS is also run alone in a fresh
process of N and of 2N steps, R times each, and its per-step time is
(min wall of the 2N-step runs - min wall of the N-step runs) / N: start-up (imports, model build,
the Trainer's set-up) cancels, and what remains is what a user pays per step, including any
per-step cost outside the timed region of the lockstep runs.

Each contender is also reported as a share of this machine's FLOP bound: tokens/s x FLOPs per
token / the measured float32 matmul rate (see flops_per_token for the counts: 6 x matmul
parameters for full fine-tuning, less for LISA, where frozen layers compute only input gradients).

    python -m benchmarks.lisa_bench              # default shape, about 12 minutes on 2 cores
    python -m benchmarks.lisa_bench --quick      # tiny shape, seconds (the tests run this)

Needs torch, transformers, pydantic, pyyaml, numpy, and `accelerate` for the Trainer runs
(without it --quick skips them with a note; the full run fails).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import PadOnly, hf_in_order, lmflow_style_switch, synthetic_rows

REPO = Path(__file__).resolve().parents[1]

# Llama shapes. The default is CPU-sized (about 34 M parameters, decoder layers 75% of them, as
# in real models where layers dominate); quick keeps the code path and shrinks everything.
SHAPES = {
    "default": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=8, vocab_size=8192),
    "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512),
    # The shape of issue 15 (its targets are stated there): 8 layers x 384, seq 256, K=5.
    "issue15": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                    num_key_value_heads=6, vocab_size=8192),
}
# steps, K, warm-up steps excluded from tokens/s, batch, sequence length
SETTINGS = {
    "default": dict(steps=44, interval=4, warmup=3, batch_size=4, seq_len=128),
    "quick": dict(steps=12, interval=2, warmup=2, batch_size=2, seq_len=32),
    "issue15": dict(steps=20, interval=5, warmup=2, batch_size=4, seq_len=256),
}
GAMMA = 2
LR = 1e-4
MAX_GRAD_NORM = 1.0
SEED = 0
POLICIES = ("discard", "offload_cpu", "offload_disk", "keep")
PROCESS_RUNS = ("hf_full", "lisaft_full", "hf_lisa_lmflow", "lisaft_lisa_discard", "lisaft_lisa_discard_compiled")
RUN_ORDER = ("hf_full", "lisaft_full", "hf_lisa_lmflow") + tuple(f"lisaft_lisa_{p}" for p in POLICIES) \
    + ("lisaft_lisa_discard_frozen_emb", "lisaft_lisa_discard_compiled")


def llama_config(shape: dict, seq_len: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": seq_len,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            **shape}


def tensor_bytes(state: dict) -> int:
    """Bytes of the moments in a torch optimizer's per-parameter state. Its float32 step tensors
    are left out: lisaft keeps the step count as a Python int, so the two count the same thing."""
    import torch

    return sum(v.numel() * v.element_size() for st in state.values() for k, v in st.items()
               if torch.is_tensor(v) and k != "step")


def steady(times: list[float], warmup: int) -> list[float]:
    return times[warmup:] if len(times) > warmup else times


def summarise(run: dict, warmup: int) -> dict:
    """tokens/s from the median (and mean) steady-state step time; CPU use from process time."""
    wall = steady(run["step_wall_s"], warmup)
    cpu = steady(run["step_cpu_s"], warmup)
    tokens = run["tokens_per_step"]
    med, mean = statistics.median(wall), statistics.fmean(wall)
    run["step_time_median_s"] = med
    run["tokens_per_s"] = tokens / med
    run["tokens_per_s_mean"] = tokens / mean
    # Near 1.0: the run had both cores to itself; lower: something else was using them.
    run["cpu_utilisation"] = sum(cpu) / (sum(wall) * run["threads"])
    return run


# ---------------------------------------------------------------------------------------------
# lisaft


class LisaftRunner:
    """A lisaft session stepped by the benchmark's own loop, as `lisaft train` steps it."""

    def __init__(self, name: str, policy: str | None, cfg_path: Path, rows: list, s: dict, workdir: Path,
                 train_embeddings: bool = True, compiled: bool = False):
        import torch

        from lisaft.config.schema import recipe_from_dict
        from lisaft.train import build_session

        run_dir = workdir / name
        recipe = recipe_from_dict({
            "model": {"config": str(cfg_path), "tokenizer": "unused", "dtype": "float32", "attention": "sdpa"},
            "data": {"train": "unused", "max_seq_len": s["seq_len"]},
            "optimizer": {"name": "adamw_32bit", "lr": LR, "weight_decay": 0.0},
            "scheduler": {"name": "constant", "warmup_steps": 0},
            "lisa": {"enabled": policy is not None, "active_layers": GAMMA, "interval_steps": s["interval"],
                     "state_policy": policy or "discard", "train_embeddings": train_embeddings},
            "training": {"seed": SEED, "batch_size": s["batch_size"], "max_steps": s["steps"],
                         "max_grad_norm": MAX_GRAD_NORM, "output_dir": str(run_dir), "device": "cpu",
                         "compile": compiled},
        }, "lisa_bench")
        examples = [{"input_ids": r, "labels": list(r)} for r in rows]
        self.session = build_session(recipe, run_dir, tokenizer=PadOnly(), train_examples=examples,
                                     eval_examples=None)
        self.K = s["interval"]
        self.run = {"run": name, "impl": "lisaft", "method": "lisa" if policy else "full", "state_policy": policy,
                    "train_embeddings": train_embeddings, "compiled": compiled,
                    "optimizer": recipe.optimizer.name, "status": "ok",
                    "step_wall_s": [], "step_cpu_s": [], "switch_s": [], "losses": [], "intervals": [],
                    "threads": torch.get_num_threads()}

    def step(self, step: int) -> None:
        from lisaft.train import train_step

        run, ctl = self.run, self.session.controller
        w0, c0 = time.perf_counter(), time.process_time()
        # The switch is timed on its own; train_step's own activate_for_step is then a no-op.
        switched = ctl.activate_for_step(step)
        sw = time.perf_counter() - w0
        result = train_step(self.session, step)
        loss, tokens = result.loss, result.tokens
        run["step_wall_s"].append(time.perf_counter() - w0)
        run["step_cpu_s"].append(time.process_time() - c0)
        run["switch_s"].append(sw if switched else 0.0)
        run["losses"].append(loss)
        run["tokens_per_step"] = tokens
        if (step + 1) % self.K == 0:
            dev, off = self.session.optimizers.state_bytes()
            K, i = self.K, step // self.K
            interval_s = sum(run["step_wall_s"][i * K:])
            switch_s = run["switch_s"][i * K]
            run["intervals"].append({
                "interval": i, "end_step": step + 1, "active_layers": ctl.active_layers,
                "trainable_params": ctl.trainable_params(), "device_state_bytes": dev,
                "offloaded_state_bytes": off, "interval_s": interval_s, "switch_s": switch_s,
                "switch_fraction": switch_s / interval_s if interval_s else None,
            })

    def finish(self) -> dict:
        self.run["trainable_params_last"] = self.session.controller.trainable_params()
        self.run["train_loss_mean"] = statistics.fmean(self.run["losses"])
        self.session = None
        return self.run


# ---------------------------------------------------------------------------------------------
# Hugging Face Trainer, and LISA the LMFlow way


class HFRunner:
    """transformers' Trainer running its own loop in a thread, held at the start of every step
    until the benchmark lets it take one, so that it advances in lockstep with the other runs.
    Only one run computes at a time; the others wait on an event."""

    def __init__(self, name: str, lmflow: bool, cfg_path: Path, rows: list, s: dict, workdir: Path):
        import threading

        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback, TrainingArguments
        from transformers.trainer_callback import PrinterCallback

        from lisaft.data.order import DataOrder

        K, steps = s["interval"], s["steps"]
        # Same rows in the same order as lisaft's trainer draws them: step for step the same batches.
        order = DataOrder(len(rows), s["batch_size"], SEED)
        ordered = [rows[i] for _ in range(steps) for i in order.next_indices()]

        rows_in_order, InOrderTrainer = hf_in_order(ordered)

        config = AutoConfig.from_pretrained(str(cfg_path))
        torch.manual_seed(SEED)  # lisaft's models.load_model draws the initial weights from this seed
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
        layers = model.model.layers
        run = self.run = {
            "run": name, "impl": "hf_trainer", "method": "lisa" if lmflow else "full", "state_policy": None,
            "optimizer": "adamw_torch_fused", "status": "ok", "step_wall_s": [], "step_cpu_s": [], "switch_s": [],
            "intervals": [], "tokens_per_step": s["batch_size"] * s["seq_len"], "threads": torch.get_num_threads()}
        self.go, self.done = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        runner = self

        class Lockstep(TrainerCallback):
            """Waits for the benchmark's go at each step's start, then times the step: forward,
            backward, clipping, optimizer step and zero_grad fall inside. At each interval's end
            it reads the bytes of the optimizer's state tensors, outside the timing."""

            def on_step_begin(self, args, state, control, **kwargs):
                runner.done.set()  # parked: the previous step and the next batch's fetch are done
                runner.go.wait()
                runner.go.clear()
                self.w, self.c = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kwargs):
                run["step_wall_s"].append(time.perf_counter() - self.w)
                run["step_cpu_s"].append(time.process_time() - self.c)
                if state.global_step % K == 0:
                    opt = runner.trainer.optimizer
                    opt = getattr(opt, "optimizer", opt)  # accelerate's wrapper
                    i = state.global_step // K - 1
                    active = [j for j, layer in enumerate(layers) if next(layer.parameters()).requires_grad]
                    run["intervals"].append({
                        "interval": i, "end_step": state.global_step, "active_layers": active,
                        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                        "device_state_bytes": tensor_bytes(opt.state), "offloaded_state_bytes": 0,
                        "interval_s": sum(run["step_wall_s"][i * K:]),
                    })

        class LMFlowStyleLisa(TrainerCallback):
            """The reference switch (benchmarks/common.py) every K steps, timed."""

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step % K:
                    return
                t0 = time.perf_counter()
                lmflow_style_switch(layers, GAMMA)
                run["switch_s"].append(time.perf_counter() - t0)

        args = TrainingArguments(
            output_dir=str(workdir / name), per_device_train_batch_size=s["batch_size"], max_steps=steps,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch_fused", seed=SEED, use_cpu=True,
            eval_strategy="no", save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True,
            dataloader_num_workers=0, dataloader_pin_memory=False, remove_unused_columns=False,
        )
        # Lockstep first: the LMFlow switch then runs inside the timed step.
        callbacks = [Lockstep(), LMFlowStyleLisa()] if lmflow else [Lockstep()]
        self.trainer = InOrderTrainer(model=model, args=args, train_dataset=rows_in_order, callbacks=callbacks)
        self.trainer.remove_callback(PrinterCallback)  # it would print the final metrics
        self.model = model
        self.thread = threading.Thread(target=self._train, name=name, daemon=True)
        self.thread.start()
        self.done.wait()  # set-up (optimizer, data loader) finished before any other run steps
        if self.error is not None:
            raise RuntimeError(f"{name}: the Trainer failed to start") from self.error

    def _train(self) -> None:
        try:
            out = self.trainer.train()
            self.run["train_loss_mean"] = out.training_loss
        except BaseException as e:  # reported by step() in the main thread
            self.error = e
        finally:
            self.done.set()

    def step(self, step: int) -> None:
        # done is set again when the thread parks at the next step's start or its loop ends.
        self.done.clear()
        self.go.set()
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.run['run']}: the Trainer failed at step {step}") from self.error

    def finish(self) -> dict:
        self.go.set()  # nothing waits for it any more
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"{self.run['run']}: the Trainer failed") from self.error
        self.run["trainable_params_last"] = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.trainer = self.model = None
        return self.run


# ---------------------------------------------------------------------------------------------
# Report


def matmul_flops_per_s(threads: int, n: int = 1024, repeats: int = 10, device: str = "cpu", dtype=None) -> float:
    """The machine's matmul rate: the best of `repeats` n x n products (shared CPU: the fastest
    run is the least disturbed). float32 on CPU by default; the GPU suite asks for bf16 on CUDA."""
    import torch

    torch.set_num_threads(threads)
    a, b = (torch.randn(n, n, device=device, dtype=dtype or torch.float32) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b)  # the first call loads kernels
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def flops_per_token(counts: dict, cfg: dict, seq_len: int, active_sets: list[list[int]] | None,
                    train_embeddings: bool = True, recompute: bool = False) -> float:
    """Matmul FLOPs per trained token. A matmul with P weights costs 2P per token forward, 2P
    for its input gradient and 2P for its weight gradient. Full fine-tuning: 6P over decoder layers
    and head (the embedding is a lookup). LISA (active_sets: the layers of each interval; the
    mean over intervals): every layer runs forward; a layer computes its input gradient when
    anything below it trains (all layers when the embeddings train) and its weight gradient only
    when active; the head trains. Attention scores and values add 4·L·d forward per layer (as
    sdpa computes them, the masked half included) and 8·L·d backward wherever input gradients flow.
    recompute (gradient checkpointing): every layer that backward crosses runs its forward again."""
    n, layer, head = cfg["num_hidden_layers"], counts["per_decoder_layer_matmul"], counts["head"]
    attn_fwd = 4 * seq_len * cfg["hidden_size"]
    if active_sets is None:
        return n * (6 * layer + 3 * attn_fwd + (2 * layer + attn_fwd) * recompute) + 6 * head
    total = 0.0
    for active in active_sets:
        lowest = 0 if train_embeddings else min(active)
        backward_layers = n - lowest
        # The lowest active layer needs no input gradient when nothing below it trains.
        input_grads = backward_layers - (0 if train_embeddings else 1)
        total += (n * (2 * layer + attn_fwd) + input_grads * 2 * layer + backward_layers * 2 * attn_fwd
                  + len(active) * 2 * layer + 6 * head + backward_layers * (2 * layer + attn_fwd) * recompute)
    return total / len(active_sets)


def flop_shares(results: dict, counts: dict, cfg: dict, seq_len: int, rate: float) -> dict:
    """Per run: FLOPs per token, and tokens/s (lockstep, and whole-process when measured) as a
    share of the FLOP bound."""
    out = {}
    for name, r in results.items():
        if r.get("status") != "ok":
            continue
        sets = None if r["method"] == "full" else [iv["active_layers"] for iv in r["intervals"]]
        f = flops_per_token(counts, cfg, seq_len, sets, r.get("train_embeddings", True))
        r["flops_per_token"] = f
        r["flop_bound_tokens_per_s"] = rate / f
        r["share_of_flop_bound"] = r["tokens_per_s"] * f / rate
        if (r.get("whole_process") or {}).get("tokens_per_s"):
            r["whole_process"]["share_of_flop_bound"] = r["whole_process"]["tokens_per_s"] * f / rate
        out[name] = f
    return out


# ---------------------------------------------------------------------------------------------
# Whole processes


def whole_process(name: str, s: dict, threads: int, repeats: int) -> dict:
    """Per-step time of `name` run alone in fresh processes of N and 2N steps (start-up cancels)."""
    import subprocess

    n = s["steps"]
    walls: dict[int, list[float]] = {n: [], 2 * n: []}
    with tempfile.TemporaryDirectory(prefix="lisa_bench-proc-") as tmp:
        for _ in range(repeats):
            for steps in (n, 2 * n):
                cmd = [sys.executable, "-m", "benchmarks.lisa_bench", "--only", name, "--steps", str(steps),
                       "--interval", str(s["interval"]), "--threads", str(threads), "--processes", "0",
                       "--out", str(Path(tmp) / "out.json")] + (["--quick"] if s["mode"] == "quick" else
                                                                ["--shape", s["mode"]])
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                walls[steps].append(time.perf_counter() - t0)
                if proc.returncode:
                    raise RuntimeError(f"{name} in its own process failed:\n{proc.stderr[-2000:]}")
    # Non-positive when N steps are too few to stand out of start-up noise: reported as None.
    step_s = (min(walls[2 * n]) - min(walls[n])) / n
    tokens = s["batch_size"] * s["seq_len"]
    return {"steps": [n, 2 * n], "wall_s": {str(k): v for k, v in walls.items()}, "step_s": step_s,
            "tokens_per_s": tokens / step_s if step_s > 0 else None}


def param_counts(cfg_path: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(cfg_path)))
    total = sum(p.numel() for p in m.parameters())
    layer = sum(p.numel() for p in m.model.layers[0].parameters())
    layer_mm = sum(p.numel() for p in m.model.layers[0].parameters() if p.ndim == 2)
    return {"total": total, "per_decoder_layer": layer, "per_decoder_layer_matmul": layer_mm,
            "decoder_layers": layer * len(m.model.layers),
            "embeddings": m.model.embed_tokens.weight.numel(), "head": m.lm_head.weight.numel()}


def targets(runs: dict, full_state: int | None) -> dict:
    t = {}
    hf = runs.get("hf_full", {})
    for p in POLICIES:
        r = runs.get(f"lisaft_lisa_{p}", {})
        if hf.get("tokens_per_s") and r.get("tokens_per_s"):
            t[f"speedup_{p}_vs_hf_full"] = r["tokens_per_s"] / hf["tokens_per_s"]
    r = runs.get("lisaft_lisa_discard_frozen_emb", {})
    if hf.get("tokens_per_s") and r.get("tokens_per_s"):
        t["speedup_discard_frozen_emb_vs_hf_full"] = r["tokens_per_s"] / hf["tokens_per_s"]
    if "speedup_discard_vs_hf_full" in t:
        t["speedup_target_1_5x_met"] = t["speedup_discard_vs_hf_full"] >= 1.5
    lf = runs.get("lisaft_full", {})
    if hf.get("tokens_per_s") and lf.get("tokens_per_s"):
        t["lisaft_full_vs_hf_full"] = lf["tokens_per_s"] / hf["tokens_per_s"]
    t.update(issue_15_targets(runs, "tokens_per_s", ""))
    t.update(issue_15_targets({k: r.get("whole_process") or {} for k, r in runs.items()
                               if r.get("status") == "ok"}, "tokens_per_s", "whole_process_"))
    for p in ("discard", "offload_cpu", "offload_disk"):
        states = [iv["device_state_bytes"] for iv in runs.get(f"lisaft_lisa_{p}", {}).get("intervals", [])]
        if states:
            t[f"state_constant_{p}"] = min(states) == max(states)
    sw = [iv["switch_fraction"] for iv in runs.get("lisaft_lisa_offload_cpu", {}).get("intervals", [])[1:]
          if iv.get("switch_fraction") is not None]
    if sw:
        t["offload_cpu_switch_fraction_median"] = statistics.median(sw)
        t["offload_cpu_switch_fraction_max"] = max(sw)
        t["offload_cpu_switch_under_2pct_met"] = max(sw) < 0.02
    for name in ("hf_lisa_lmflow", "lisaft_lisa_keep"):
        states = [iv["device_state_bytes"] for iv in runs.get(name, {}).get("intervals", [])]
        if states and full_state:
            t[f"{name}_state_fraction_of_full_by_interval"] = [round(b / full_state, 4) for b in states]
            t[f"{name}_state_grows"] = states[-1] > states[0]
    return t


def issue_15_targets(runs: dict, key: str, prefix: str) -> dict:
    """LISA over the LMFlow-style callback (target >= 1.10), LISA over HF full fine-tuning as a
    share of its matmul ceiling (FLOPs per token of full FT / of LISA; target >= 0.90), lisaft
    full over HF full (target >= 1.0)."""
    t = {}
    lisa, lmflow, hf, lf = (runs.get(n, {}).get(key) for n in
                            ("lisaft_lisa_discard", "hf_lisa_lmflow", "hf_full", "lisaft_full"))
    if lisa and lmflow:
        t[prefix + "lisa_vs_lmflow"] = lisa / lmflow
        t[prefix + "lisa_vs_lmflow_1_10x_met"] = lisa / lmflow >= 1.10
    flops = {n: runs.get(n, {}).get("flops_per_token") for n in ("hf_full", "lisaft_lisa_discard")}
    if lisa and hf:
        t[prefix + "lisa_vs_hf_full"] = lisa / hf
    if lisa and hf and all(flops.values()):
        ceiling = flops["hf_full"] / flops["lisaft_lisa_discard"]
        t[prefix + "lisa_matmul_ceiling_over_hf_full"] = ceiling
        t[prefix + "lisa_share_of_ceiling"] = lisa / hf / ceiling
        t[prefix + "lisa_share_of_ceiling_90pct_met"] = lisa / hf / ceiling >= 0.90
    compiled = runs.get("lisaft_lisa_discard_compiled", {}).get(key)
    if compiled and lmflow:
        # training.compile is off by default; the callback runs eager.
        t[prefix + "lisa_compiled_vs_lmflow"] = compiled / lmflow
    if lf and hf:
        t[prefix + "lisaft_full_vs_hf_full"] = lf / hf
        t[prefix + "lisaft_full_at_least_hf_full_met"] = lf >= hf
    return t


def table(runs: list[dict], full_state: int | None) -> str:
    MB = 1e6
    rows = ["| run | tokens/s (median) | tokens/s (mean) | tokens/s (whole process) | of FLOP bound "
            "| CPU use | device opt. state, first → last interval (MB) "
            "| of full FT | offloaded, last (MB) | switch / interval (median, max) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        if r["status"] != "ok":
            rows.append(f"| {r['run']} | skipped: {r.get('note', '')} | | | | | | | | |")
            continue
        wp = r.get("whole_process") or {}
        wps = f"{wp['tokens_per_s']:.0f}" if wp.get("tokens_per_s") else "-"
        share = f"{r['share_of_flop_bound']:.0%}" if r.get("share_of_flop_bound") else "-"
        if wp.get("share_of_flop_bound"):
            share += f" ({wp['share_of_flop_bound']:.0%})"
        ivs = r["intervals"]
        first, last = ivs[0]["device_state_bytes"], ivs[-1]["device_state_bytes"]
        frac = f"{last / full_state:.0%}" if full_state else "-"
        sw = [iv["switch_fraction"] for iv in ivs[1:] if iv.get("switch_fraction") is not None]
        sws = f"{statistics.median(sw):.2%}, {max(sw):.2%}" if sw and r["method"] == "lisa" else "-"
        rows.append(f"| {r['run']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_mean']:.0f} | {wps} | {share} | "
                    f"{r['cpu_utilisation']:.0%} | {first / MB:.1f} → {last / MB:.1f} | {frac} | "
                    f"{ivs[-1]['offloaded_state_bytes'] / MB:.1f} | {sws} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape, few steps (tests)")
    ap.add_argument("--shape", choices=("default", "issue15"), default="default",
                    help="issue15: Llama 8 x 384, seq 256, batch 4, K=5")
    ap.add_argument("--steps", type=int, help="optimizer steps per run")
    ap.add_argument("--interval", type=int, help="LISA interval K in steps")
    ap.add_argument("--warmup", type=int, help="first steps left out of tokens/s")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default 2; --quick 1, since its "
                    "tiny operations gain nothing from a second thread and stall when another process "
                    "holds the other core)")
    ap.add_argument("--only", nargs="+", choices=RUN_ORDER, help="run only these configurations")
    ap.add_argument("--processes", type=int, help="whole-process repeats per contender and length "
                    "(default 2; --quick 0: none)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "lisa_bench.json")
    args = ap.parse_args(argv)

    import torch

    mode = "quick" if args.quick else args.shape
    s = dict(SETTINGS[mode])
    for k in ("steps", "interval", "warmup"):
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    if s["steps"] // s["interval"] < 2:
        ap.error("need at least two LISA intervals (--steps / --interval >= 2)")
    s["mode"] = mode
    shape = SHAPES[mode]
    threads = args.threads or (1 if args.quick else 2)
    processes = args.processes if args.processes is not None else (0 if args.quick else 2)
    torch.set_num_threads(threads)
    try:
        import accelerate  # noqa: F401  (the Trainer needs it)

        hf_note = None
    except ImportError:
        hf_note = "accelerate is not installed (the transformers Trainer needs it): pip install accelerate"
        if not args.quick:
            print(f"error: {hf_note}", file=sys.stderr)
            return 2

    # Compiling takes longer than the whole --quick run; it runs there only when named.
    default = [n for n in RUN_ORDER if not (args.quick and n.endswith("_compiled"))]
    wanted = [n for n in RUN_ORDER if n in (args.only or default)]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="lisa_bench-") as tmp:
        tmp = Path(tmp)
        cfg_path = tmp / "config.json"
        cfg_path.write_text(json.dumps(llama_config(shape, s["seq_len"])))
        rows = synthetic_rows(s["steps"] * s["batch_size"], s["seq_len"], shape["vocab_size"], SEED)
        runners = []
        for name in wanted:
            if name.startswith("hf_") and hf_note:
                results[name] = {"run": name, "status": "skipped", "note": hf_note}
            elif name.startswith("hf_"):
                runners.append(HFRunner(name, name == "hf_lisa_lmflow", cfg_path, rows, s, tmp))
            else:
                frozen_emb, compiled = name.endswith("_frozen_emb"), name.endswith("_compiled")
                policy = name.removeprefix("lisaft_lisa_").removesuffix("_frozen_emb").removesuffix("_compiled") \
                    if name.startswith("lisaft_lisa_") else None
                runners.append(LisaftRunner(name, policy, cfg_path, rows, s, tmp, train_embeddings=not frozen_emb,
                                            compiled=compiled))
            torch.set_num_threads(threads)  # in case a library changed it
        # Lockstep: step n of every run, then step n+1, the order rotated each step, so load from
        # other work on the machine falls on all runs alike instead of on whichever ran then.
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        for step in range(s["steps"]):
            k = step % max(len(runners), 1)
            for r in runners[k:] + runners[:k]:
                r.step(step)
            if (step + 1) % s["interval"] == 0:
                print(f"step {step + 1}/{s['steps']}, {time.perf_counter() - t0:.0f} s", flush=True)
        for r in runners:
            run = r.finish()
            results[run["run"]] = summarise(run, s["warmup"])
        wall = time.perf_counter() - t0
        counts = param_counts(cfg_path)
    if processes:
        for name in PROCESS_RUNS:
            if results.get(name, {}).get("status") == "ok":
                print(f"{name}: whole processes of {s['steps']} and {2 * s['steps']} steps", flush=True)
                results[name]["whole_process"] = whole_process(name, s, threads, processes)
    rate = matmul_flops_per_s(threads)
    flop_shares(results, counts, llama_config(shape, s["seq_len"]), s["seq_len"], rate)

    full = results.get("lisaft_full") or results.get("hf_full")
    full_state = full["intervals"][-1]["device_state_bytes"] if full and full.get("status") == "ok" else None
    runs = [results[n] for n in RUN_ORDER if n in results]
    summary = {
        "benchmark": "lisa_bench",
        "mode": mode,
        "command": "python -m benchmarks.lisa_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": threads, "matmul_flops_per_s": rate,
                    "loadavg_1min_before": load0, "loadavg_1min_after": os.getloadavg()[0],
                    "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": __import__("transformers").__version__},
        "model": {"config": llama_config(shape, s["seq_len"]), "parameters": counts, "dtype": "float32"},
        "settings": {**s, "active_layers": GAMMA, "whole_process_repeats": processes, "lr": LR,
                     "max_grad_norm": MAX_GRAD_NORM, "seed": SEED,
                     "tokens_per_step": s["batch_size"] * s["seq_len"]},
        "full_ft_state_bytes": full_state,
        "lockstep_wall_s": wall,
        "notes": [n for n in [hf_note] if n],
        "targets": targets(results, full_state),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(table(runs, full_state))
    for k, v in summary["targets"].items():
        if not isinstance(v, list):
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
