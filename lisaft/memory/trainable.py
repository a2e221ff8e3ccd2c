"""Which tensors train, and which keep optimizer state on the device, for a set of settings.

Counts may be whole tensors or one rank's slices (ParamCounts.sharded): the rules are the same."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lisaft.memory.activations import Shape
from lisaft.memory.counts import ParamCounts
from lisaft.model.load import sparse_grad_is_smaller

if TYPE_CHECKING:
    from lisaft.memory.settings import Settings


def trained_layers(counts: ParamCounts, s: Settings) -> list[int]:
    """The decoder layers that train, in the model's order. Under LISA the γ largest layers stand
    for the sampled set (all layers are alike in the families lisaft knows, so this is exact there
    and an upper bound elsewhere)."""
    if not s.recipe.lisa.enabled:
        return list(range(counts.layer_count))
    gamma = min(s.active_layers, counts.layer_count)
    return sorted(sorted(range(counts.layer_count), key=counts.layer_params, reverse=True)[:gamma])


def layers_with_state(counts: ParamCounts, s: Settings) -> list[int]:
    """Decoder layers whose moments are on the device. Under LISA's `keep` policy (and offload_cpu
    when the device is the CPU, where host memory is the same memory) the moments of every layer
    ever sampled stay: after enough intervals that is every layer."""
    lisa = s.recipe.lisa
    if lisa.enabled and (lisa.state_policy == "keep" or (lisa.state_policy == "offload_cpu" and s.device == "cpu")):
        return list(range(counts.layer_count))
    return trained_layers(counts, s)


def end_numels(counts: ParamCounts, s: Settings) -> list[int]:
    """Numels of the trainable tensors outside the decoder layers: embeddings, then head."""
    return (list(counts.embeddings) if s.embeddings_train else []) + (list(counts.head) if s.head_trains else [])


def _in_model_order(counts: ParamCounts, s: Settings, layers: list[int]) -> list[int]:
    # In the model's order (embeddings, layers, head): cpu_offload packs host memory in it.
    numels = list(counts.embeddings) if s.embeddings_train else []
    numels += [n for i in layers for n in counts.layers[i]]
    return numels + (list(counts.head) if s.head_trains else [])


def trainable_numels(counts: ParamCounts, s: Settings) -> tuple[list[int], int]:
    """Numels of the trainable tensors, and how many decoder layers train."""
    layers = trained_layers(counts, s)
    return _in_model_order(counts, s, layers), len(layers)


def state_numels(counts: ParamCounts, s: Settings, trainable: list[int]) -> list[int]:
    """Tensors whose optimizer state is on the device (layers_with_state's rule)."""
    layers = layers_with_state(counts, s)
    if len(layers) == len(trained_layers(counts, s)):
        return trainable
    return _in_model_order(counts, s, layers)


def sparse_embedding_saving(counts: ParamCounts, shape: Shape, s: Settings, dt: int) -> int:
    """Gradient bytes saved when the input embedding's gradient is sparse (lisaft.model.load.
    use_sparse_embedding_grad): its dense vocab x hidden matrix is replaced by a row and an int64
    index per token of the step, twice while repeated rows are summed. Never under FSDP (a
    rank's gradient is a dense slice) nor data parallel (lisaft.model.load.use_sparse_embedding_grad)."""
    if s.fsdp:
        return 0
    r = s.recipe
    tokens = s.sequences * r.data.max_seq_len * r.training.grad_accum_steps
    if not (r.model.sparse_embedding_grad and s.embeddings_train and not counts.tied and counts.embeddings
            and sparse_grad_is_smaller(shape.vocab, tokens)):
        return 0
    return counts.embeddings[0] * dt - 2 * tokens * (shape.hidden * dt + 8)
