"""Do bfloat16 updates land? benchmarks/precision_bench.py.

For each optimizer, one small Llama (saved once as a float32 Hugging Face folder, so every run starts
from the same weights) is fine-tuned at lr 1e-5, constant, full fine-tuning, in three ways:

    float32          float32 weights: the reference
    bf16_nearest     bfloat16 weights, updates written back with round-to-nearest
    bf16_stochastic  bfloat16 weights, stochastic rounding (lisaft's default)

through lisaft's own build_session / train_step / evaluate, with the same batches in the same
order, the three runs advancing in lockstep. Per run it reports the fraction of weight elements
that changed at least once after 1 and after N steps (layer matrices, norms, embeddings and
head), train and eval loss after N steps, the share of the float32 run's eval-loss decrease
kept, the cosine between the run's total weight update and the float32 run's, tokens/s and the
optimizer update's time per step. A micro-benchmark times one optimizer step on a single
8 Mi-element weight, where the update is all the work.

It runs on CPU, where the paged optimizers run unpaged (same updates; paging needs CUDA).

    python -m benchmarks.precision_bench            # full: 4 optimizers x 3 modes, 50 steps
    python -m benchmarks.precision_bench --quick    # adamw_32bit only, a tinier model: ~20 s

Writes precision.json and precision.md into --out (default benchmarks/results/precision, or
benchmarks/results/precision-quick with --quick).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from lisaft.config.optimizers import OPTIMIZERS
from lisaft.config.schema import recipe_from_dict
from lisaft.optim.adamw import Rounding
from lisaft.optim.build import build_unit_optimizer
from lisaft.train import build_session, train_step
from lisaft.train.evaluate import evaluate

REPO = Path(__file__).resolve().parents[1]

QUICKSTART = REPO / "recipes" / "quickstart"
MODES = ("float32", "bf16_nearest", "bf16_stochastic")
KINDS = ("layer_matrices", "norms", "embeddings_head")
LR = 1e-5
FULL = dict(layers=4, hidden=128, intermediate=384, heads=4, steps=50, batch_size=16, eval_batches=8,
            optimizers=OPTIMIZERS, micro_numel=8 << 20, micro_reps=5)
QUICK = dict(layers=2, hidden=64, intermediate=128, heads=4, steps=25, batch_size=8, eval_batches=4,
             optimizers=("adamw_32bit",), micro_numel=1 << 20, micro_reps=3)
TRAIN_LOSS_WINDOW = 10  # train loss "after N steps": the mean of the last steps (batches differ)


def _kind(name: str, p: torch.Tensor) -> str:
    if p.ndim < 2:
        return "norms"
    if "embed_tokens" in name or "lm_head" in name:
        return "embeddings_head"
    return "layer_matrices"


def save_model(cfg: dict, folder: Path, seed: int) -> None:
    """The common starting point: a float32 model from the quickstart config, resized."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = json.loads((QUICKSTART / "config.json").read_text())
    base.update(num_hidden_layers=cfg["layers"], hidden_size=cfg["hidden"],
                intermediate_size=cfg["intermediate"], num_attention_heads=cfg["heads"],
                num_key_value_heads=cfg["heads"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**base), dtype=torch.float32)
    model.save_pretrained(folder)


def bench_recipe(model_dir: Path, run_dir: Path, optimizer: str, mode: str, cfg: dict, seed: int):
    return recipe_from_dict({
        "model": {"name_or_path": str(model_dir), "tokenizer": str(QUICKSTART / "tokenizer"),
                  "dtype": "float32" if mode == "float32" else "bfloat16", "attention": "sdpa"},
        "data": {"train": str(QUICKSTART / "train.jsonl"), "eval": str(QUICKSTART / "eval.jsonl"),
                 "format": "instruction", "max_seq_len": 64},
        "optimizer": {"name": optimizer, "lr": LR, "weight_decay": 0.0,
                      "bf16_update": "nearest" if mode == "bf16_nearest" else "stochastic"},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "lisa": {"enabled": False},
        "training": {"seed": seed, "batch_size": cfg["batch_size"], "max_steps": cfg["steps"],
                     "eval_batches": cfg["eval_batches"], "max_grad_norm": 1.0, "device": "cpu",
                     "output_dir": str(run_dir)},
    }, "precision_bench")


