"""APOLLO and APOLLO-Mini: AdamW's moments kept on a random low-rank projection of the gradient.

From the paper's equations (Zhu et al., "APOLLO: SGD-like Memory, AdamW-level Performance",
MLSys 2025, arXiv 2412.05270), with Fira's norm-growth limiter. For a decoder matrix W (m x n)
with gradient G, on its smaller side a = min(m, n) and larger side b = max(m, n):

    P   (r x a)  Gaussian, entries N(0, 1/r), regenerated every T steps (never stored)
    R   = P G    (r x b; for a tall matrix R = P Gᵀ, i.e. the same on Gᵀ)
    M, V         AdamW's moments of R (float32), with bias correction
    R̃   = M̂ / (√V̂ + ε)
    s_j = ‖R̃[:, j]‖ / ‖R[:, j]‖   per channel j of the larger side (channel), or
    s   = ‖R̃‖ / ‖R‖                one factor per matrix (tensor)
    U   = α · G · diag(s)           the raw gradient, scaled channel by channel
    limiter: if ‖U‖ > γ ‖U_prev‖ then U ← U · γ ‖U_prev‖ / ‖U‖   (γ = 1.01)
    W  ← W (1 − η λ) − η U

APOLLO-Mini is rank 1 with tensor scaling and α = √128. A channel is a column of a wide matrix and
a row of a tall one: the side that is not projected.

P is a pure function of (training.seed, unit, parameter, refresh index), refresh index = optimizer
step // T, drawn on the parameter's device: a checkpoint holds only M, V, the step count and the
limiter's previous norm, and a resume anywhere in a projection period, a data-parallel replica and
a LISA re-activation all see the same P. The moments carry over a refresh, as in the paper.

Which parameters are projected: every 2-D matrix of a decoder layer. Everything else (embeddings,
head, norms, biases) steps with AdamW and 8-bit moments (adamw_8bit's rule: tensors under 4096
elements keep float32 ones); docs/optimizers.md says why.

The step works on rows of G at a time (at most CHUNK elements), so besides the state it holds
P, R, R̃ and the per-channel norms, and one chunk's float32 copies: ‖U‖ comes from the channel
norms of G (‖G diag(s)‖² = Σ s_j² ‖G[:, j]‖²) before any weight is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lisaft.config.optimizers import optimizer_kind
from lisaft.config.schema import OptimizerSection
from lisaft.optim.adamw import CHUNK, AdamW, PagedPool, param_groups
from lisaft.optim.rounding import Rounding, _mix

DEFAULT_RANK = 256  # the paper's APOLLO rank
GROWTH_LIMIT = 1.01          # Fira's γ: the update's norm grows at most 1% per step
# Mixed into the projection's seed so its stream is never the rounding noise's.
_PROJECTION_TAG = 0x41504F4C4C4F


@dataclass(frozen=True)
class ApolloSettings:
    rank: int
    scale: float
    update_proj_gap: int
    scale_type: str  # channel | tensor

    @classmethod
    def of(cls, section: OptimizerSection) -> ApolloSettings:
        """The recipe's keys with the paper's defaults for the named optimizer (config/optimizers.py)."""
        kind = optimizer_kind(section.name)
        return cls(rank=kind.rank or section.rank or DEFAULT_RANK,
                   scale=section.scale if section.scale is not None else kind.scale,
                   update_proj_gap=section.update_proj_gap,
                   scale_type=kind.scale_type or section.scale_type or "channel")


def projected_rank(rank: int, shape: tuple[int, ...]) -> int:
    """The rank used for a matrix: a projection wider than the matrix's smaller side saves nothing."""
    return min(rank, min(shape))


def projection(seed: int, unit: int, param: int, refresh: int, rank: int, side: int,
               device: torch.device) -> torch.Tensor:
    """P (rank x side, float32, entries N(0, 1/rank)), drawn afresh from its key on `device`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_mix(_PROJECTION_TAG, seed, unit, param, refresh))
    p = torch.randn(rank, side, generator=gen, device=device, dtype=torch.float32)
    return p.mul_(1.0 / math.sqrt(rank))


def _rows_per_chunk(cols: int) -> int:
    return max(1, CHUNK // max(cols, 1))


def _project(grad: torch.Tensor, proj: torch.Tensor, wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, squared norm of each channel of G), over row chunks of G in float32."""
    m, n = grad.shape
    rank = proj.shape[0]
    b = n if wide else m
    r = torch.zeros(rank, b, dtype=torch.float32, device=grad.device)
    sq = torch.zeros(b, dtype=torch.float32, device=grad.device)
    step = _rows_per_chunk(n)
    for lo in range(0, m, step):
        hi = min(lo + step, m)
        g = grad[lo:hi].float()
        if wide:
            r.addmm_(proj[:, lo:hi], g)
            sq += g.square().sum(0)
        else:
            r[:, lo:hi] = proj @ g.T
            sq[lo:hi] = g.square().sum(1)
        del g
    return r, sq


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, 0 where den is 0 (a channel with no gradient gets no update)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


