"""The estimator's LoRA, DoRA and QLoRA terms (lisaft/model/lora.py builds what they count).

- weights: the frozen base in model.dtype, or with model.quantize: nf4 every decoder-layer linear
  in 4-bit NormalFloat: half a byte per weight, one 8-bit absmax per 64-weight block and, with
  double quantization, one float32 absmax per 256 blocks (QLoRA, arXiv 2305.14314, section 3:
  0.127 bits per parameter for the constants); embeddings, norms and the output head stay in
  model.dtype (transformers keeps lm_head unquantized). The adapters: A (r x in) and B (out x r)
  per adapted linear, plus DoRA's magnitude vector (out).
- gradients and moments: of the adapters only (and of the embeddings, head and final norm when
  lora.train_embeddings), through the same optimizer-state rules as any trainable tensor.
- transients: a 4-bit linear is dequantized to model.dtype for its matmul, forward and backward,
  one at a time (the largest linear's bytes). DoRA's forward (peft 0.21, DoraLinearLayer) builds
  B A as B(A(I)) from an in x in identity, then W + s B A (the scaled copy and the sum) for its row
  norm, all alive at once: (in^2 + in r + 3 out in) elements for the worst adapted linear, plus
  its dequantized weight from a 4-bit base, which it holds through the whole forward.
- activations (checked against saved-tensor hooks, tests/unit/test_lora_memory.py): every layer
  is on the graph, its base frozen: a frozen layer's tensors (no norm keeps its normalised
  copy for a weight gradient) plus, per adapted linear, its input (shared by q/k/v and by
  gate/up) and A's output (tokens x r); DoRA's base and adapter outputs (2 x tokens x out), which
  its magnitude scales, and three out-sized vectors; with lora.dropout each adapted linear's own
  dropped input and dropout's mask instead of the shared input. With frozen embeddings the first
  layer's input norm has nothing to differentiate and keeps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lisaft.memory.counts import ParamCounts, build_meta_model

if TYPE_CHECKING:
    from lisaft.config.lora import LoraSection
    from lisaft.config.schema import Recipe

BLOCK = 64           # bitsandbytes' NF4 block size
NESTED_BLOCK = 256   # double quantization: absmax values per float32 second-level constant
# Each 4-bit tensor's own quantization state besides its blocks: the 16-value NF4 code, the
# 256-value 8-bit code of the nested absmax and its offset, all float32 (bitsandbytes 0.50).
QUANT_STATE_BYTES = 4 * (16 + 256 + 1)


def nf4_bytes(numel: int) -> int:
    blocks = -(-numel // BLOCK)
    return numel // 2 + blocks + 4 * -(-blocks // NESTED_BLOCK) + QUANT_STATE_BYTES


# Which adapted linears share one input (saved once by their A's): transformers' module names.
_ATTN_IN = {"q_proj", "k_proj", "v_proj", "qkv_proj"}
_MLP_IN = {"gate_proj", "up_proj", "gate_up_proj"}


@dataclass(frozen=True)
class LoraCounts:
    trainable: ParamCounts        # adapters per layer; embeddings and head only when they train
    weight_bytes: int             # the frozen base (4-bit or model.dtype) plus the adapters
    largest_linear: int           # elements of the largest decoder-layer linear
    saved_per_token_layer: int    # bytes saved for backward per token and layer beyond a frozen layer's
    saved_per_layer: int = 0      # bytes saved per layer whatever the tokens (DoRA's vectors)
    first_layer_unsaved: int = 0  # per token: what the first layer's frozen inputs keep the less
    first_layer_weights_unsaved: int = 0  # and whatever the tokens (4-bit DoRA with dropout)
    transient: int = 0            # bytes alive at once inside one adapted layer, beyond the plain layer


def _layer_linears(config, layers_path: str | None) -> list[list[tuple[str, int, int]]]:
    """(name, in_features, out_features) of each decoder layer's linear layers."""
    from torch import nn

    from lisaft.model.parts import model_parts

    layers = model_parts(build_meta_model(config), layers_path).layers
    return [[(n.rsplit(".", 1)[-1], m.in_features, m.out_features) for n, m in layer.named_modules()
             if isinstance(m, nn.Linear)] for layer in layers]


@dataclass(frozen=True)
class Saving:
    """What decides the tensors an adapted layer saves beyond a frozen one's."""

    o_input_kept: bool = True  # the attention output, o_proj's input, is kept anyway (sdpa)
    mask_bytes: int = 1        # dropout's mask per element: bool on CUDA, a model.dtype noise tensor on CPU
    mlp_chunked: bool = False  # model.mlp_chunk_tokens: the MLP's input is kept anyway, its insides per chunk


def _adapted(lora: LoraSection, name: str) -> bool:
    return lora.target_modules == "all-linear" or name in lora.target_modules