class _Arm:
    """One run: a session, its initial weights, and what it measured so far."""

    def __init__(self, model_dir: Path, work: Path, optimizer: str, mode: str, cfg: dict, seed: int,
                 data: dict) -> None:
        self.optimizer, self.mode, self.steps = optimizer, mode, cfg["steps"]
        recipe = bench_recipe(model_dir, work / f"{optimizer}-{mode}", optimizer, mode, cfg, seed)
        self.session = session = build_session(recipe, work / f"{optimizer}-{mode}", **data)
        data.update(tokenizer=session.tokenizer, train_examples=session.train_examples,
                    eval_examples=session.eval_examples)
        self.params = dict(session.model.named_parameters())
        self.init = {n: p.detach().clone() for n, p in self.params.items()}
        self.changed = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in self.params.items()}
        # Time the optimizer update alone: wrap this session's UnitOptimizers.step.
        self.update_s, inner = [], session.optimizers.step

        def timed_step(units):
            t0 = time.perf_counter()
            inner(units)
            self.update_s.append(time.perf_counter() - t0)

        session.optimizers.step = timed_step
        self.before = evaluate(session)["eval_loss"]
        self.losses, self.step_s, self.tokens, self.after_one = [], [], 0, None

    def step(self, step: int) -> None:
        t0 = time.perf_counter()
        result = train_step(self.session, step)
        loss, n_tokens = result.loss, result.tokens
        self.step_s.append(time.perf_counter() - t0)
        self.losses.append(loss)
        self.tokens += n_tokens
        for n, p in self.params.items():
            self.changed[n] |= p.detach() != self.init[n]
        if step == 0:
            self.after_one = _fractions(self.changed, self.params)

    def finish(self) -> tuple[dict, dict]:
        """The run's record, and its total weight update per parameter (float32, flat)."""
        ev = evaluate(self.session)
        delta = {n: (p.detach().float() - self.init[n].float()).reshape(-1) for n, p in self.params.items()}
        # The first step pays one-time set-up (moment allocation): leave it out of the speeds.
        step_s, update_s = self.step_s[1:], self.update_s[1:]
        return {
            "optimizer": self.optimizer, "mode": self.mode,
            "changed_after_1": self.after_one,
            f"changed_after_{self.steps}": _fractions(self.changed, self.params),
            "eval_loss_before": self.before, "eval_loss": ev["eval_loss"],
            "eval_token_accuracy": ev["eval_token_accuracy"],
            "train_loss_first": self.losses[0],
            "train_loss_last": statistics.fmean(self.losses[-TRAIN_LOSS_WINDOW:]),
            "tokens_per_s": self.tokens / len(self.step_s) / statistics.median(step_s),
            "step_ms_median": 1e3 * statistics.median(step_s),
            "update_ms_median": 1e3 * statistics.median(update_s),
        }, delta


def _compare(model_dir: Path, work: Path, optimizer: str, cfg: dict, seed: int, data: dict) -> dict:
    """The three modes of one optimizer, advanced in lockstep (step n of each, the order rotated
    every step) so that load from other work on a shared machine falls on all of them alike."""
    arms = [_Arm(model_dir, work, optimizer, mode, cfg, seed, data) for mode in MODES]
    for step in range(cfg["steps"]):
        for k in range(len(arms)):
            arms[(step + k) % len(arms)].step(step)
    runs, deltas = {}, {}
    for arm in arms:
        runs[arm.mode], deltas[arm.mode] = arm.finish()
    ref = runs["float32"]
    drop_ref = ref["eval_loss_before"] - ref["eval_loss"]
    for mode, r in runs.items():
        r["eval_loss_decrease"] = r["eval_loss_before"] - r["eval_loss"]
        r["share_of_float32_decrease"] = r["eval_loss_decrease"] / drop_ref if drop_ref > 0 else None
        r["update_cosine_with_float32"] = _cosine(deltas[mode], deltas["float32"])
    return runs


def _fractions(changed: dict, params: dict) -> dict:
    out = {}
    for kind in KINDS:
        names = [n for n, p in params.items() if _kind(n, p) == kind]
        total = sum(changed[n].numel() for n in names)
        out[kind] = sum(int(changed[n].sum()) for n in names) / total if total else None
    return out


def _cosine(a: dict, b: dict) -> float:
    dot = sum(float(torch.dot(a[n].double(), b[n].double())) for n in a)
    na = math.sqrt(sum(float(a[n].double().pow(2).sum()) for n in a))
    nb = math.sqrt(sum(float(b[n].double().pow(2).sum()) for n in b))
    return dot / (na * nb) if na and nb else float("nan")


def _micro(optimizer: str, numel: int, reps: int, seed: int) -> dict:
    """Median ms of one optimizer step on a single weight of `numel` elements, per mode (the modes
    interleaved, as in _compare)."""
    gen = torch.Generator().manual_seed(seed)
    w0, g0 = torch.randn(numel, generator=gen) * 0.02, torch.randn(numel, generator=gen) * 1e-3
    setups = {}
    for mode in MODES:
        # Only the recipe's optimizer section is used here: no model or run folder is read.
        section = bench_recipe(Path("unused"), Path("unused"), optimizer, mode, QUICK, seed).optimizer
        dtype = torch.float32 if mode == "float32" else torch.bfloat16
        w = torch.nn.Parameter(w0.to(dtype))
        w.grad = g0.to(dtype)
        rounding = Rounding(section.bf16_update, seed)
        setups[mode] = (build_unit_optimizer([w], section, torch.device("cpu"), rounding, 0, None), rounding)
    times = {mode: [] for mode in MODES}
    for step in range(reps + 1):
        for k in range(len(MODES)):
            mode = MODES[(step + k) % len(MODES)]
            opt, rounding = setups[mode]
            rounding.step = step
            t0 = time.perf_counter()
            opt.step()
            times[mode].append(time.perf_counter() - t0)
    return {mode: 1e3 * statistics.median(t[1:]) for mode, t in times.items()}


