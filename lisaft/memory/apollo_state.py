"""Optimizer state and step transients of apollo and apollo_mini (lisaft/optim/apollo.py).

State, per tensor with state on the device:
- a decoder matrix (m x n): two float32 moments of r' x max(m, n), r' = min(rank, m, n), and the
  limiter's previous norm (one float32);
- everything else (embeddings, head, norms, biases): adamw_8bit's state (2 B/param from 4096
  elements, 8 B/param below), with its shared quantization maps.
The projection P is drawn afresh each step and freed, so it is a transient, not state.

Transients while one matrix steps: P (r' x min(m, n)), R, the bias-corrected denominator and R̃
(three r' x max(m, n)), the channel norms and factors (three max(m, n) vectors), all float32, and
one chunk of at most CHUNK elements of float32 copies (12 B/element with bf16 weights: weight,
gradient, rounding noise; 4 B/element with float32 weights: the squared gradient). The other
tensors step as adamw_8bit's do; a unit steps one tensor at a time, so the larger of the two counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lisaft.config.optimizers import optimizer_kind
from lisaft.memory.counts import ParamCounts
from lisaft.memory.optimizer_state import StateBytes, state_bytes, step_temporaries
from lisaft.memory.trainable import end_numels, layers_with_state
from lisaft.optim.adamw import CHUNK, CHUNK_BYTES_PER_ELEMENT
from lisaft.optim.apollo import ApolloSettings

if TYPE_CHECKING:
    from lisaft.memory.settings import Settings


def is_apollo(optimizer: str) -> bool:
    return optimizer_kind(optimizer).projected


def rank_of(s: Settings) -> int:
    return optimizer_kind(s.recipe.optimizer.name).rank or ApolloSettings.of(s.recipe.optimizer).rank


def _rest(s: Settings) -> str:
    """The optimizer whose rule the tensors apollo does not project follow."""
    name = s.recipe.optimizer.name
    rest = optimizer_kind(name).rest
    assert rest is not None, f"{name} projects no tensor"  # is_apollo(name) holds here
    return rest


def _matrices(counts: ParamCounts, layers: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """(the projected matrices' (rows, columns), the numels of the layers' other tensors)."""
    matrices, rest = [], []
    for i in layers:
        for n, rows in zip(counts.layers[i], counts.layer_rows[i]):
            cols = n // max(rows, 1)
            if rows > 1 and cols > 1:
                matrices.append((rows, cols))
            else:
                rest.append(n)
    return matrices, rest


def apollo_state(counts: ParamCounts, s: Settings, dt: int) -> StateBytes:
    matrices, rest = _matrices(counts, layers_with_state(counts, s))
    r = rank_of(s)
    projected = sum(2 * 4 * min(r, m, n) * max(m, n) + 4 for m, n in matrices)
    other = state_bytes(_rest(s), rest + end_numels(counts, s), dt, s.device)
    return StateBytes(projected + other.total, 0)


def projected_step_bytes(m: int, n: int, rank: int, dt: int) -> int:
    """Transient bytes while one m x n matrix takes an APOLLO step (the module docstring)."""
    r, a, b = min(rank, m, n), min(m, n), max(m, n)
    chunk = min(m * n, CHUNK) * (CHUNK_BYTES_PER_ELEMENT if dt != 4 else 4)
    return 4 * (r * a + 3 * r * b + 3 * b) + chunk


def apollo_step_temporaries(counts: ParamCounts, s: Settings, dt: int, sparse_numel: int = 0) -> int:
    matrices, rest = _matrices(counts, layers_with_state(counts, s))
    projected = max((projected_step_bytes(m, n, rank_of(s), dt) for m, n in matrices), default=0)
    largest_other = max(rest + end_numels(counts, s), default=0)
    return max(projected, step_temporaries(_rest(s), largest_other, dt, s.device, s.recipe.optimizer.bf16_update,
                                           sparse_numel))
