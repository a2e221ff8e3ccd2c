"""The AdamW step on the CPU against the memory bandwidth: benchmarks/host_step_bench.py.

One tensor of --params elements in lisaft's layout (bfloat16 weight and gradient, stochastic
rounding), stepped by lisaft's AdamW for each moment type: the fused host kernel
(lisaft/optim/host_kernel.py) beside today's torch path (torch's fused AdamW or bitsandbytes'
CPU kernel, then a rounding pass; what runs where numba cannot load). The floor is the bytes
each parameter moves over the bandwidth of a STREAM-style triad (a = b + s c, float32, torch's
threads), measured in the same run before and after every timing, the best of them kept (a share
is then a lower bound on a shared machine).

    python -m benchmarks.host_step_bench --json                 # 2^26 parameters
    python -m benchmarks.host_step_bench --params 1048576 --reps 1   # a few seconds

Per moment type: seconds per 10^9 parameters, bytes per parameter, and the share of the triad
bandwidth reached (bytes x params / seconds / triad). `accumulate`: the same for
optimizer.cpu_offload's gradient accumulation (a bf16 gradient added into a bfloat16 or float32
host accumulator, host_step.accumulate beside torch's add_), with each accumulator's relative
error after 32 micro-batches against the float64 sum. --out writes host_step.json there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

from lisaft.config.schema import OptimizerSection
from lisaft.optim import host_step
from lisaft.optim.adamw import BLOCKSIZE, Rounding
from lisaft.optim.build import build_unit_optimizer

REPO = Path(__file__).resolve().parents[1]

# Bytes one parameter moves: the bf16 weight read and written, the bf16 gradient read, each
# moment read and written (8-bit: plus two float32 absmax per 256-element block, read and written).
BYTES = {"float32": 2 + 2 + 2 + 2 * 4 * 2, "bfloat16": 2 + 2 + 2 + 2 * 2 * 2,
         "8bit": 2 + 2 + 2 + 2 * 1 * 2 + 2 * 4 * 2 / BLOCKSIZE}
SETUPS = {"float32": ("adamw_32bit", "float32"), "bfloat16": ("adamw_32bit", "bfloat16"),
          "8bit": ("adamw_8bit", "float32")}


def best(fn, reps: int) -> float:
    fn()  # warm-up: first touch of the pages, the kernel's compilation
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def triad_gbs(n: int, reps: int) -> float:
    a, b, c = torch.empty(n), torch.randn(n), torch.randn(n)
    return 3 * 4 * n / best(lambda: torch.add(b, c, alpha=3.0, out=a), reps) / 1e9


def step_seconds(moments: str, n: int, reps: int, kernel: bool) -> float:
    name, mdt = SETUPS[moments]
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter((torch.randn(n, 1, generator=gen) * 0.02).to(torch.bfloat16))  # 2-D: weight decay applies
    p.grad = (torch.randn(n, 1, generator=gen) * 1e-3).to(torch.bfloat16)
    section = OptimizerSection(name=name, lr=2e-5, weight_decay=0.01, moments_dtype=mdt)
    opt = build_unit_optimizer([p], section, torch.device("cpu"), Rounding("stochastic", 0), 0, None)
    real = host_step.available
    host_step.available = (lambda: True) if kernel else (lambda: False)
    try:
        return best(opt.step, reps)
    finally:
        host_step.available = real


# optimizer.cpu_offload's accumulation, a later micro-batch's bf16 gradient added into its host
# accumulator: the gradient read, the accumulator read and written.
ACCUMULATORS = {"bfloat16": (torch.bfloat16, 2 + 2 * 2), "float32": (torch.float32, 2 + 2 * 4)}
ERROR_MICRO_BATCHES = 32  # the shipped 8B recipe's grad_accum_steps


def accumulate_seconds(dtype: torch.dtype, n: int, reps: int, kernel: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    acc = (torch.randn(n, generator=gen) * 1e-3).to(dtype)
    g = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    return best((lambda: host_step.accumulate(acc, g)) if kernel else (lambda: acc.add_(g)), reps)


def accumulation_error(dtype: torch.dtype, n: int = 1 << 20) -> float:
    """Relative L2 error of ERROR_MICRO_BATCHES bf16 gradients (one direction plus noise of the
    same size, as micro-batches' gradients are) summed in `dtype`, against their float64 sum."""
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(n, generator=gen, dtype=torch.float64)
    acc, exact = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=torch.float64)
    for _ in range(ERROR_MICRO_BATCHES):
        g = ((mean + torch.randn(n, generator=gen, dtype=torch.float64)) * 1e-3).to(torch.bfloat16)
        host_step.accumulate(acc, g)
        exact += g.double()
    return float((acc.double() - exact).norm() / exact.norm())


