"""Where one lisaft training step spends its time. benchmarks/step_profile.py.

Builds a session the way `lisaft train` does (random-init Llama, float32, sdpa, adamw_32bit, no
gradient checkpointing) on synthetic rows of exactly L tokens, runs `trainer.train_step` and times
its phases by wrapping the functions it calls, so the step measured is the real one:

  collate     lisaft.data.collate.collate (data and collation)
  forward     model forward and the token loss sum
  backward    torch.Tensor.backward
  clip        lisaft.optim.gradients.clip_grad_norm (the total norm, and scaling)
  optimizer   UnitOptimizers.step (the unit AdamWs, and freeing gradients)
  lisa        LisaController.activate_for_step (the switch at interval boundaries; a no-op between)
  metrics     what a logged step adds in the loop: UnitOptimizers.state_bytes() and
              LisaController.trainable_params(), timed after the step as if every step logged
  other       the rest of train_step (token counts, learning rate, .item(), gradient bytes)

Each phase's figure is the minimum over R repeated runs of its per-step median: the CPU is shared
with other work, and the minimum is the least disturbed figure. A short torch.profiler trace of the
same step lists the top operators by self CPU time.

    python -m benchmarks.step_profile                       # issue shape, LISA γ=2 K=5 and full FT
    python -m benchmarks.step_profile --shape quickstart    # recipes/quickstart's model, seq 64, batch 32
    python -m benchmarks.step_profile --shape smollm2 --steps 6 --repeats 1   # the real model's shape
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import PadOnly, synthetic_examples

REPO = Path(__file__).resolve().parents[1]

SHAPES = {
    # The shape of issue 15: Llama 8 layers x 384 hidden, seq 256, batch 4.
    "issue": dict(model=dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                             num_key_value_heads=6, vocab_size=8192),
                  seq_len=256, batch_size=4),
    # SmolLM2-135M's shape (peer_bench --real-model), randomly initialised: 30 layers x 576,
    # grouped-query attention, a tied 49,152-entry head, so the loss runs in chunks (50 M logits).
    "smollm2": dict(model=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                               rope_theta=100000.0),
                    seq_len=256, batch_size=4),
    "quickstart": dict(model=json.loads((REPO / "recipes" / "quickstart" / "config.json").read_text()),
                       seq_len=64, batch_size=32),
}
PHASES = ("collate", "forward", "backward", "clip", "optimizer", "lisa", "metrics", "other")


def build(shape: dict, lisa: bool, workdir: Path, steps: int, compile_layers: bool = False):

    from lisaft.config.schema import recipe_from_dict
    from lisaft.train import build_session

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **shape["model"],
           "max_position_embeddings": max(shape["seq_len"], shape["model"].get("max_position_embeddings", 0))}
    cfg_path = workdir / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    training = {"seed": 0, "batch_size": shape["batch_size"], "max_steps": steps, "max_grad_norm": 1.0,
                "output_dir": str(workdir / "run"), "device": "cpu"}
    if compile_layers:
        training["compile"] = True
    recipe = recipe_from_dict({
        "model": {"config": str(cfg_path), "tokenizer": "unused", "dtype": "float32", "attention": "sdpa"},
        "data": {"train": "unused", "max_seq_len": shape["seq_len"]},
        "optimizer": {"name": "adamw_32bit", "lr": 1e-4, "weight_decay": 0.0},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "lisa": {"enabled": lisa, "active_layers": 2, "interval_steps": 5, "state_policy": "discard"},
        "training": training,
    }, "step_profile")
    examples = synthetic_examples(steps * shape["batch_size"], shape["seq_len"], cfg["vocab_size"], seed=0)
    return build_session(recipe, workdir / "run", tokenizer=PadOnly(), train_examples=examples, eval_examples=None)


class PhaseTimer:
    """Times the phases train_step runs through its public seam (lisaft.train.Phases)."""

    def __init__(self) -> None:
        self.acc: dict = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.acc[name] += time.perf_counter() - t0


def profile_run(session, steps: int, warmup: int) -> dict:
    from lisaft.train import train_step

    per_step = defaultdict(list)
    for step in range(steps):
        timer = PhaseTimer()
        t0 = time.perf_counter()
        tokens = train_step(session, step, phases=timer).tokens
        total = time.perf_counter() - t0
        acc = timer.acc
        t1 = time.perf_counter()
        session.optimizers.state_bytes()
        session.controller.trainable_params()
        acc["metrics"] = time.perf_counter() - t1
        acc["other"] = total - sum(acc[p] for p in PHASES if p not in ("metrics", "other"))
        acc["step"] = total
        if step >= warmup:
            for k, v in acc.items():
                per_step[k].append(v)
    return {"tokens_per_step": tokens, **{k: statistics.median(v) for k, v in per_step.items()}}


def torch_profile(session, start: int, steps: int, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from lisaft.train import train_step

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(start, start + steps):
            train_step(session, step)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls": e.count, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
            for e in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="issue")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per repeat (the first 2 left out)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration; the minimum counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("lisa", "full"), help="one configuration")
    ap.add_argument("--compile", action="store_true", help="training.compile: true")
    ap.add_argument("--no-profiler", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step_profile.json")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    result = {"benchmark": "step_profile", "shape": args.shape, "compile": args.compile,
              "command": "python -m benchmarks.step_profile " + " ".join(argv if argv is not None else sys.argv[1:]),
              "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
              "note": "per phase: the minimum over repeats of the per-step median (shared CPU)", "configs": {}}
    for name in [args.only] if args.only else ["lisa", "full"]:
        best: dict = {}
        trace = None
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="step_profile-") as tmp:
                session = build(shape, name == "lisa", Path(tmp), args.steps + 10, args.compile)
                r = profile_run(session, args.steps, warmup=2)
                best = {k: min(v, best.get(k, v)) for k, v in r.items()}
                if trace is None and not args.no_profiler:
                    trace = torch_profile(session, args.steps, 5, top=15)
        best["tokens_per_s"] = best["tokens_per_step"] / best["step"]
        result["configs"][name] = {"phases_s": {p: best[p] for p in PHASES}, "step_s": best["step"],
                                   "tokens_per_s": best["tokens_per_s"], "profiler_top_ops": trace}
        print(f"{name}: step {best['step'] * 1e3:.1f} ms, {best['tokens_per_s']:.0f} tok/s; "
              + ", ".join(f"{p} {best[p] * 1e3:.1f}" for p in PHASES))
        for op in trace or []:
            print(f"    {op['op']:<40} {op['calls']:>6} {op['self_cpu_ms_per_step']:8.2f} ms/step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
