"""Which tensors train, and which keep optimizer state on the device, for a set of settings.

Counts may be whole tensors or one rank's slices (ParamCounts.sharded): the rules are the same."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lisaft.memory.activations import Shape
from lisaft.memory.counts import ParamCounts
from lisaft.model.load import sparse_grad_is_smaller

if TYPE_CHECKING:
    from lisaft.memory.estimate import Settings


def trainable_numels(counts: ParamCounts, s: Settings) -> tuple[list[int], int]:
    """Numels of the trainable tensors, and how many decoder layers train.

    Under LISA the γ largest layers stand for the sampled set (all layers are alike in the
    families lisaft knows, so this is exact there and an upper bound elsewhere)."""
    if not s.lisa:
        layers = list(range(counts.layer_count))
    else:
        gamma = min(s.active_layers, counts.layer_count)
        layers = sorted(range(counts.layer_count), key=counts.layer_params, reverse=True)[:gamma]
    # In the model's order (embeddings, layers, head): cpu_offload packs host memory in it.
    numels = list(counts.embeddings) if not s.lisa or s.train_embeddings else []
    numels += [n for i in sorted(layers) for n in counts.layers[i]]
    if not s.lisa or s.train_head:
        numels += counts.head
    return numels, len(layers)


def state_numels(counts: ParamCounts, s: Settings, trainable: list[int]) -> list[int]:
    """Tensors whose optimizer state is on the device. Under LISA's `keep` policy (and
    offload_cpu when the device is the CPU, where host memory is the same memory) the moments
    of every layer ever sampled stay: after enough intervals that is every layer."""
    if s.lisa and (s.state_policy == "keep" or (s.state_policy == "offload_cpu" and s.device == "cpu")):
        numels = [n for layer in counts.layers for n in layer]
        if s.train_embeddings:
            numels += counts.embeddings
        if s.train_head:
            numels += counts.head
        return numels
    return trainable


def sparse_embedding_saving(counts: ParamCounts, shape: Shape, s: Settings, dt: int) -> int:
    """Gradient bytes saved when the input embedding's gradient is sparse (lisaft.model.load.
    use_sparse_embedding_grad): its dense vocab x hidden matrix is replaced by a row and an int64
    index per token of the step, twice while repeated rows are summed. Never under FSDP (a
    rank's gradient is a dense slice) nor data parallel (lisaft.model.load.use_sparse_embedding_grad)."""
    if s.fsdp:
        return 0
    tokens = s.batch_size * s.seq_len * s.grad_accum_steps
    trains = not s.lisa or s.train_embeddings
    if not (s.sparse_embedding_grad and trains and not counts.tied and counts.embeddings
            and sparse_grad_is_smaller(shape.vocab, tokens)):
        return 0
    return counts.embeddings[0] * dt - 2 * tokens * (shape.hidden * dt + 8)
