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
  one at a time (the largest linear's bytes); DoRA's forward builds W + s B A and its row norm
  for each adapted layer (two of the largest linear's matrices at a time).
- activations: every layer is on the graph (adapters in every layer); each adapted linear also
  saves A's output (tokens x r), and with lora.dropout the dropped input and its mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lisaft.memory.counts import ParamCounts, build_meta_model

BLOCK = 64           # bitsandbytes' NF4 block size
NESTED_BLOCK = 256   # double quantization: absmax values per float32 second-level constant
# Each 4-bit tensor's own quantization state besides its blocks: the 16-value NF4 code, the
# 256-value 8-bit code of the nested absmax and its offset, all float32 (bitsandbytes 0.50).
QUANT_STATE_BYTES = 4 * (16 + 256 + 1)


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    targets: str | tuple[str, ...] = "all-linear"
    dora: bool = False
    dropout: float = 0.0
    train_embeddings: bool = False
    quantize: str | None = None


def lora_settings(recipe) -> LoraSettings | None:
    lora = recipe.lora
    if not lora.enabled:
        return None
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return LoraSettings(rank=lora.rank, targets=targets, dora=lora.dora, dropout=lora.dropout,
                        train_embeddings=lora.train_embeddings, quantize=recipe.model.quantize)


def nf4_bytes(numel: int) -> int:
    blocks = -(-numel // BLOCK)
    return numel // 2 + blocks + 4 * -(-blocks // NESTED_BLOCK) + QUANT_STATE_BYTES


@dataclass(frozen=True)
class LoraCounts:
    trainable: ParamCounts        # adapters per layer; embeddings and head only when they train
    weight_bytes: int             # the frozen base (4-bit or model.dtype) plus the adapters
    largest_linear: int           # elements of the largest decoder-layer linear
    saved_per_token_layer: int    # extra bytes saved for backward per token and layer


def _layer_linears(config, layers_path: str | None) -> list[list[tuple[str, int, int]]]:
    """(name, in_features, out_features) of each decoder layer's linear layers."""
    from torch import nn

    from lisaft.model.load import model_parts

    layers = model_parts(build_meta_model(config), layers_path).layers
    return [[(n.rsplit(".", 1)[-1], m.in_features, m.out_features) for n, m in layer.named_modules()
             if isinstance(m, nn.Linear)] for layer in layers]


def lora_counts(counts: ParamCounts, config, layers_path: str | None, lora: LoraSettings, dt: int) -> LoraCounts:
    linears = _layer_linears(config, layers_path)
    adapter_layers, adapted_numel, quantized_numel, largest, saved = [], 0, 0, 0, 0
    for layer in linears:
        numels: list[int] = []
        for name, fan_in, fan_out in layer:
            quantized_numel += fan_in * fan_out
            largest = max(largest, fan_in * fan_out)
            if lora.targets != "all-linear" and name not in lora.targets:
                continue
            numels += [lora.rank * fan_in, fan_out * lora.rank] + ([fan_out] if lora.dora else [])
        adapter_layers.append(tuple(numels))
        adapted_numel += sum(numels)
    for name, fan_in, _ in linears[0] if linears else []:
        if lora.targets == "all-linear" or name in lora.targets:
            saved += lora.rank * dt + (fan_in * (dt + 1) if lora.dropout else 0)
    base = counts.total * dt + counts.buffer_bytes_fp32 + (counts.buffer_numel * 4 - counts.buffer_bytes_fp32) * dt // 4
    if lora.quantize:
        base += sum(nf4_bytes(fi * fo) for layer in linears for _, fi, fo in layer) - quantized_numel * dt
    ends = lora.train_embeddings
    trainable = replace(counts, layers=tuple(adapter_layers),
                        embeddings=counts.embeddings if ends else (), head=counts.head if ends else (),
                        layer_rows=tuple((1,) * len(a) for a in adapter_layers),
                        embedding_rows=counts.embedding_rows if ends else (),
                        head_rows=counts.head_rows if ends else ())
    return LoraCounts(trainable=trainable, weight_bytes=base + adapted_numel * dt, largest_linear=largest,
                      saved_per_token_layer=saved)


def layer_transient(lc: LoraCounts, lora: LoraSettings, dt: int) -> int:
    """Bytes alive at once inside one adapted layer's forward or backward, beyond the plain layer."""
    out = lc.largest_linear * dt if lora.quantize else 0
    if lora.dora:
        out += 2 * lc.largest_linear * dt
    return out
