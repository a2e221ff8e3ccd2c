"""The optimizer names a recipe may give, and what each name means: the one place a name is decoded.

Every other module asks `optimizer_kind(name)` rather than reading the name's spelling, so a new
optimizer is one `Literal` member and one row of `_KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

OptimizerName = Literal["adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "apollo", "apollo_mini"]
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)


@dataclass(frozen=True)
class OptimizerKind:
    paged: bool  # moment buffers in CUDA unified memory (on CUDA; ordinary memory elsewhere)
    eight_bit: bool  # bitsandbytes' blockwise 8-bit moments
    bnb: bool  # bitsandbytes keeps the moments (its 32-bit PagedAdamW or the 8-bit ones)
    unpaged: OptimizerName  # the same moments without paging: what FSDP, which refuses paging, runs
    projected: bool = False  # APOLLO: a decoder layer's matrices keep moments of a random projection


_KINDS: dict[str, OptimizerKind] = {
    "adamw_32bit": OptimizerKind(paged=False, eight_bit=False, bnb=False, unpaged="adamw_32bit"),
    "adamw_8bit": OptimizerKind(paged=False, eight_bit=True, bnb=True, unpaged="adamw_8bit"),
    "paged_adamw_32bit": OptimizerKind(paged=True, eight_bit=False, bnb=True, unpaged="adamw_32bit"),
    "paged_adamw_8bit": OptimizerKind(paged=True, eight_bit=True, bnb=True, unpaged="adamw_8bit"),
    # lisaft/optim/apollo.py; embeddings, head and norms keep 8-bit AdamW moments (docs/optimizers.md).
    "apollo": OptimizerKind(paged=False, eight_bit=False, bnb=False, unpaged="apollo", projected=True),
    "apollo_mini": OptimizerKind(paged=False, eight_bit=False, bnb=False, unpaged="apollo_mini", projected=True),
}
assert set(_KINDS) == set(OPTIMIZERS), "every optimizer name has one row"
APOLLO_NAMES: tuple[OptimizerName, ...] = tuple(n for n in OPTIMIZERS if _KINDS[n].projected)


def optimizer_kind(name: str) -> OptimizerKind:
    """The properties of optimizer `name` (a KeyError for a name the schema would refuse)."""
    return _KINDS[name]
