"""The optimizer names a recipe may give, and what each name means: the one place a name is decoded.

Every other module asks `optimizer_kind(name)` and reads a property rather than the name's
spelling (tests/unit/test_optimizer_names.py holds lisaft/ to it), so a new optimizer is one
`Literal` member and one row of `_KINDS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    # A projected optimizer's rules (lisaft/optim/apollo.py, docs/optimizers.md):
    rest: OptimizerName | None = None  # whose moments the tensors it does not project keep
    rank: int | None = None  # the projection's rank when fixed by definition; None: optimizer.rank
    scale_type: Literal["channel", "tensor"] | None = None  # fixed by definition; None: optimizer.scale_type
    scale: float = 1.0  # α when optimizer.scale is null

    @property
    def own_adamw(self) -> bool:
        """Stepped by lisaft's AdamW (optim/adamw.py) with moments of its own: float32, or bfloat16
        where optimizer.moments_dtype says so and the step runs on the CPU."""
        return not (self.bnb or self.projected)

    @property
    def imports_bitsandbytes(self) -> bool:
        """The process loads bitsandbytes: for its moments, or those of the tensors it does not project."""
        return self.bnb or (self.rest is not None and _KINDS[self.rest].imports_bitsandbytes)


_KINDS: dict[str, OptimizerKind] = {
    "adamw_32bit": OptimizerKind(paged=False, eight_bit=False, bnb=False, unpaged="adamw_32bit"),
    "adamw_8bit": OptimizerKind(paged=False, eight_bit=True, bnb=True, unpaged="adamw_8bit"),
    "paged_adamw_32bit": OptimizerKind(paged=True, eight_bit=False, bnb=True, unpaged="adamw_32bit"),
    "paged_adamw_8bit": OptimizerKind(paged=True, eight_bit=True, bnb=True, unpaged="adamw_8bit"),
    # Embeddings, head and norms keep 8-bit AdamW moments; the paper's rank 256 and α 1 (apollo),
    # rank 1, one factor per matrix and α = √128 (apollo_mini).
    "apollo": OptimizerKind(paged=False, eight_bit=False, bnb=False, unpaged="apollo", projected=True,
                            rest="adamw_8bit"),
    "apollo_mini": OptimizerKind(paged=False, eight_bit=False, bnb=False, unpaged="apollo_mini", projected=True,
                                 rest="adamw_8bit", rank=1, scale_type="tensor", scale=math.sqrt(128)),
}
assert set(_KINDS) == set(OPTIMIZERS), "every optimizer name has one row"


def optimizer_kind(name: str) -> OptimizerKind:
    """The properties of optimizer `name` (a KeyError for a name the schema would refuse)."""
    return _KINDS[name]


def names_where(test: Callable[[OptimizerKind], bool]) -> list[OptimizerName]:
    """The names whose kind passes `test`, in the Literal's order: what a message offers instead."""
    return [n for n in OPTIMIZERS if test(_KINDS[n])]
