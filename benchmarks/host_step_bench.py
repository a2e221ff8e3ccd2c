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
bandwidth reached (bytes x params / seconds / triad). --out writes host_step.json there.
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
    triad = max(triads)
    rows = {}
    for moments in BYTES:
        row: dict = {"bytes_per_param": round(BYTES[moments], 2)}
        for path in ("kernel", "torch"):
            t = seconds.get((moments, path))
            row[path] = None if t is None else {"s_per_1e9_params": round(t / n * 1e9, 2),
                                                "share_of_triad": round(BYTES[moments] * n / t / 1e9 / triad, 3)}
        rows[moments] = row
    result = {"params": n, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "machine": platform.processor() or platform.machine(), "load_avg_1min": round(os.getloadavg()[0], 2),
              "triad_gb_s": round(triad, 2),
              "triad_gb_s_all": [round(t, 2) for t in triads], "moments": rows}
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
    return "\n".join(lines)


if __name__ == "__main__":
    main()
