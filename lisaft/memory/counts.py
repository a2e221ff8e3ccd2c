"""Exact parameter counts, from the model built on the meta device (no memory, no weights).

The estimator needs more than a total: 8-bit optimizer state depends on each tensor's size
(small tensors stay 32-bit, absmax is per 256-element block), paged state on which tensors are
large enough to be paged, and LISA on which tensors belong to which layer.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace

import torch

from lisaft.console import first_line
from lisaft.errors import LisaftError


@dataclass(frozen=True)
class ParamCounts:
    """Tensor sizes (element counts) per LISA group. A head tied to the input embedding is in
    `embeddings` only, so the shared matrix counts once."""

    layers: tuple[tuple[int, ...], ...]  # one tuple of tensor numels per decoder layer
    embeddings: tuple[int, ...]
    head: tuple[int, ...]
    buffer_numel: int
    buffer_bytes_fp32: int  # buffers kept in float32 whatever the model dtype (rotary inv_freq)
    tied: bool
    # Each tensor's first dimension, in the same layout as the numels: FSDP shards on it.
    layer_rows: tuple[tuple[int, ...], ...] = ()
    embedding_rows: tuple[int, ...] = ()
    head_rows: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(map(sum, self.layers)) + sum(self.embeddings) + sum(self.head)

    @property
    def layer_count(self) -> int:
        return len(self.layers)

    def layer_params(self, i: int) -> int:
        return sum(self.layers[i])

    def _per_tensor(self, size) -> ParamCounts:
        return replace(self, layers=tuple(tuple(map(size, n, r)) for n, r in zip(self.layers, self.layer_rows)),
                       embeddings=tuple(map(size, self.embeddings, self.embedding_rows)),
                       head=tuple(map(size, self.head, self.head_rows)))

    def sharded(self, ranks: int) -> ParamCounts:
        """One rank's slices under FSDP: every tensor split on its first dimension, padded to a
        multiple of `ranks` (torch's FSDPParam pads dim 0, and every rank allocates
        ceil(rows / ranks) rows; rank 0 also holds that many real ones). Buffers stay whole."""
        return self._per_tensor(lambda n, r: n // max(r, 1) * -(-r // ranks))

    def gathered(self, ranks: int) -> ParamCounts:
        """The tensors as FSDP gathers them for a forward or backward: `ranks` padded slices."""
        return self._per_tensor(lambda n, r: n // max(r, 1) * -(-r // ranks) * ranks)


def build_meta_model(config):
    """The model for `config` on the meta device: shapes without storage."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        except Exception as e:  # unsupported architectures raise ValueError/KeyError/TypeError
            raise LisaftError(
                f"cannot build model type {getattr(config, 'model_type', '?')!r} to count its "
                f"parameters: {first_line(e)}"
            ) from None


def _count(config, layers_path: str | None) -> ParamCounts:
    from lisaft.model.parts import model_parts

    model = build_meta_model(config)
    parts = model_parts(model, layers_path)
    layers = tuple(tuple(p.numel() for p in layer.parameters()) for layer in parts.layers)
    embeddings = tuple(p.numel() for p in parts.embeddings)
    head = tuple(p.numel() for p in parts.head)
    rows = lambda params: tuple(p.shape[0] if p.dim() else 1 for p in params)  # noqa: E731
    buffers = list(model.buffers())
    out_emb = model.get_output_embeddings()
    tied = out_emb is not None and out_emb.weight is model.get_input_embeddings().weight
    return ParamCounts(
        layers=layers, embeddings=embeddings, head=head,
        buffer_numel=sum(b.numel() for b in buffers),
        buffer_bytes_fp32=sum(b.numel() * 4 for b in buffers if b.dtype == torch.float32),
        tied=tied, layer_rows=tuple(rows(layer.parameters()) for layer in parts.layers),
        embedding_rows=rows(parts.embeddings), head_rows=rows(parts.head),
    )


_CACHE: dict[str, ParamCounts] = {}


def param_counts(config, layers_path: str | None = None) -> ParamCounts:
    """Counts for a transformers config; cached by the config's content. `layers_path` is the
    recipe's model.layers_path, for architectures whose decoder layers lisaft cannot find."""
    data = config.to_dict()
    for key in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        data.pop(key, None)
    key = json.dumps([data, layers_path], sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE[key] = _count(config, layers_path)
    return _CACHE[key]
