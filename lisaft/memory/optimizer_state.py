"""Optimizer state bytes per parameter tensor, following the optimizers' own allocation rules.

adamw_32bit keeps two float32 moments whatever the weight dtype (8 B/param); every optimizer
keeps its step count as a Python int (lisaft/optim/adamw.py), nothing on the device. The bitsandbytes
optimizers (bitsandbytes/optim/optimizer.py, Optimizer2State):
- 32-bit (PagedAdamW): two float32 moments, 8 B/param, whatever the weights' dtype.
- 8-bit (AdamW8bit, PagedAdamW8bit): tensors under min_8bit_size = 4096 elements keep float32
  moments (8 B/param); larger ones keep two uint8 moments (2 B/param) plus one float32 absmax
  per 256-element block per moment, and share two 256-entry float32 quantization maps.
- Paging (on CUDA only): a moment buffer is allocated in CUDA unified memory when its tensor has
  at least 1e5 elements; smaller buffers and every absmax stay ordinary device allocations.

How a step runs (lisaft/optim/adamw.py) decides its transient memory, not its state, and this module
takes those rules from there (`holds_chunk_buffers`, the chunk size and the bitsandbytes
thresholds) rather than restating them: a float32 weight with a dense gradient steps in place;
bf16 weights take their update through float32 chunks (stochastic rounding by default, `nearest`
for comparison), whichever optimizer keeps the moments. A chunk holds at most 4,194,304
elements, so the step's extra buffers are bounded (48 MiB) whatever the tensor's size.
"""

from __future__ import annotations

from dataclasses import dataclass

from lisaft.config.optimizers import optimizer_kind
from lisaft.optim.adamw import (
    BLOCKSIZE,
    CHUNK,
    CHUNK_BYTES_PER_ELEMENT,
    MIN_8BIT_NUMEL,
    PAGED_MIN_NUMEL,
    holds_chunk_buffers,
)
from lisaft.optim.adamw import QUANTIZATION_MAP_BYTES as QMAP_BYTES


@dataclass(frozen=True)
class StateBytes:
    total: int
    paged: int  # the part in CUDA unified memory (0 off CUDA)


def tensor_state(optimizer: str, numel: int, dt: int, device: str, moment_bytes: int = 4) -> StateBytes:
    """State bytes for one parameter tensor of `numel` elements and dtype size `dt`;
    `moment_bytes` 2 for adamw_32bit's optimizer.moments_dtype bfloat16 (on the CPU only)."""
    paging = optimizer_kind(optimizer).paged and device == "cuda" and numel >= PAGED_MIN_NUMEL
    if optimizer_kind(optimizer).own_adamw:
        return StateBytes(2 * numel * moment_bytes, 0)
    if optimizer_kind(optimizer).eight_bit and numel >= MIN_8BIT_NUMEL:
        blocks = -(-numel // BLOCKSIZE)
        moments = 2 * numel
        return StateBytes(moments + 2 * 4 * blocks, moments if paging else 0)
    moments = 2 * 4 * numel
    return StateBytes(moments, moments if paging else 0)


def state_bytes(optimizer: str, numels, dt: int, device: str, moment_bytes: int = 4) -> StateBytes:
    """State for a set of parameter tensors, the shared quantization maps included once."""
    total = paged = 0
    quantized = False
    for n in numels:
        s = tensor_state(optimizer, n, dt, device, moment_bytes)
        total += s.total
        paged += s.paged
        quantized |= optimizer_kind(optimizer).eight_bit and n >= MIN_8BIT_NUMEL
    if quantized:
        total += QMAP_BYTES
    return StateBytes(total, paged)


# The float32 update runs over at most this many elements at a time (lisaft/optim/adamw.py): a float32
# copy of the weight chunk, the float32 gradient chunk and int32 rounding noise, 12 B/element.
UPDATE_CHUNK_ELEMENTS = CHUNK
UPDATE_CHUNK_BYTES_PER_ELEMENT = CHUNK_BYTES_PER_ELEMENT


def step_temporaries(optimizer: str, largest_numel: int, dt: int, device: str,
                     bf16_update: str = "stochastic", sparse_numel: int = 0) -> int:
    """Extra bytes on the training device while one unit is being stepped.

    The chunked float32 update holds one chunk's buffers, `12 x min(n_max, 4,194,304)` bytes
    (48 MiB at most), for as long as a unit is stepped. On CUDA the bitsandbytes kernels
    otherwise update in place. On CPU, bitsandbytes' reference implementation
    (bitsandbytes/backends/cpu/ops.py) works one tensor at a time in float32: 32-bit holds the
    float32 gradient, sqrt and denominator and the update (12 B/elem); 8-bit holds both
    dequantized moments, the float32 gradient, sqrt and denominator (20 B/elem); either adds a
    float32 copy of a non-float32 parameter. So the largest trainable tensor sets the peak."""
    chunk = 0
    if holds_chunk_buffers(dt):
        chunk = min(largest_numel, UPDATE_CHUNK_ELEMENTS) * UPDATE_CHUNK_BYTES_PER_ELEMENT
    elif sparse_numel and holds_chunk_buffers(dt, sparse_grad=True):
        chunk = min(sparse_numel, UPDATE_CHUNK_ELEMENTS) * 4  # one float32 chunk of the densified rows
    if device == "cuda" or optimizer_kind(optimizer).own_adamw:
        return chunk
    per_elem = 20 if optimizer_kind(optimizer).eight_bit else 12
    if dt != 4:
        per_elem += 4
    return max(chunk, largest_numel * per_elem)
