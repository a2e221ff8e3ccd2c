"""lisaft against its peers, whole process against whole process. benchmarks/peer_bench.py.

Three comparisons on the same model, data, batch and steps (benchmarks/peer_sides.py runs each side):

  full   lisaft full fine-tuning             against transformers' Trainer (adamw_torch_fused)
  lisa   lisaft LISA γ=2, K steps            against the Trainer with an LMFlow-style callback that
                                             toggles requires_grad (and the Trainer's full run)
  dpo    lisaft DPO, reference computed      against TRL's DPOTrainer, precompute_ref_log_probs=True
         once before step 1
  lisa_compiled  (only with --only lisa_compiled) lisaft LISA with training.compile (each decoder
         layer compiled) against the callback run with the Trainer's torch_compile (the whole
         model, compiled again for each new sample of layers), and against the eager callback,
         full run and lisaft LISA. Compilation falls in the timed steps wherever it happens there, as a user pays
         it; each side's median step (step_s_median) leaves it out. lisaft's eager LISA runs in
         the same rounds: the eager ratios of this comparison come from the same processes.

Shapes: `tiny` (SFT: Llama 8 layers x 384, 4 rows of 256 tokens, data.packing; DPO: Llama 4 x 256,
8 pairs a step, the quickstart tokenizer), `quick` (a smoke test's), or the real model with
--real-model PATH (a local Hugging Face folder such as SmolLM2-135M-Instruct's: its weights and,
for DPO, its tokenizer). float32, sdpa, constant LR, no weight decay, clipping at 1.0, a train
record every --log-every steps on every side.

Each side runs alone in a fresh process; the sides of a comparison alternate (A, B, A, B, the
order flipped each round) so that load from other work falls on both alike. A side's figure is
its steady state: the wall time from the end of the warm-up's last step to the end of the last
step, over those steps (the loop's per-step work included); start-up and the end's export fall
outside. The best of --repeats rounds counts (a shared CPU only slows a run down); every round's
figure and the load average before and after each process are in the JSON.

    python -m benchmarks.peer_bench                          # tiny shapes, all three (about 5 minutes)
    python -m benchmarks.peer_bench --real-model PATH --repeats 1   # a real model instead (about 6 minutes)
    python -m benchmarks.peer_bench --quick                  # the smoke shape (the tests run its sides)
    python -m benchmarks.peer_bench --only dpo --profile     # each side's top operators (shares)

TRL missing: the dpo comparison is skipped with one line. Writes
benchmarks/results/peer/peer_bench.json (peer_bench_real.json with --real-model, peer_bench_quick.json
with --quick; or --out).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SFT_MODEL = {"tiny": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                          num_key_value_heads=6, vocab_size=8192),
             "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512)}
# The quickstart tokenizer's 110 entries: lisaft and TRL tokenize the same strings with it.
DPO_MODEL = {"tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=110),
             "quick": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=110)}
# steps, warm-up steps left out, rows (pairs) per step, tokens per row, LISA's interval, log cadence
SETTINGS = {"sft": {"tiny": dict(steps=30, warmup=5, batch_size=4, seq_len=256, interval=5, log_every=5),
                    "quick": dict(steps=6, warmup=2, batch_size=2, seq_len=32, interval=2, log_every=2),
                    "real": dict(steps=7, warmup=2, batch_size=4, seq_len=256, interval=5, log_every=5)},
            "dpo": {"tiny": dict(steps=60, warmup=10, batch_size=8, seq_len=128, interval=5, log_every=5),
                    "quick": dict(steps=6, warmup=2, batch_size=2, seq_len=64, interval=2, log_every=2),
                    "real": dict(steps=7, warmup=2, batch_size=8, seq_len=128, interval=5, log_every=5)}}
COMPARISONS = {"full": ("lisaft_full", "hf_full"), "lisa": ("lisaft_lisa", "hf_lmflow"),
               "dpo": ("lisaft_dpo", "trl_dpo"), "lisa_compiled": ("lisaft_lisa_compiled", "hf_lmflow_compiled")}
# Beside each side of a comparison, the third sides it is also read against (each ratio in the JSON).
ALSO = {"lisa": ["hf_full"], "lisa_compiled": ["hf_lmflow", "hf_full", "lisaft_lisa"]}
# lisa_compiled only on request: the Trainer's whole-model compile runs again at each new sample.
DEFAULT = ["full", "lisa", "dpo"]


def settings(comparison: str, shape: str, real_model: Path | None, threads: int) -> dict:
    kind = "dpo" if comparison == "dpo" else "sft"
    s = {**SETTINGS[kind][shape], "threads": threads, "shape": shape}
    if shape == "real":
        assert real_model is not None
        config = json.loads((real_model / "config.json").read_text())
        return {**s, "model_path": str(real_model), "tokenizer": str(real_model), "vocab": config["vocab_size"]}
    model = (DPO_MODEL if kind == "dpo" else SFT_MODEL)[shape]
    return {**s, "model": model, "vocab": model["vocab_size"]}


def portable(text: str, real_model: Path | None) -> str:
    """The result as committed: the real model's folder (a path on the machine that ran it) named
    REAL_MODEL, as `python -m benchmarks.real_model` prints it on another."""
    return text.replace(json.dumps(str(real_model))[1:-1], "REAL_MODEL") if real_model else text


def one_process(name: str, s: dict, profile: bool) -> dict:
    """One side in a fresh interpreter; its RESULT line, and the load average around it."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="peer_bench-") as work:
        cmd = [sys.executable, "-m", "benchmarks.peer_bench", "--side", name, "--settings", json.dumps(s),
               "--work", work] + (["--profile"] if profile else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"{name} failed: {tail[-1][:400]}")
    out = json.loads(lines[-1][len("RESULT "):])
    return {**out, "process_wall_s": wall, "load_avg_1min": [round(load, 2), round(os.getloadavg()[0], 2)]}