class Apollo(AdamW):
    """One unit's optimizer: APOLLO on its projected matrices, 8-bit AdamW on the rest."""

    def __init__(self, groups: list[dict], *, settings: ApolloSettings, projected: Sequence[torch.Tensor],
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 rounding: Rounding, unit_index: int, pool: PagedPool | None = None) -> None:
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, eight_bit=True,
                         paged=False, bnb_32bit=False, rounding=rounding, unit_index=unit_index, pool=pool)
        self.settings = settings
        self.projected = set(projected)  # tensors hash by identity

    def _fusable(self, p: torch.Tensor) -> bool:
        return p not in self.projected and super()._fusable(p)

    def _on_host(self, p: torch.Tensor) -> bool:
        # The host kernel is AdamW's; a projected matrix steps by APOLLO's rule wherever it lives.
        return p not in self.projected and super()._on_host(p)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        if p in self.projected:
            self._apollo_update(p, group)
        else:
            super()._update(p, group)

    def _place(self, p: torch.Tensor, key: str, v):
        if p in self.projected:  # projected moments are r x b, not the weight's size: no paged buffer
            return v.to(p.device, non_blocking=v.is_pinned()) if torch.is_tensor(v) else v
        return super()._place(p, key, v)

    def _init_projected(self, p: torch.Tensor) -> dict:
        rank = projected_rank(self.settings.rank, p.shape)
        b = max(p.shape)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=p.device)  # noqa: E731
        return {"step": 0, "exp_avg": zeros(rank, b), "exp_avg_sq": zeros(rank, b), "update_norm": zeros(())}

    def _apollo_update(self, p: torch.Tensor, group: dict) -> None:
        st = self.state[p]
        if not st:
            st.update(self._init_projected(p))
        st["step"] += 1
        t, cfg = st["step"], self.settings
        assert p.grad is not None  # stepped only with a gradient
        grad = p.grad.detach()
        m, n = p.shape
        wide = m <= n
        proj = projection(self.rounding.seed, self.unit_index, self._index[p],
                          self.rounding.step // cfg.update_proj_gap, st["exp_avg"].shape[0], min(m, n), p.device)
        r, channel_sq = _project(grad, proj, wide)
        del proj
        b1, b2 = group["betas"]
        st["exp_avg"].mul_(b1).add_(r, alpha=1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(r, r, value=1 - b2)
        denom = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
        r_tilde = (st["exp_avg"] / (1 - b1 ** t)).div_(denom)
        del denom
        if cfg.scale_type == "channel":
            s = _ratio(r_tilde.norm(dim=0), r.norm(dim=0)) * cfg.scale
            norm = (s.square() * channel_sq).sum().sqrt()
        else:
            s = _ratio(r_tilde.norm(), r.norm()) * cfg.scale
            norm = s * channel_sq.sum().sqrt()
        del r, r_tilde
        # Fira's limiter, on the device (no sync): the first step has no previous norm.
        prev = st["update_norm"]
        limit = torch.where(prev > 0, torch.clamp(GROWTH_LIMIT * prev / norm, max=1.0), 1.0)
        st["update_norm"] = norm * limit
        self._apply(p, grad, s * limit, wide, group)

    def _apply(self, p: torch.Tensor, grad: torch.Tensor, s: torch.Tensor, wide: bool, group: dict) -> None:
        """W ← W (1 − η λ) − η G diag(s), by row chunks; bf16 weights through float32 copies."""
        lr, wd = group["lr"], group["weight_decay"]
        m, n = p.shape
        low = p.dtype != torch.float32
        step = _rows_per_chunk(n)
        for c, lo in enumerate(range(0, m, step)):
            hi = min(lo + step, m)
            w = p.detach()[lo:hi]
            wf = w.float() if low else w
            if wd:
                wf.mul_(1 - lr * wd)
            factor = s if s.dim() == 0 else (s[None, :] if wide else s[lo:hi, None])
            wf.addcmul_(grad[lo:hi].float(), factor, value=-lr)
            if low:
                self.rounding.write(w, wf, self.unit_index, self._index[p], c)


def build_apollo(params: list[torch.nn.Parameter], section: OptimizerSection, rounding: Rounding,
                 unit_index: int, layer: bool) -> Apollo:
    """The unit's optimizer: a decoder layer's matrices projected; weight decay on >= 2-D tensors."""
    projected = [p for p in params if layer and p.ndim == 2]
    return Apollo(param_groups(params), settings=ApolloSettings.of(section), projected=projected, lr=section.lr,
                  betas=section.betas, eps=section.eps, weight_decay=section.weight_decay,
                  rounding=rounding, unit_index=unit_index)
