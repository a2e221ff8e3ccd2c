"""Host memory of `optimizer.cpu_offload` (lisaft/optim/cpu_offload.py), component by component.

With the optimizer on the CPU the host holds, for the run's whole length:
- moments: the unit optimizers' state, as on a device, never paged (paging is a CUDA feature);
- host_weights: a copy of every parameter in the model dtype, the tensors the CPU step updates
  (pinned, so the copies back to the device run asynchronously), in power-of-two slabs
  (lisaft/optim/host_arena.py), packed in the model's order;
- gradient_accumulators: one per trainable tensor in the model dtype, pinned, in slabs packed
  in the order backward completes the gradients (taken here as the reverse of the model's
  order); a sparse embedding gradient stays sparse, a row and an index per token;
- staging: STAGING_SLOTS pinned buffers of at most 256 MiB, where later micro-batches'
  gradients land, piece by piece, before they are added into the accumulators;
- step_temporaries: the CPU step's float32 buffers (lisaft/memory/optimizer_state.py) for one
  chunk: lisaft hands the CPU kernels, bitsandbytes' included, one chunk of a tensor at a time;
- process_baseline: the Python process with torch and transformers.
Offloaded activation checkpoints (model.offload_activations) are counted beside these, pinned;
so are the layer-major backward's saved layer inputs (layer_inputs: one group's,
lisaft/memory/layer_major.py).
"""

from __future__ import annotations

from lisaft.memory.optimizer_state import (
    UPDATE_CHUNK_ELEMENTS,
    state_bytes,
    step_temporaries,
)
from lisaft.optim.host_arena import arena_bytes, slab_size
from lisaft.optim.transfers import STAGING_SLOTS, staging_slot_bytes

HOST_COMPONENTS = ("moments", "host_weights", "gradient_accumulators", "staging", "step_temporaries",
                   "activation_checkpoints", "layer_inputs", "process_baseline")
PINNED = ("host_weights", "gradient_accumulators", "staging", "activation_checkpoints", "layer_inputs")


def offload_host_bytes(optimizer: str, state_numels: list[int], all_numels: list[int], trainable_numels: list[int],
                       dt: int, bf16_update: str, activation_host_bytes: int, process_baseline: int,
                       sparse_numel: int = 0, sparse_bytes: int = 0, moment_bytes: int = 4,
                       layer_inputs: int = 0) -> dict[str, int]:
    """Bytes of each host component (HOST_COMPONENTS) for a run with the optimizer on the CPU.
    Numels are in the model's order; `sparse_numel` names the trainable tensor (the input
    embedding) whose gradient is sparse, `sparse_bytes` that gradient's size."""
    largest_chunk = min(max(trainable_numels, default=0), UPDATE_CHUNK_ELEMENTS)
    slab = slab_size(max(all_numels, default=0) * dt, sum(all_numels) * dt)
    dense = list(trainable_numels)
    if sparse_numel:
        dense.remove(sparse_numel)
    return {
        "moments": state_bytes(optimizer, state_numels, dt, "cpu", moment_bytes).total,
        "host_weights": arena_bytes([n * dt for n in all_numels], slab),
        "gradient_accumulators": arena_bytes([n * dt for n in reversed(dense)], slab) + sparse_bytes,
        "staging": STAGING_SLOTS * staging_slot_bytes(max(all_numels, default=0) * dt),
        # One float32 norm per tensor for the clipping, beside the chunk buffers.
        "step_temporaries": step_temporaries(optimizer, largest_chunk, dt, "cpu", bf16_update)
        + 8 * len(trainable_numels),
        "activation_checkpoints": activation_host_bytes,
        "layer_inputs": layer_inputs,
        "process_baseline": process_baseline,
    }


def pinned_bytes(components: dict[str, int]) -> int:
    return sum(components.get(k, 0) for k in PINNED)
