"""How the forward keeps the documents of a packed row apart.

transformers (>= 4.53.1) builds a block-diagonal causal mask from position ids that restart at
0 (sdpa, eager), as long as no 2D attention_mask is passed and no cache is built; the flash
kernels take the documents' cumulative lengths instead (collate's `flatten`, lisaft/data/order.py).

Under sdpa that mask is boolean, and torch turns a boolean mask into an additive one in the
model's dtype on every attention call; each layer's copy (batch x L x L) stays alive for its
backward. Handing sdpa the additive mask, built once per forward, leaves one copy shared by all
layers: `share_sdpa_mask` wraps transformers' sdpa mask builder to do that (same numbers: a
masked score becomes exp(min - max) = 0 either way; no row of a causal mask is fully masked).
"""

from __future__ import annotations

import torch

from lisaft import internals

# What a collated batch hands the model: a padded batch's attention_mask, or a packed one's
# position ids and, flattened for the varlen kernels, its cumulative document lengths.
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids",
                "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def model_inputs(batch: dict) -> dict:
    """The forward's keyword arguments. use_cache=False: a cache built in the forward, like a 2D
    attention_mask, turns off the detection of packed documents, and they would attend across."""
    share_sdpa_mask()
    return {k: batch[k] for k in MODEL_INPUTS if k in batch} | {"use_cache": False}


def varlen_attention(model) -> bool:
    """Whether the model's attention takes varlen kwargs, so a micro-batch can be flattened into
    one row with no padding at all (collate's `flatten`)."""
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash_attention")


def _additive(build):
    def sdpa_additive_mask(*args, dtype: torch.dtype = torch.float32, **kwargs):
        mask = build(*args, dtype=dtype, **kwargs)
        if mask is None or mask.dtype != torch.bool or not dtype.is_floating_point:
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(dtype).min)

    return sdpa_additive_mask


_installed: list = []  # the wrapper share_sdpa_mask registered last, if any


def share_sdpa_mask() -> None:
    """Make transformers hand sdpa one additive mask per forward (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface

    current = internals.registered_mask_builder("sdpa")
    if current not in _installed:
        _installed[:] = [_additive(current)]
        AttentionMaskInterface.register("sdpa", _installed[0])
