"""What the optimizer on the CPU costs on the host: benchmarks/offload_bench.py.

optimizer.cpu_offload (lisaft/optim/cpu_offload.py) does four things on the host per optimizer step;
this times each one through the class's own code, against model size and CPU threads:

    copy_in      a completed gradient into its host accumulator (the first micro-batch's)
    accumulate   a later micro-batch's gradient added into the accumulator
    step         clipping by the global norm, then the unit optimizers' step on the CPU
    copy_out     the updated weights written back to the training device

The "model" is a stack of Llama-shaped decoder layers (bfloat16, hidden h, MLP 3.5 h), one
training unit per layer, so the parameter count scales with the layer count while the tensor
shapes stay those of a real layer. Without a GPU the training device is the CPU: copy_in and
copy_out are then host memcpy, a lower bound on the PCIe copies (which run on a side stream,
overlapped with compute, on CUDA). The step and the accumulation run the same code either way.

Results are also given per 10^9 parameters, the figure to scale to a model: Llama-3.1-8B
has 8.03 x 10^9.

    python -m benchmarks.offload_bench            # 52M and 210M params x threads x 2 optimizers
    python -m benchmarks.offload_bench --quick    # one tiny size, one thread: a few seconds

Writes offload.json and offload.md into --out (default benchmarks/results/offload, or
benchmarks/results/offload-quick with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from lisaft.config.schema import OptimizerSection
from lisaft.model.units import Unit
from lisaft.optim.cpu_offload import OffloadedOptimizers

REPO = Path(__file__).resolve().parents[1]

FULL = {"hidden": 1024, "layers": [4, 16], "threads": sorted({1, os.cpu_count() or 1}),
        "optimizers": ["adamw_8bit", "adamw_32bit"], "reps": 3}
QUICK = {"hidden": 128, "layers": [2], "threads": [1], "optimizers": ["adamw_8bit"], "reps": 1}
PIECES = ("copy_in", "accumulate", "step", "copy_out")


def layer_params(hidden: int, gen: torch.Generator) -> list[nn.Parameter]:
    """One Llama-shaped decoder layer in bfloat16: attention (8:1 grouped kv), a 3.5 h MLP, two norms."""
    kv, inter = hidden // 4, hidden * 7 // 2
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
              (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    return [nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)) for s in shapes]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(hidden: int, layers: int, threads: int, optimizer: str, reps: int, workdir: Path) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    units = [Unit(f"layer-{i:05d}", i + 1, layer_params(hidden, gen), i) for i in range(layers)]
    params = [p for u in units for p in u.params]
    section = OptimizerSection(name=optimizer, lr=1e-5, weight_decay=0.1, cpu_offload=True)
    opts = OffloadedOptimizers(units, section, torch.device("cpu"), workdir / "offload", seed=0)
    grads = [(torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16) for p in params]
    for u in units:
        opts.activate(u)

    def feed() -> None:
        # What backward's post-accumulate-grad hook sees: the gradient on the parameter.
        for p, g in zip(params, grads):
            p.grad = g
            opts._gradient_ready(p)

    def copy_out() -> None:
        with torch.no_grad():
            for p in params:
                p.copy_(opts._host_of[p])

    times = {k: [] for k in PIECES}
    for step in range(reps + 1):  # the first step creates the moments: not timed
        opts.set_lr(1e-5, step)
        t_in = _timed(feed)
        t_acc = _timed(feed)
        # The step returns once the updates are queued (they overlap the next forward in
        # training); here it is timed to the last weight back.
        t_step = _timed(lambda: (opts.clip_and_step(units, 1.0, measure_norm=True), opts.wait()))
        t_out = _timed(copy_out)
        if step:
            for k, v in zip(PIECES, (t_in, t_acc, t_step, t_out)):
                times[k].append(v)
    n = sum(p.numel() for p in params)
    # The step includes its own copy back; report it without, so the four pieces add up.
    med = {k: statistics.median(v) for k, v in times.items()}
    med["step"] = max(med["step"] - med["copy_out"], 0.0)
    return {"hidden": hidden, "layers": layers, "params": n, "threads": threads, "optimizer": optimizer,
            "seconds": med,
            "seconds_per_1e9_params": {k: v * 1e9 / n for k, v in med.items()},
            "gradient_bytes": 2 * n}


def run(cfg: dict, mode: str) -> dict:
    load_before = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in cfg["layers"]:
            for optimizer in cfg["optimizers"]:
                for threads in cfg["threads"]:
                    r = measure(cfg["hidden"], layers, threads, optimizer, cfg["reps"], Path(tmp))
                    results.append(r)
                    print(f"{r['params'] / 1e6:7.1f}M params {optimizer:12s} {threads} threads: "
                          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["seconds"].items()), flush=True)
    return {"mode": mode, "settings": cfg, "results": results,
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "cpu_count": os.cpu_count(), "torch": torch.__version__,
                        "cuda": torch.cuda.is_available(),
                        # Other processes' share of the cores: on a busy machine the times are upper bounds.
                        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
            "note": "training device = CPU: copy_in/copy_out are host memcpy, not PCIe copies"}


def markdown(summary: dict) -> str:
    rows = ["| params | optimizer | threads | copy_in ms | accumulate ms | step ms | copy_out ms "
            "| step s per 10^9 params | step s at 8.03 x 10^9 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["results"]:
        ms = {k: f"{v * 1e3:.0f}" for k, v in r["seconds"].items()}
        per = r["seconds_per_1e9_params"]["step"]
        rows.append(f"| {r['params'] / 1e6:.1f}M | {r['optimizer']} | {r['threads']} | {ms['copy_in']} | "
                    f"{ms['accumulate']} | {ms['step']} | {ms['copy_out']} | {per:.2f} | {per * 8.03:.1f} |")
    return "\n".join(rows) + f"\n\n{summary['machine']['platform']}, {summary['machine']['cpu_count']} CPUs, " \
        f"torch {summary['machine']['torch']}, 1-minute load average {summary['machine']['load_average_1min']} " \
        f"(before, after); {summary['note']}.\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one tiny size, one thread")
    ap.add_argument("--out", type=Path, default=None, help="result folder")
    args = ap.parse_args(argv)
    out = args.out or REPO / "benchmarks" / "results" / ("offload-quick" if args.quick else "offload")
    summary = run(QUICK if args.quick else FULL, "quick" if args.quick else "full")
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "offload.md").write_text(markdown(summary))
    print(f"wrote {out / 'offload.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