def run(cfg: dict, out: Path, seed: int, mode_name: str) -> dict:
    started = time.time()
    results, note = {}, []
    with tempfile.TemporaryDirectory(prefix="precision-bench-") as tmp:
        work = Path(tmp)
        save_model(cfg, work / "model", seed)
        data: dict = {}
        for optimizer in cfg["optimizers"]:
            print(f"{optimizer} ...", flush=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results[optimizer] = _compare(work / "model", work, optimizer, cfg, seed, data)
            note += [str(w.message) for w in caught if "paged" in str(w.message)]
    micro = {o: _micro(o, cfg["micro_numel"], cfg["micro_reps"], seed) for o in cfg["optimizers"]}
    summary = {
        "mode": mode_name, "lr": LR,
        "settings": {k: v for k, v in cfg.items() if k != "optimizers"} | {
            "optimizers": list(cfg["optimizers"]), "seed": seed, "scheduler": "constant",
            "max_grad_norm": 1.0, "weight_decay": 0.0, "max_seq_len": 64,
            "data": "recipes/quickstart train/eval (instruction)", "device": "cpu",
            "torch_threads": torch.get_num_threads()},
        "notes": sorted(set(note)),
        "results": results,
        "update_microbench_ms": micro,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "machine": platform.machine(), "processor": platform.processor() or None},
        "seconds": round(time.time() - started, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "precision.md").write_text(markdown(summary))
    return summary


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def markdown(s: dict) -> str:
    st = s["settings"]
    n = st["steps"]
    lines = [
        f"# bfloat16 updates at lr {s['lr']:g} ({s['mode']} mode)", "",
        f"{st['layers']}-layer Llama (hidden {st['hidden']}), full fine-tuning, constant lr, {n} steps "
        f"of batch {st['batch_size']}, seed {st['seed']}, CPU ({st['torch_threads']} threads). "
        "Changed: share of elements that differed from their initial value at least once "
        "(layer matrices / norms / embeddings and head). Kept: share of the float32 run's eval-loss "
        "decrease. Cosine: between the run's total weight update and the float32 run's. The three "
        "runs of an optimizer advance in lockstep (timings comparable within an optimizer; bf16 "
        "matmuls are slow on CPU, so compare bf16 with bf16 for the cost of the rounding).", "",
        f"| optimizer | weights | changed after 1 step | changed after {n} | eval loss | train loss "
        "| kept | cosine | tokens/s | update ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for opt, runs in s["results"].items():
        for mode, r in runs.items():
            c1 = " / ".join(_pct(r["changed_after_1"][k]) for k in KINDS)
            cn = " / ".join(_pct(r[f"changed_after_{n}"][k]) for k in KINDS)
            lines.append(f"| {opt} | {mode} | {c1} | {cn} "
                         f"| {r['eval_loss_before']:.3f} → {r['eval_loss']:.3f} "
                         f"| {r['train_loss_first']:.3f} → {r['train_loss_last']:.3f} "
                         f"| {_pct(r['share_of_float32_decrease'])} | {r['update_cosine_with_float32']:.3f} "
                         f"| {r['tokens_per_s']:.0f} | {r['update_ms_median']:.2f} |")
    numel = st["micro_numel"]
    lines += ["", f"One optimizer step on a single weight of {numel / 2**20:g} Mi elements (median ms):", "",
              "| optimizer | " + " | ".join(MODES) + " |", "| --- |" + " --- |" * len(MODES)]
    for opt, row in s["update_microbench_ms"].items():
        lines.append(f"| {opt} | " + " | ".join(f"{row[m]:.1f}" for m in MODES) + " |")
    lines += [""] + [f"Note: {x}" for x in s["notes"]]
    lines += ["", f"Train loss: first step → mean of the last {TRAIN_LOSS_WINDOW}. "
              f"Run time {s['seconds']:.0f} s. Command: `python -m benchmarks.precision_bench"
              f"{' --quick' if s['mode'] == 'quick' else ''}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="adamw_32bit only, a tinier model, fewer steps")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    out = args.out or REPO / "benchmarks" / "results" / ("precision-quick" if args.quick else "precision")
    run(dict(cfg), out, args.seed, "quick" if args.quick else "full")
    print((out / "precision.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