def _share(nbytes: float, n: int, t: float, triad: float) -> dict:
    return {"s_per_1e9_params": round(t / n * 1e9, 3), "share_of_triad": round(nbytes * n / t / 1e9 / triad, 3)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=1 << 26)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", type=Path, help="write host_step.json into this folder")
    args = ap.parse_args(argv)
    if not host_step.available():
        raise SystemExit("numba is not installed: pip install 'lisaft[host-step]'")
    n = args.params
    load_before = os.getloadavg()[0]
    # The triad before and after every timing, its best kept: on a shared machine one
    # measurement can land in a busy moment, and the best one makes every share a lower bound.
    triads = [triad_gbs(n, args.reps)]
    seconds = {}
    for moments in BYTES:
        for path, kernel in (("kernel", True), ("torch", False)):
            if moments == "bfloat16" and not kernel:
                continue  # today's path has no bf16 moments
            seconds[moments, path] = step_seconds(moments, n, args.reps, kernel)
            triads.append(triad_gbs(n, args.reps))
    for acc in ACCUMULATORS:
        for path, kernel in (("kernel", True), ("torch", False)):
            seconds["accumulate", acc, path] = accumulate_seconds(ACCUMULATORS[acc][0], n, args.reps, kernel)
            triads.append(triad_gbs(n, args.reps))
    triad = max(triads)
    accumulate = {}
    for acc, (dtype, nbytes) in ACCUMULATORS.items():
        kernel_row = _share(nbytes, n, seconds["accumulate", acc, "kernel"], triad)
        accumulate[acc] = {"bytes_per_param": nbytes, **kernel_row,
                           "torch": _share(nbytes, n, seconds["accumulate", acc, "torch"], triad),
                           f"rel_error_{ERROR_MICRO_BATCHES}_micro_batches": float(f"{accumulation_error(dtype):.3g}")}
    rows = {}
    for moments in BYTES:
        row: dict = {"bytes_per_param": round(BYTES[moments], 2)}
        for path in ("kernel", "torch"):
            t = seconds.get((moments, path))
            row[path] = None if t is None else _share(BYTES[moments], n, t, triad)
        rows[moments] = row
    result = {"params": n, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "machine": platform.processor() or platform.machine(), "load_avg_1min_before": round(load_before, 2),
              "load_avg_1min": round(os.getloadavg()[0], 2),
              "triad_gb_s": round(triad, 2),
              "triad_gb_s_all": [round(t, 2) for t in triads], "moments": rows, "accumulate": accumulate}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_step.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1) if args.json else _table(result))
    return result


def _table(r: dict) -> str:
    lines = [f"triad {r['triad_gb_s']} GB/s, {r['threads']} threads, load {r['load_avg_1min']}",
             "moments   B/param  kernel s/1e9 (share)  torch s/1e9 (share)"]
    for m, row in r["moments"].items():
        cells = [f"{row[p]['s_per_1e9_params']} ({row[p]['share_of_triad']:.0%})" if row[p] else "-"
                 for p in ("kernel", "torch")]
        lines.append(f"{m:9} {row['bytes_per_param']:7}  {cells[0]:21} {cells[1]}")
    lines.append("accumulator B/param  kernel s/1e9 (share)  torch s/1e9 (share)  rel. error")
    for a, row in r["accumulate"].items():
        cells = [f"{x['s_per_1e9_params']} ({x['share_of_triad']:.0%})" for x in (row, row["torch"])]
        error = row[f"rel_error_{ERROR_MICRO_BATCHES}_micro_batches"]
        lines.append(f"{a:11} {row['bytes_per_param']:7}  {cells[0]:21} {cells[1]:20} {error}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
