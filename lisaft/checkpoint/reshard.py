"""A training.fsdp checkpoint's optimizer moments, read on another number of ranks.

FSDP shards every parameter on dim 0 as torch.chunk does: with W ranks, rank r holds the rows
[r*c, min((r+1)*c, n)) with c = ceil(n / W). Each unit optimizer keeps this rank's moments as flat
tensors over its slice (optimizer/rank-R/<unit>.pt): float32, or bitsandbytes' 8-bit blocks of 256
elements with one absmax each, for slices of at least 4096 elements. torch.distributed.checkpoint
reshards the weights (DTensors); these moments are plain tensors, so their rows move here:

- float32 moments: the new slice's rows are copied from the old slices that hold them: exact.
- 8-bit moments whose rows are whole blocks (a row length that is a multiple of 256, as in every
  real model's matrices): the bytes and the blocks' absmax are copied: exact.
- otherwise (a slice that crosses the 4096-element line, or blocks that would straddle two old
  slices): the old moments are dequantized to float32 and, for an 8-bit slice, quantized again
  in the new blocks. That costs one quantization's error, once; the resume says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lisaft.errors import LisaftError
from lisaft.optim.adamw import BLOCKSIZE, MIN_8BIT_NUMEL, MOMENT_KEYS

ABSMAX_KEYS = ("absmax1", "absmax2")  # one per moment, in MOMENT_KEYS order


def row_range(n_rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows of a dim-0 shard, as FSDP2 cuts them (torch.chunk: the last ranks may get fewer
    rows, or none)."""
    per = -(-n_rows // world)
    return min(rank * per, n_rows), min((rank + 1) * per, n_rows)


@dataclass
class ReshardNotes:
    """What a reshard did that a person should hear about."""

    requantized: int = 0   # tensors whose 8-bit moments went through float32


def read_resharded(folder: Path, unit: str, shapes: list[torch.Size], old_world: int, world: int, rank: int,
                   eight_bit: bool, notes: ReshardNotes) -> dict | None:
    """This rank's state_dict for `unit` (parameter shapes in state_dict order), assembled from
    the state each of the `old_world` ranks wrote in folder/rank-Q/<unit>.pt; None when no rank
    saved any."""
    olds = []
    for q in range(old_world):
        path = folder / f"rank-{q}" / f"{unit}.pt"
        olds.append(torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None)
    return reshard_unit_state(olds, shapes, world, rank, eight_bit, notes, unit)


def reshard_unit_state(olds: list[dict | None], shapes: list[torch.Size], world: int, rank: int,
                       eight_bit: bool, notes: ReshardNotes, unit: str = "unit") -> dict | None:
    """The same, from the old ranks' state_dicts (None where a rank saved nothing)."""
    present = [sd for sd in olds if sd is not None]
    if not present:
        return None
    state = {}
    for i, shape in enumerate(shapes):
        st = _param_state(i, shape, olds, world, rank, eight_bit, notes, unit)
        if st is not None:
            state[i] = st
    return {"state": state, "param_groups": present[0]["param_groups"]}


def _param_state(i: int, shape: torch.Size, olds: list[dict | None], world: int, rank: int,
                 eight_bit: bool, notes: ReshardNotes, unit: str) -> dict | None:
    n_rows = shape[0] if len(shape) else 1
    row_len = math.prod(shape[1:]) if len(shape) > 1 else 1
    lo, hi = row_range(n_rows, world, rank)
    pieces = []  # (old state, first row, end row) in that old slice's own rows
    for q, sd in enumerate(olds):
        qlo, qhi = row_range(n_rows, len(olds), q)
        a, b = max(lo, qlo), min(hi, qhi)
        if a < b:
            pieces.append((q, (sd or {}).get("state", {}).get(i), a - qlo, b - qlo))
    held = [p for p in pieces if p[1]]
    if not held:
        return None  # never stepped, or no rows here
    if len(held) != len(pieces):
        q = next(p[0] for p in pieces if not p[1])
        raise LisaftError(f"optimizer/rank-{q}/{unit}.pt lacks the moments of parameter {i}, which other "
                          "ranks hold; the checkpoint is inconsistent")
    steps = {int(p[1]["step"]) for p in held}
    if len(steps) != 1:
        raise LisaftError(f"optimizer state of {unit}: the ranks saved different step counts {sorted(steps)}")
    new_8bit = eight_bit and (hi - lo) * row_len >= MIN_8BIT_NUMEL
    olds_8bit = {p[1]["exp_avg"].dtype == torch.uint8 for p in held}
    st: dict = {"step": steps.pop()}
    if olds_8bit == {new_8bit} and (not new_8bit or row_len % BLOCKSIZE == 0):
        for key in MOMENT_KEYS:
            st[key] = torch.cat([s[key][a * row_len:b * row_len] for _, s, a, b in held])
        if new_8bit:
            blocks = row_len // BLOCKSIZE
            for key in ABSMAX_KEYS:
                st[key] = torch.cat([s[key][a * blocks:b * blocks] for _, s, a, b in held])
        return st
    notes.requantized += 1
    for signed, key, absmax in zip((True, False), MOMENT_KEYS, ABSMAX_KEYS):
        values = torch.cat([_float_rows(s, key, absmax, a, b, row_len, signed) for _, s, a, b in held])
        if new_8bit:
            st[key], st[absmax] = _quantize(values, signed)
        else:
            st[key] = values
    return st


def _code(signed: bool) -> torch.Tensor:
    from lisaft import internals

    return internals.dynamic_maps(torch.device("cpu"))[0 if signed else 1]


def _float_rows(st: dict, key: str, absmax: str, a: int, b: int, row_len: int, signed: bool) -> torch.Tensor:
    """Rows a:b of one old slice's moment as float32."""
    m = st[key]
    if m.dtype != torch.uint8:
        return m[a * row_len:b * row_len].float()
    import bitsandbytes.functional as F

    whole = F.dequantize_blockwise(m, absmax=st[absmax], code=_code(signed), blocksize=BLOCKSIZE)
    return whole[a * row_len:b * row_len]


def _quantize(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import bitsandbytes.functional as F

    q, qstate = F.quantize_blockwise(values, code=_code(signed), blocksize=BLOCKSIZE)
    return q, qstate.absmax.float()