def lora_counts(counts: ParamCounts, config, recipe: Recipe, dt: int, saving: Saving = Saving()) -> LoraCounts:
    """The adapters of recipe.lora on the base recipe.model describes (model.quantize: its 4-bit form)."""
    lora, quantize = recipe.lora, recipe.model.quantize
    linears = _layer_linears(config, recipe.model.layers_path)
    adapter_layers, adapted_numel, quantized_numel, largest = [], 0, 0, 0
    for layer in linears:
        numels: list[int] = []
        for name, fan_in, fan_out in layer:
            quantized_numel += fan_in * fan_out
            largest = max(largest, fan_in * fan_out)
            if _adapted(lora, name):
                numels += [lora.rank * fan_in, fan_out * lora.rank] + ([fan_out] if lora.dora else [])
        adapter_layers.append(tuple(numels))
        adapted_numel += sum(numels)
    base = counts.total * dt + counts.buffer_bytes_fp32 + (counts.buffer_numel * 4 - counts.buffer_bytes_fp32) * dt // 4
    if quantize:
        base += sum(nf4_bytes(fi * fo) for layer in linears for _, fi, fo in layer) - quantized_numel * dt
    ends = lora.train_embeddings
    trainable = replace(counts, layers=tuple(adapter_layers),
                        embeddings=counts.embeddings if ends else (), head=counts.head if ends else (),
                        layer_rows=tuple((1,) * len(a) for a in adapter_layers),
                        embedding_rows=counts.embedding_rows if ends else (),
                        head_rows=counts.head_rows if ends else ())
    first = linears[0] if linears else []
    per_token, per_layer, first_unsaved, first_weights = _saved(first, lora, quantize, dt, saving)
    return LoraCounts(trainable=trainable, weight_bytes=base + adapted_numel * dt, largest_linear=largest,
                      saved_per_token_layer=per_token, saved_per_layer=per_layer, first_layer_unsaved=first_unsaved,
                      first_layer_weights_unsaved=first_weights,
                      transient=_transient(first, largest, lora, quantize, dt))


def _saved(linears: list[tuple[str, int, int]], lora: LoraSection, quantize: str | None, dt: int,
           saving: Saving) -> tuple[int, int, int, int]:
    """(bytes per token, bytes whatever the tokens) one adapted layer saves beyond a frozen layer,
    and the same two that the first layer keeps the less with frozen embeddings."""
    per_token, per_layer, first_unsaved, first_weights, inputs = 0, 0, 0, 0, {}
    for name, fan_in, fan_out in linears:
        if not _adapted(lora, name):
            continue
        per_token += lora.rank * dt  # A's output, B's input
        if lora.dropout:
            # Each adapter drops its own copy of the input, which A keeps with dropout's mask;
            # the first layer's q/k/v input needs no gradient, so no mask is kept there.
            per_token += fan_in * (dt + saving.mask_bytes)
            first_unsaved += fan_in * saving.mask_bytes if name in _ATTN_IN else 0
        elif saving.mlp_chunked and (name in _MLP_IN or name == "down_proj"):
            pass  # the chunk's checkpoint keeps the MLP input; its recompute holds one chunk's
        elif name in _ATTN_IN or name in _MLP_IN:
            inputs["attn" if name in _ATTN_IN else "mlp"] = fan_in * dt  # A keeps the shared input once
        elif name != "o_proj" or not saving.o_input_kept:
            inputs[name] = fan_in * dt
        if lora.dora:
            # The base output and B A x that the magnitude scales; the detached norm, the scale
            # and the scale - 1 per output row; from a 4-bit base, with dropout, the base
            # matmul of the dropped input keeps the dequantized weight.
            per_token += 2 * fan_out * dt
            # That weight is a whole bf16 copy of the layer's adapted linears, kept until backward
            # (not where the dropped input needs no gradient: the first layer's q/k/v).
            weight = fan_in * fan_out * dt if quantize and lora.dropout else 0
            per_layer += 3 * fan_out * dt + weight
            first_weights += weight if name in _ATTN_IN else 0
    # The first layer's input norm: its input (the frozen embeddings') needs no gradient.
    first_unsaved += 4 * (_hidden(linears) + 1)
    return per_token + sum(inputs.values()), per_layer, first_unsaved, first_weights


def _hidden(linears: list[tuple[str, int, int]]) -> int:
    return next((fi for name, fi, _ in linears if name in _ATTN_IN), 0)


def _transient(linears: list[tuple[str, int, int]], largest: int, lora: LoraSection, quantize: str | None,
               dt: int) -> int:
    """Bytes alive at once inside one adapted layer's forward (or its recompute), beyond the plain
    layer: a 4-bit linear's dequantized weight; DoRA's identity, B(A(I)), the scaled copy and
    the sum whose row norm it takes, beside the dequantized weight it holds."""
    out = largest * dt if quantize else 0
    if lora.dora:
        for name, fan_in, fan_out in linears:
            if _adapted(lora, name):
                dora = fan_in * fan_in + fan_in * lora.rank + 3 * fan_out * fan_in
                out = max(out, (dora + (fan_in * fan_out if quantize else 0)) * dt)
    return out
