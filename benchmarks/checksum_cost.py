"""What the checkpoint's per-file checksums (xxh3-64, lisaft/checkpoint/checkpointer.py) cost next
to writing the file: save a bf16 tensor of --mib MiB with safetensors (fsynced, as a checkpoint
is), then checksum it; print both rates and the extrapolation to Llama-3.1-8B's checkpoint
(bf16 weights, 16.06 GB; the optimizer files of LISA's trained units besides).

    python -m benchmarks.checksum_cost --mib 256
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lisaft.checkpoint.checkpointer import file_checksum

WEIGHTS_8B = 8_030_261_248 * 2  # bytes of Llama-3.1-8B's bf16 weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    t = torch.randn(args.mib * 2**19).to(torch.bfloat16)  # 2 bytes per element
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "w.safetensors"
        start = time.perf_counter()
        save_file({"w": t}, str(path))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        file_checksum(path)
        sum_s = time.perf_counter() - start
        size = path.stat().st_size
    out = {"mib": args.mib, "write_gb_s": size / write_s / 1e9, "checksum_gb_s": size / sum_s / 1e9,
           "checksum_over_write": sum_s / write_s,
           "8b_write_s": WEIGHTS_8B / (size / write_s), "8b_checksum_s": WEIGHTS_8B / (size / sum_s)}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
