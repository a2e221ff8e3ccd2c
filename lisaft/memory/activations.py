"""What autograd keeps for backward, per token, for the decoder families lisaft knows.

Each term is a tensor that a transformers module saves for its backward (worked out from the
modelling code and checked tensor by tensor with saved-tensor hooks, see
tests/unit/test_memory_activations.py). Bytes are per token of the micro-batch; `dt` is the
model dtype's size. Terms marked "weight grad only" exist only when the layer's weights train:
autograd saves a linear layer's input only to form its weight gradient, so a frozen LISA layer
above a trainable one keeps less than a trainable layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from lisaft.model.loss import LOSS_CHUNK_ELEMENTS, PLAIN_HEAD_TYPES

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class Shape:
    """The sizes that activations depend on, read from a transformers config."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    rotary_dim: int
    # Gemma-style RMSNorm computes in float32 and keeps a float32 normalised copy; Gemma-2
    # has four norms per layer, two of them after the sublayers.
    gemma_norm: bool = False
    post_norms: int = 0
    # Phi-3 (fused q|k|v projection, rotary on a concatenation) gets its attention output back
    # in head-major layout, so o_proj keeps its own copy (a weight-gradient-only tensor).
    attn_output_copy: bool = False
    attn_softcap: bool = False
    final_softcap: bool = False
    # logits = head(final hidden state): lisaft's loss may then run in chunks (lisaft/model/loss.py).
    plain_head: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def shape_from_config(config) -> Shape:
    get = lambda *names, default=None: next(  # noqa: E731
        (getattr(config, n) for n in names if getattr(config, n, None) is not None), default)
    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    kv_heads = get("num_key_value_heads", default=heads)
    head_dim = get("head_dim", default=hidden // heads)
    partial = get("partial_rotary_factor", default=1.0)
    model_type = getattr(config, "model_type", "")
    gemma2 = model_type in ("gemma2", "gemma3_text")
    return Shape(
        hidden=hidden,
        intermediate=get("intermediate_size", "n_inner", default=4 * hidden),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=get("vocab_size"),
        layers=get("num_hidden_layers", "n_layer"),
        rotary_dim=int(head_dim * partial),
        gemma_norm=model_type.startswith("gemma"),
        post_norms=2 if gemma2 else 0,
        attn_output_copy=model_type == "phi3",
        attn_softcap=gemma2 and get("attn_logit_softcapping") is not None,
        final_softcap=get("final_logit_softcapping") is not None,
        plain_head=model_type in PLAIN_HEAD_TYPES,
    )


def loss_chunk_tokens(shape: Shape, tokens: int) -> int | None:
    """Positions per loss chunk when lisaft's loss runs chunked for `tokens` positions, else
    None (the whole vocab x tokens logits exist at once)."""
    if shape.plain_head and tokens * shape.vocab > LOSS_CHUNK_ELEMENTS:
        return max(1, LOSS_CHUNK_ELEMENTS // shape.vocab)
    return None


def _norm(shape: Shape, dt: int, trainable: bool) -> int:
    # RMSNorm: the float32 input and rsqrt feed the input gradient; the normalised tensor
    # (before the weight multiply) feeds the weight gradient only.
    normalised = (FP32 if shape.gemma_norm else dt) * shape.hidden
    return FP32 * shape.hidden + FP32 + (normalised if trainable else 0)


def attention_scores_bytes(shape: Shape, dt: int, seq_len: int, attention: str) -> int:
    """Per-token bytes of the s x s score matrix that eager attention keeps (one row per head).
    SDPA and FlashAttention recompute scores in backward and keep one float32 log-sum-exp per
    head instead."""
    if attention != "eager":
        return FP32 * shape.heads
    per_score = FP32 + (dt if dt != FP32 else 0)  # float32 softmax, and its cast back to dt
    if shape.attn_softcap:
        per_score += dt  # tanh output of the logit soft-cap
    return per_score * shape.heads * seq_len


def layer_bytes_per_token(shape: Shape, dt: int, seq_len: int, attention: str, trainable: bool,
                          mlp_chunked: bool = False, masked: bool = False) -> int:
    """Saved-for-backward bytes per token of one decoder layer on the autograd graph. With the
    MLP run in checkpointed chunks (model.mlp_chunk_tokens) it keeps only its input, the norm
    output (already counted when the layer trains); its intermediates are one chunk's, in
    backward only (`mlp_chunk_bytes`). `masked`: sdpa gets an explicit mask (packed rows), so
    transformers repeats k and v to every head instead of letting sdpa share them (GQA)."""
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_dim
    total = 2 * _norm(shape, dt, trainable)  # before attention and before the MLP
    total += shape.post_norms * _norm(shape, dt, trainable)
    if trainable:
        total += 2 * dt * h  # the two norm outputs, inputs of q/k/v and of gate/up (weight grad only)
    if attention == "eager":
        # q, and k and v repeated to every head, enter the score matmuls; the attention output
        # is re-laid out for o_proj, a copy kept for o_proj's weight gradient.
        total += 3 * dt * q + (dt * q if trainable else 0)
    else:
        # q, k, v and the output, which is o_proj's input too where its layout allows. Phi-3's
        # v is a view into the fused q|k|v projection, which so stays alive whole.
        v_storage = (q + 2 * kv) if shape.attn_output_copy else kv
        total += dt * (q + kv + v_storage + q)
        if masked:
            total += 2 * dt * (q - kv)
        if shape.attn_output_copy and trainable:
            total += dt * q
    total += attention_scores_bytes(shape, dt, seq_len, attention)
    if mlp_chunked:
        return total + (0 if trainable else dt * h)
    # MLP: gate output (activation input), activation output and up output (product inputs),
    # and the product (down_proj input, weight grad only).
    total += dt * i * (3 + (1 if trainable else 0))
    return total


def packed_mask_bytes(attention: str, checkpointing: bool, batch: int, seq_len: int, dt: int) -> int:
    """The block-diagonal mask of packed rows: one additive batch x L x L mask in the model dtype,
    built once per forward (lisaft/model/attention.py). sdpa keeps it for every layer's backward;
    eager only adds it to the scores, so it is gone by backward unless checkpointed layers keep
    it for their recompute. The flash kernels take document lengths and need no mask."""
    if attention.startswith("flash") or (attention == "eager" and not checkpointing):
        return 0
    return batch * seq_len * seq_len * dt


def mlp_chunked(seq_len: int, chunk_tokens: int | None) -> bool:
    """Whether lisaft/model/activation_offload.py splits the MLP: only sequences longer than one chunk."""
    return chunk_tokens is not None and chunk_tokens > 0 and seq_len > chunk_tokens


def mlp_chunk_bytes(shape: Shape, dt: int, batch: int, seq_len: int, chunk_tokens: int | None) -> int:
    """One MLP chunk (`chunk_tokens` positions of every row) recomputed in backward: its four
    intermediates (as a trainable layer keeps them) and their two gradients in flight."""
    if chunk_tokens is None or not mlp_chunked(seq_len, chunk_tokens):
        return 0
    return batch * chunk_tokens * dt * shape.intermediate * (4 + 2)


def checkpointed_layer_bytes_per_token(shape: Shape, dt: int) -> int:
    """Non-reentrant checkpointing keeps only each layer's input hidden state."""
    return dt * shape.hidden


# With offloaded checkpoints (lisaft/model/activation_offload.py) the device holds the input of the layer being
# recomputed and the one being fetched ahead of it; forward's copies to host free each input
# as soon as its copy is done, so the same bound holds there.
OFFLOAD_INFLIGHT_LAYERS = 2


def offloaded_host_bytes(shape: Shape, dt: int, batch: int, seq_len: int) -> int:
    """Pinned host memory of offloaded checkpoints: every layer's input. PyTorch's pinned-memory
    cache rounds each block up to a power of two (CachingHostAllocator)."""
    one = batch * seq_len * checkpointed_layer_bytes_per_token(shape, dt)
    return shape.layers * (1 << (one - 1).bit_length())


@dataclass(frozen=True)
class ActivationBreakdown:
    layers: int  # bytes kept by all decoder layers on the graph
    outside_layers: int  # embedding indices, rotary tables, final norm, head input
    log_probs: int  # float32 log-softmax of the loss, kept for its backward
    one_layer_full: int  # one trainable layer's full activations (checkpoint recompute)
    mlp_chunk: int = 0  # one MLP chunk's recompute in backward (model.mlp_chunk_tokens)
    packed_mask: int = 0  # packed rows' attention mask, resident through backward
    packed_mask_hooked: bool = False  # saved by sdpa itself (no checkpointing): hooks see it

    @property
    def saved(self) -> int:
        """What saved-tensor hooks see at the end of the forward pass."""
        return self.layers + self.outside_layers + self.log_probs + \
            (self.packed_mask if self.packed_mask_hooked else 0)


def activations(
    shape: Shape, dt: int, batch: int, seq_len: int, attention: str, checkpointing: bool,
    trainable_layers: int, train_embeddings: bool, head_weight_trains: bool, final_norm_trains: bool,
    offload: bool = False, mlp_chunk_tokens: int | None = None, packing: bool = False,
    padded_rows: bool = False,
) -> ActivationBreakdown:
    """Saved-for-backward bytes of one micro-batch.

    Every layer is taken to be on the graph: true when the embeddings train; with frozen
    embeddings it is the worst case (backward stops at the lowest trainable layer, which LISA
    may sample at the bottom). `padded_rows`: rows padded to the longest in the batch, so
    attention gets a padding mask."""
    tokens = batch * seq_len
    frozen_layers = shape.layers - trainable_layers
    chunked = mlp_chunked(seq_len, mlp_chunk_tokens)
    masked = packing and attention == "sdpa"
    full = layer_bytes_per_token(shape, dt, seq_len, attention, True, chunked, masked)
    frozen = layer_bytes_per_token(shape, dt, seq_len, attention, False, chunked, masked)
    # Padded rows give sdpa a padding mask: lisaft hands it one additive mask per forward, shared
    # by every layer (lisaft/model/attention.py; counted with the packed mask below). With a mask,
    # transformers' SDPA path also repeats grouped k and v to every head, and those copies are
    # what the kernel keeps; a single k/v head repeats as a view, without a copy.
    pad_kv = 0
    if padded_rows and attention == "sdpa" and 1 < shape.kv_heads < shape.heads:
        pad_kv = 2 * dt * tokens * (shape.heads - shape.kv_heads) * shape.head_dim
    if checkpointing:
        resident = min(shape.layers, OFFLOAD_INFLIGHT_LAYERS) if offload else shape.layers
        layers = tokens * resident * checkpointed_layer_bytes_per_token(shape, dt)
    else:
        layers = tokens * (trainable_layers * full + frozen_layers * frozen) + shape.layers * pad_kv
    outside = INT64 * tokens if train_embeddings else 0  # token ids, for the embedding gradient
    mask = packed_mask_bytes(attention, checkpointing, batch, seq_len, dt) if packing or padded_rows else 0
    if not checkpointing:
        outside += 2 * dt * seq_len * shape.rotary_dim  # cos and sin, shared by all layers
    outside += tokens * _norm(shape, dt, final_norm_trains)
    if shape.gemma_norm:
        # Gemma's norm multiplies by (1 + weight) in float32: one such vector kept per norm.
        outside += FP32 * shape.hidden * (shape.layers * (2 + shape.post_norms) + 1)
    chunk = loss_chunk_tokens(shape, tokens)
    if head_weight_trains or chunk:
        # The head's input; a chunked loss holds, instead, its gradient with respect to it (the
        # same size, formed in the forward: the summed loss's, or a per-position loss's at an
        # output gradient of 1 where the head is frozen), or the input itself for a per-position
        # loss's recompute (the head trains). The same bytes every way (tests/unit/test_loss_per_position.py).
        outside += tokens * dt * shape.hidden
    if chunk:
        log_probs = 0  # one chunk's at a time: see loss_buffers_peak
    else:
        # Log-softmax output, the shifted labels and the loss's float32 normaliser.
        log_probs = tokens * (FP32 * shape.vocab + INT64) + FP32
        if shape.final_softcap:
            log_probs += tokens * dt * shape.vocab  # tanh output of the final soft-cap
    return ActivationBreakdown(
        layers=layers, outside_layers=outside, log_probs=log_probs,
        one_layer_full=tokens * (full if trainable_layers else frozen) + pad_kv,
        mlp_chunk=mlp_chunk_bytes(shape, dt, batch, seq_len, mlp_chunk_tokens),
        packed_mask=mask, packed_mask_hooked=attention == "sdpa" and not checkpointing,
    )


def loss_buffers_peak(shape: Shape, batch: int, seq_len: int, dt: int = 2) -> int:
    """vocab x tokens buffers alive at the loss's backward. lisaft's cross entropy turns its saved
    float32 log-probs into the gradient in place (lisaft/model/loss.py), then casts it to the model's
    dtype unless that is float32. A chunked loss has them for one chunk only, in its forward (the
    summed loss forms its gradients there, and so does a per-position loss where the head is
    frozen) or its backward's recompute (a per-position loss where the head trains): the chunk's
    float32 log-probs beside its model-dtype logits, and the soft-cap's tanh."""
    chunk = loss_chunk_tokens(shape, batch * seq_len)
    if chunk is None:
        return batch * seq_len * shape.vocab * (FP32 + (0 if dt == FP32 else dt))
    return chunk * shape.vocab * (FP32 + dt * (2 if shape.final_softcap else 1))
