"""Each unit's optimizer, as the optimizer's kind says (config/optimizers.py): AdamW with its
moments in float32, bitsandbytes' 8-bit or paged buffers (adamw.py), or APOLLO (apollo.py)."""

from __future__ import annotations

import torch

from lisaft.config.optimizers import optimizer_kind
from lisaft.config.schema import OptimizerSection
from lisaft.console import warn
from lisaft.optim.adamw import AdamW, PagedPool, param_groups
from lisaft.optim.apollo import build_apollo
from lisaft.optim.rounding import Rounding

_warned_cpu_paging: set[str] = set()


def build_unit_optimizer(params: list[torch.nn.Parameter], section: OptimizerSection, device: torch.device,
                         rounding: Rounding, unit_index: int, pool: PagedPool | None, layer: bool = False) -> AdamW:
    """The unit's optimizer; weight decay on matrices and embeddings (>= 2-D) only. `layer`: the
    unit is a decoder layer, whose matrices a projected optimizer projects (lisaft/optim/apollo.py)."""
    kind = optimizer_kind(section.name)
    if kind.projected:
        return build_apollo(params, section, rounding, unit_index, layer)
    moments = torch.bfloat16 if section.moments_dtype == "bfloat16" else torch.float32
    if kind.paged and device.type != "cuda" and section.name not in _warned_cpu_paging:
        _warned_cpu_paging.add(section.name)
        warn(f"optimizer.name {section.name}: paged state needs CUDA unified memory; on "
             f"{device.type} the optimizer runs unpaged (same updates, ordinary memory)")
    return AdamW(param_groups(params), lr=section.lr, betas=section.betas, eps=section.eps,
                 weight_decay=section.weight_decay, eight_bit=kind.eight_bit,
                 paged=kind.paged, bnb_32bit=kind.bnb and not kind.eight_bit, rounding=rounding,
                 unit_index=unit_index, pool=pool, moments_dtype=moments)
