"""Memory budgets: byte sizes with explicit units, and the usable memory of common GPUs.

GPU makers write "24 GB" for a card whose memory is 24 GiB of chips, of which the driver shows
a little less. A budget is therefore never a bare number here: `24GB` means 24 x 10^9 bytes,
`24GiB` 24 x 2^30 bytes (7.4% more), and `--gpu rtx-4090` the memory the driver reports for that
card. The CUDA context that a process adds on top is a component of the estimate itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lisaft.errors import LisaftError

MiB = 1024**2

# K/M/G/T alone are binary, as in `free -g` and container memory limits.
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


@dataclass(frozen=True)
class Gpu:
    name: str
    usable_bytes: int
    source: str


# The driver keeps part of the memory nvidia-smi calls memory.total for itself ("Reserved" in
# `nvidia-smi -q -d MEMORY`); torch.cuda.get_device_properties(0).total_memory, what a process
# can allocate, is memory.total minus that. Measured on an H200 (driver 580.159): memory.total
# 143771 MiB, reserved 616 MiB, torch total_memory 143156 MiB. The same reserve is assumed for
# the other cards, whose memory.total is as commonly reported for them (not measured by lisaft).
DRIVER_RESERVE_BYTES = 616 * MiB


def _card(name: str, total_mib: int, datasheet: str) -> Gpu:
    return Gpu(name, total_mib * MiB - DRIVER_RESERVE_BYTES,
               f"{datasheet}; nvidia-smi memory.total {total_mib} MiB as commonly reported, minus "
               f"the driver's reserve (616 MiB, measured on an H200)")


GPUS = {g.name: g for g in (
    _card("rtx-3090", 24576, "RTX 3090, 24 GB GDDR6X"),
    _card("rtx-4090", 24564, "RTX 4090, 24 GB GDDR6X"),
    _card("a6000", 49140, "RTX A6000, 48 GB GDDR6, ECC off (its default; 46068 MiB with ECC on)"),
    _card("l4", 23034, "L4, 24 GB GDDR6 with ECC on (its default), which reserves 1/16"),
    _card("a100-40gb", 40960, "A100 SXM4 40 GB HBM2 (the PCIe card reports 40536 MiB)"),
    _card("a100-80gb", 81920, "A100 SXM4 80 GB HBM2e (the PCIe card reports 81251 MiB)"),
    _card("h100-80gb", 81559, "H100 SXM5 80 GB HBM3"),
    Gpu("h200", 143156 * MiB, "H200, 141 GB HBM3e; torch total_memory 143156 MiB, measured by lisaft "
        "(nvidia-smi memory.total 143771 MiB, driver reserve 616 MiB, driver 580.159)"),
)}


def gpu(name: str) -> Gpu:
    found = GPUS.get(name.lower().replace("_", "-"))
    if found is None:
        raise LisaftError(f"--gpu: {name!r} is not in the catalogue; known: {', '.join(GPUS)}; or give "
                          "--budget with a unit, e.g. 24GB or 24GiB")
    return found


def smallest_gpu(nbytes: int) -> Gpu | None:
    return next((g for g in sorted(GPUS.values(), key=lambda g: g.usable_bytes) if g.usable_bytes >= nbytes), None)


def parse_bytes(text: str, key: str = "--budget") -> int:
    """'24GB' (10^9), '24GiB' or '24G' (2^30), '1.5 TiB', '512MB'. A bare number is refused:
    bytes are never what was meant, and GB or GiB changes a 24 GB budget by 1.7 GB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    if not m:
        raise LisaftError(f"{key}: {text!r} is not a size such as 24GB or 24GiB")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        n = m.group(1)
        # Only a GPU budget can be a catalogue card; host RAM is not.
        cards = f"; or name a card with --gpu ({', '.join(GPUS)})" if key == "--budget" else ""
        raise LisaftError(f"{key}: {text!r} needs a unit: {n}GB means {n} x 10^9 bytes (as memory makers "
                          f"write it), {n}GiB {n} x 2^30 bytes{cards}")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise LisaftError(f"{key}: must be positive")
    return value


def explain_budget(nbytes: int, given: str) -> str:
    """'24GB = 22.35 GiB' style line: both units, so neither reading is a surprise."""
    return f"{given} = {nbytes / 1000**3:.2f} GB = {nbytes / 1024**3:.2f} GiB (1 GB = 10^9 bytes, 1 GiB = 2^30)"
