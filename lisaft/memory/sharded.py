"""training.fsdp, per rank: what FSDP2 adds to a rank's memory beside its slices.

lisaft/distributed/fsdp.py makes each decoder layer one FSDP unit and leaves the rest to the root: the
embeddings and the head (output projection and final norm), which the chunked loss needs
gathered from the forward to the end of backward. Each rank
keeps its slices (ParamCounts.sharded) of the weights, of the trainable gradients and of their
moments; the rest is transient and follows torch's FSDP2 (torch/distributed/fsdp/_fully_shard/,
torch 2.13), read rather than guessed:

- Gathering (`gathered_units`): a unit's whole weights, in their own dtype (lisaft sets no
  param_dtype), exist around its forward and backward. In backward the next unit's all-gather
  is prefetched when a unit's backward starts (FSDPParamGroup._backward_prefetch), so two
  layers are gathered at once. The root is not resharded after forward (fully_shard's default
  for the root), so the embeddings and the head stay gathered from the forward to the end of
  backward. Gathered tensors are padded to a multiple of the ranks on dim 0.
- The root's gradients: the head's is made at the loss's backward and the embeddings' at the end
  of backward, both whole, in the weights' dtype, until the root's one reduce-scatter after
  backward.
- Reducing (`gradient_reduce`): autograd makes a unit's whole gradient in the weights' dtype;
  foreach_reduce copies it into a float32 buffer of the unit's padded size (reduce_dtype=float32),
  frees it, reduce-scatters into a float32 slice and casts that slice back to the weights' dtype,
  which is the gradient a rank keeps (`gradients`). The float32 input buffer outlives the call:
  it is freed only at the next unit's post-backward (reduce_scatter_max_input_buffers = 1), so a
  layer's backward runs beside the previous trainable unit's float32 buffer. The buffers are
  released at the end of every backward (the root's final callback), none between micro-batches.
- Frozen units (LISA) are gathered like the others but make no gradient and no reduce-scatter.
- Loading: weights from model.name_or_path never exist whole on a rank: the model is built on
  the meta device, sharded, and each rank allocates and reads only its slices (lisaft/distributed/fsdp.py
  load_sharded), so the set-up holds no more than the step's slices. A random init from
  model.config is built whole on every rank's device and then sharded, so that it equals the
  one-process init: that rank holds the whole model once, at set-up (`unsharded_load`, the
  `model_load` moment).
- The optimizer step runs on the slices; lisaft's global norm (LocalShards.clip_grad_norm) takes
  a float32 copy of each slice and its square, one slice at a time.

Not modelled: NCCL's own buffers and the separate CUDA streams' allocator pools of a multi-GPU
run (nothing here has run on several GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

from lisaft.memory.counts import ParamCounts

FP32 = 4


@dataclass(frozen=True)
class Units:
    """Gathered (padded) element counts of the FSDP units, and which of them train."""

    root: int            # embeddings and head, gathered together
    layer: int           # the largest decoder layer
    root_loss_grad: int  # root elements whose gradient the loss's backward makes (the head's)
    root_grad: int       # root elements with a gradient by the end of backward
    layers_train: bool


def fsdp_units(counts: ParamCounts, s) -> Units:
    """The units of a model with these counts under settings `s` (memory/settings.py)."""
    gathered = counts.gathered(s.ranks)
    embeddings, head = sum(gathered.embeddings), sum(gathered.head)
    head_trains, embeddings_train = s.head_trains, s.embeddings_train
    # A head tied to the embeddings is the embeddings' matrix (counted there): its gradient is
    # made at the loss's backward.
    loss_grad = (head if head_trains else 0) + (embeddings if counts.tied and (head_trains or embeddings_train) else 0)
    end_grad = loss_grad + (embeddings if embeddings_train and not counts.tied else 0)
    return Units(root=embeddings + head, layer=max((sum(layer) for layer in gathered.layers), default=0),
                 root_loss_grad=loss_grad, root_grad=end_grad, layers_train=True)


def _reduce_scatter(numel: int, dt: int, ranks: int) -> int:
    """A unit's post-backward: its float32 input buffer, beside first the whole gradient in the
    weights' dtype (freed after the copy-in) and then the float32 output slice."""
    return FP32 * numel + max(dt * numel, FP32 * numel // ranks)


def _heavier(*moments: tuple[int, int]) -> tuple[int, int]:
    return max(moments, key=sum)


def fsdp_phases(u: Units, dt: int, ranks: int) -> dict[str, tuple[int, int]]:
    """(gathered_units, gradient_reduce) bytes at each moment of a step, for the estimator's
    phases, and "root_backward": the end of backward, when the root's gradients are reduced."""
    w = dt
    # The previous layer's float32 reduce-scatter input, still held during a layer's backward.
    held = FP32 * u.layer if u.layers_train else 0
    layer_grad = dt * u.layer if u.layers_train else 0
    loss_grad = dt * u.root_loss_grad
    out = {
        # The loss's backward: the root gathered since forward, the last layer prefetched.
        "loss_backward": (w * (u.root + u.layer), loss_grad),
        # A layer's backward beside the prefetched one, or its own reduce-scatter once resharded.
        "layer_backward": _heavier((w * (u.root + 2 * u.layer), loss_grad + layer_grad + held),
                                   (w * (u.root + u.layer),
                                    loss_grad + (_reduce_scatter(u.layer, dt, ranks) if u.layers_train else 0))),
        "optimizer_step": (0, 0),
    }
    if u.root_grad:
        out["root_backward"] = _heavier((w * u.root, dt * u.root_grad + held),
                                        (0, _reduce_scatter(u.root_grad, dt, ranks)))
    return out


def clip_temporaries(largest_slice: int, dt: int) -> int:
    """LocalShards.clip_grad_norm: `g.float().pow(2)` on the largest slice (no copy in float32)."""
    return FP32 * largest_slice * (1 if dt == FP32 else 2)