def compare(comparison: str, s: dict, repeats: int, profile: bool) -> dict:
    ours, theirs = COMPARISONS[comparison]
    sides = [ours, theirs] + ALSO.get(comparison, [])
    rounds: dict[str, list[dict]] = {n: [] for n in sides}
    for r in range(repeats):
        for name in sides if r % 2 == 0 else sides[::-1]:
            rounds[name].append(one_process(name, s, profile))
            print(f"  {s['shape']} {name}: {rounds[name][-1]['steps_per_s']:.2f} steps/s "
                  f"(load {rounds[name][-1]['load_avg_1min'][0]})", flush=True)
    tokens = s["batch_size"] * s["seq_len"]
    best = {n: max(x["steps_per_s"] for x in rs) for n, rs in rounds.items()}
    out = {"settings": s, "rounds": rounds, "steps_per_s": best,
           "tokens_per_s": {n: v * tokens for n, v in best.items()} if comparison != "dpo" else None,
           f"{ours}_over_{theirs}": best[ours] / best[theirs]}
    for other in ALSO.get(comparison, []):
        out[f"{ours}_over_{other}"] = best[ours] / best[other]
    if comparison == "lisa_compiled":  # the steady state, a recompilation's step left out
        median = {n: min(x["step_s_median"] for x in rs) for n, rs in rounds.items()}
        out["by_median_step"] = {f"{ours}_over_{o}": median[o] / median[ours] for o in [theirs, *ALSO[comparison]]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the smoke test's shape (seconds)")
    ap.add_argument("--real-model", type=Path, help="a local Hugging Face model folder: its shape instead of tiny")
    ap.add_argument("--only", choices=sorted(COMPARISONS), action="append", help="one comparison (repeatable)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of A, B (default 2; 1 with --quick)")
    ap.add_argument("--steps", type=int, help="steps timed after the warm-up (default: the shape's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="each side's top operators by self CPU time")
    ap.add_argument("--out", type=Path, help="the result file (default benchmarks/results/peer/peer_bench.json; "
                    "_real, _quick for those shapes)")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:  # a child: one side
        from benchmarks.peer_sides import run_side

        print("RESULT " + json.dumps(run_side(args.side, json.loads(args.settings), Path(args.work), args.profile)))
        return 0
    import torch

    repeats = args.repeats or (1 if args.quick else 2)
    shape = "quick" if args.quick else "real" if args.real_model else "tiny"
    result: dict = {"benchmark": "peer_bench", "command": "python -m benchmarks.peer_bench " + " ".join(
        argv if argv is not None else sys.argv[1:]), "torch": torch.__version__, "repeats": repeats,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpus": os.cpu_count(), "comparisons": {}}
    if args.profile:
        result["note"] = "timed under torch.profiler: the operator shares count, the steps/s do not"
    for version in ("transformers", "trl"):
        result[version] = (importlib.import_module(version).__version__
                           if importlib.util.find_spec(version) else None)
    suffix = "" if shape == "tiny" else "_" + shape
    args.out = args.out or REPO / "benchmarks" / "results" / "peer" / f"peer_bench{suffix}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for comparison in args.only or DEFAULT:
        if comparison == "dpo" and result["trl"] is None:
            print("dpo: skipped, TRL is not installed (pip install -e '.[bench]')")
            continue
        s = settings(comparison, shape, args.real_model, args.threads)
        if args.steps:
            s["steps"] = s["warmup"] + args.steps
        result["comparisons"][f"{shape}/{comparison}"] = compare(comparison, s, repeats, args.profile)
        args.out.write_text(portable(json.dumps(result, indent=1), args.real_model))
    for key, c in result["comparisons"].items():
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in c.items() if "_over_" in k)
        print(f"{key}: " + ", ".join(f"{n} {v:.2f} steps/s" for n, v in c["steps_per_s"].items()) + f"; {ratios}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
