"""The sizes a training step's moments are built from (lisaft/memory/estimate.py sums them):
what stays resident (weights, moments), what the forward saves, and what each part of backward
and of the optimizer step holds. Under training.fsdp every size is one rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lisaft.memory.activations import ActivationBreakdown, Shape, activations, loss_buffers_peak, mlp_chunked
from lisaft.memory.apollo_state import apollo_state, apollo_step_temporaries, is_apollo
from lisaft.memory.counts import ParamCounts
from lisaft.memory.lora import LoraCounts, Saving, lora_counts
from lisaft.memory.optimizer_state import StateBytes, state_bytes, step_temporaries
from lisaft.memory.settings import moment_bytes
from lisaft.memory.sharded import clip_temporaries
from lisaft.memory.trainable import sparse_embedding_saving, state_numels, trainable_numels

if TYPE_CHECKING:
    from lisaft.memory.settings import Settings


@dataclass(frozen=True)
class Resident:
    """Weights, gradients and moments: their sizes, whatever moment of the step."""

    weights: int
    state: StateBytes
    trainable: list[int]  # numel of each trainable tensor (this rank's slice under FSDP)
    trainable_layers: int  # decoder layers that train
    trainable_params: int  # of the whole model, not a slice
    grads_full: int  # every trainable tensor's gradient
    sparse_saving: int  # what sparse embedding gradients save against dense ones
    largest: int  # the largest trainable tensor's numel
    offload: bool  # optimizer.cpu_offload on CUDA: moments and gradients in host memory
    local: ParamCounts  # what this process holds of what trains: a slice under FSDP, LoRA's adapters
    lora: LoraCounts | None = None  # lora.enabled: the adapters and the frozen base (memory/lora.py)


@dataclass(frozen=True)
class Backward:
    """What the forward saves and what backward and the optimizer step hold on top."""

    act: ActivationBreakdown
    offload_act: bool  # activation offload really runs (checkpointing, on CUDA)
    saved_no_logp: int  # saved activations at the start of backward
    loss_peak: int
    grads_at_loss: int
    head_grad: int  # the head's weight gradient, formed in the loss's backward (one buffer)
    grads_in_layers: int
    step_phase: int | None  # the gradients at the optimizer step; None when there is none
    layer_transient: int  # recompute, backward's temporaries and a step inside backward
    step_temp: int


def weight_bytes(counts: ParamCounts, dt: int) -> int:
    return counts.total * dt + counts.buffer_bytes_fp32 + \
        (counts.buffer_numel * 4 - counts.buffer_bytes_fp32) * dt // 4


def resident(s: Settings, counts: ParamCounts, shape: Shape, dt: int) -> Resident:
    # Under FSDP a rank holds its slice of every tensor: weights, gradients and moments follow.
    local = counts.sharded(s.ranks) if s.fsdp else counts
    # LoRA: the adapters (and the ends, when asked) are what trains; the base only weighs.
    rec = s.recipe
    lc = None
    if s.lora:
        saving = Saving(o_input_kept=s.attention != "eager" and not shape.attn_output_copy,
                        mask_bytes=1 if s.device == "cuda" else dt,
                        mlp_chunked=mlp_chunked(rec.data.max_seq_len, rec.model.mlp_chunk_tokens))
        lc = lora_counts(counts, s.config, rec, dt, saving)
        local = lc.trainable
    trainable, trainable_layers = trainable_numels(local, s)
    sparse_saving = sparse_embedding_saving(local, shape, s, dt)
    # The optimizer on the CPU: on CUDA no moment and no accumulated gradient is on the device.
    offload = rec.optimizer.cpu_offload and s.device == "cuda"
    if offload:
        state = StateBytes(0, 0)
    elif is_apollo(rec.optimizer.name):
        state = apollo_state(local, s, dt)
    else:
        state = state_bytes(rec.optimizer.name, state_numels(local, s, trainable), dt, s.device,
                            moment_bytes(rec.optimizer.moments_dtype))
    return Resident(weights=weight_bytes(local, dt) if lc is None else lc.weight_bytes, state=state,
                    trainable=trainable, trainable_layers=trainable_layers,
                    trainable_params=sum(trainable_numels(counts if lc is None else local, s)[0]),
                    grads_full=sum(trainable) * dt - sparse_saving, sparse_saving=sparse_saving,
                    largest=max(trainable) if trainable else 0, offload=offload, local=local, lora=lc)


def backward(s: Settings, counts: ParamCounts, shape: Shape, dt: int, r: Resident) -> Backward:
    rec, model = s.recipe, s.recipe.model
    batch, seq = s.sequences, rec.data.max_seq_len
    head_weight_trains = s.head_weight_trains(counts.tied)
    # On CPU the host is the device: offloading moves nothing out of the memory that counts.
    offload_act = model.offload_activations and model.gradient_checkpointing and s.device == "cuda"
    act = activations(
        shape, dt, batch, seq, s.attention, model.gradient_checkpointing,
        # LoRA: every layer's base is frozen; what its adapters keep is added below.
        trainable_layers=r.trainable_layers if r.lora is None else 0,
        train_embeddings=s.embeddings_train, head_weight_trains=head_weight_trains,
        final_norm_trains=s.head_trains, offload=offload_act, mlp_chunk_tokens=model.mlp_chunk_tokens,
        # Without packing, rows are padded to the longest in a batch (lisaft/data/collate.py).
        # Packed rows that are each one whole document (full_rows) carry no position ids
        # (data/collate.py): sdpa runs its plain causal kernel, with no mask and k, v unrepeated.
        packing=rec.data.packing and not (s.full_rows and s.attention == "sdpa"),
        padded_rows=not rec.data.packing and not s.full_rows and batch > 1,
    )
    if r.lora is not None:
        act = _with_adapters(act, r.lora, s, shape)
    loss_peak = loss_buffers_peak(shape, batch, seq, dt)
    if shape.final_softcap and act.log_probs:
        loss_peak += act.log_probs - batch * seq * (4 * shape.vocab + 8)
    # Gradient of the hidden states flowing down, and of one layer's largest intermediates.
    # A chunked MLP's intermediate gradients are one chunk's, counted in act.mlp_chunk.
    chunked = mlp_chunked(seq, model.mlp_chunk_tokens)
    backward_temp = batch * seq * dt * 2 * (shape.hidden + (0 if chunked else shape.intermediate))
    grads_at_loss, grads_in_layers, step_phase = _gradients(s, counts, dt, r, head_weight_trains)
    head_grad = _head_grad(s, counts, r.local, dt, head_weight_trains)
    recompute = (act.one_layer_full if model.gradient_checkpointing else 0) + act.mlp_chunk
    step_temp, in_bwd_step = _step_temporaries(s, counts, dt, r)
    saved_no_logp = act.layers + act.outside_layers + act.packed_mask
    if r.lora is not None:
        backward_temp += r.lora.transient
    return Backward(act=act, offload_act=offload_act, saved_no_logp=saved_no_logp,
                    loss_peak=loss_peak, grads_at_loss=grads_at_loss, head_grad=head_grad,
                    grads_in_layers=grads_in_layers,
                    step_phase=step_phase, layer_transient=recompute + backward_temp + in_bwd_step,
                    step_temp=step_temp)


def _with_adapters(act: ActivationBreakdown, lc: LoraCounts, s: Settings, shape: Shape) -> ActivationBreakdown:
    """A LoRA run's activations: frozen layers' plus what the adapters keep, in every layer or, with
    checkpointing, in the one recomputed."""
    tokens = s.sequences * s.recipe.data.max_seq_len
    one = tokens * lc.saved_per_token_layer + lc.saved_per_layer
    if s.recipe.model.gradient_checkpointing:
        return replace(act, one_layer_full=act.one_layer_full + one)
    first = 0 if s.embeddings_train else tokens * lc.first_layer_unsaved + lc.first_layer_weights_unsaved
    return replace(act, layers=act.layers + shape.layers * one - first, one_layer_full=act.one_layer_full + one)


def _gradients(s: Settings, counts: ParamCounts, dt: int, r: Resident,
               head_weight_trains: bool) -> tuple[int, int, int | None]:
    """Gradient bytes at the loss's backward, in the layers' backward, and at the optimizer step
    (None: no separate step)."""
    if s.recipe.optimizer.in_backward:
        # Each gradient is applied and freed as soon as it is complete: at most the largest
        # tensor's gradient exists at a time, and there is no separate optimizer step.
        return 0, r.largest * dt, None
    if r.offload:
        # Each gradient leaves for host memory as it is completed: the one being copied out and
        # the next one being produced; the step runs on the CPU.
        return 0, 2 * r.largest * dt, None
    grads_at_loss = r.grads_full if s.recipe.training.grad_accum_steps > 1 else 0
    return grads_at_loss, max(grads_at_loss, _head_grad(s, counts, r.local, dt, head_weight_trains)), r.grads_full


def _head_grad(s: Settings, counts: ParamCounts, local: ParamCounts, dt: int, head_weight_trains: bool) -> int:
    head_grad = sum(local.head) * dt if s.head_trains else 0
    if counts.tied and head_weight_trains and not s.fsdp:  # FSDP: in the root's gradient_reduce
        head_grad += sum(counts.embeddings[:1]) * dt
    return head_grad


def _step_temporaries(s: Settings, counts: ParamCounts, dt: int, r: Resident) -> tuple[int, int]:
    """The optimizer step's temporaries, and the part of them that runs inside backward."""
    opt = s.recipe.optimizer
    sparse_numel = counts.embeddings[0] if r.sparse_saving else 0
    if r.offload:
        step_temp = 0
    elif is_apollo(opt.name):
        # What this process steps: a rank's slices under FSDP, the adapters under LoRA.
        step_temp = apollo_step_temporaries(r.local, s, dt, sparse_numel)
    else:
        step_temp = step_temporaries(opt.name, r.largest, dt, s.device, opt.bf16_update, sparse_numel)
    in_bwd_step = step_temp if opt.in_backward else 0
    if s.fsdp:
        # The norm of the slices comes before the update: the larger of the two.
        step_temp = max(step_temp, clip_temporaries(r.largest, dt))
    elif s.clipping and not opt.in_backward and not r.offload:
        step_temp += 8 * len(r.trainable)  # one float32 norm per tensor, and their stack
    return step_temp, in_bwd_step
