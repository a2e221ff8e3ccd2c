"""The AdamW step on the CPU in one pass per element (numba; docs/memory.md says why numba).

Each element's weight, gradient and moments are read once and written once; everything in
between stays in registers. Weights and gradients are float32 or bfloat16 (bf16 arrays are
handed over as their uint16 bits), moments float32, bfloat16 or bitsandbytes' blockwise 8-bit
format (its dynamic code books, 256-element blocks, absmax per block), so a run may move between
this kernel and bitsandbytes' at resume.

Rounding noise is a counter hash of (key, element): the key comes from (seed, step, unit,
parameter) as lisaft/optim/rounding.py derives it, the element is the index in the parameter, so
the noise is a pure function of the run's position and costs a few integer operations.

`accumulate` is the other pass over a parameter's elements in host memory: a later micro-batch's
gradient added into its accumulator (optimizer.cpu_offload), rounded as torch's add_ rounds.

The math, in float32 and in this order (lisaft/optim/host_reference.py does the same in torch,
and the tests hold the two within an ulp on every CPU, docs/memory.md):
    w = w * decay                       decay = 1 - lr * weight_decay
    m = m * b1 + g * (1 - b1)
    v = v * b2 + (g * (1 - b2)) * g
    w = w - step_size * (m / (sqrt(v) * inv_sqrt_bc2 + eps))
with step_size = lr / (1 - b1^t) and inv_sqrt_bc2 = 1 / sqrt(1 - b2^t), computed in float64 and
rounded to float32 once. 8-bit moments: m, v are decoded with the block's old absmax, updated,
the new absmax is the block's largest |m| (|v|), and each is stored as the nearest code.
"""

from __future__ import annotations

import numpy as np

try:  # the optional extra `host-step`; lisaft/optim/host_step.py falls back without it
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic, overload
except ImportError as e:  # pragma: no cover - exercised by the fallback test through host_step
    raise ImportError(f"numba is not installed ({e})") from e

BLOCK = 256  # bitsandbytes' quantization block
TASK = 16 * BLOCK  # elements per parallel task: whole 8-bit blocks, a few cache lines of each array
M32 = 0xFFFFFFFF


@intrinsic
def _f32_bits(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return sig, codegen


@intrinsic
def _bits_f32(typingctx, x):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


def _load(a, i):  # pragma: no cover - replaced by the overload below inside compiled code
    raise NotImplementedError


def _store(a, i, x, noise):  # pragma: no cover
    raise NotImplementedError


@overload(_load)
def _load_impl(a, i):
    if a.dtype == types.uint16:  # bfloat16 bits
        return lambda a, i: _bits_f32(np.uint32(a[i]) << np.uint32(16))
    return lambda a, i: a[i]


@overload(_store)
def _store_impl(a, i, x, noise):
    if a.dtype == types.uint16:
        def store_bf16(a, i, x, noise):
            # noise below the 16 bits kept, then truncation: stochastic rounding of the
            # magnitude with uniform noise, round-to-nearest-even with 0x7FFF plus the low kept bit.
            a[i] = np.uint16(((np.uint32(_f32_bits(x)) + noise) & M32) >> np.uint32(16))
        return store_bf16

    def store_f32(a, i, x, noise):
        a[i] = x
    return store_f32


@numba.njit(inline="always", error_model="numpy")
def _weight_noise(x, h, stochastic_mask):
    """Stochastic: 16 random bits; nearest: 0x7FFF plus the lowest kept bit (ties to even).
    Selected by masks, not a branch, so the loop vectorizes."""
    nearest = np.uint32(0x7FFF) + ((np.uint32(_f32_bits(x)) >> np.uint32(16)) & np.uint32(1))
    return (h & stochastic_mask) | (nearest & ~stochastic_mask & np.uint32(0xFFFF))


@numba.njit(inline="always", error_model="numpy")
def _hash(i, k1, k2):
    """murmur3's 32-bit finaliser over the element's counter, offset and scrambled by the key."""
    h = np.uint32((((np.uint64(i) + k1) & M32) * np.uint64(0x9E3779B1)) & M32) ^ k2
    h ^= h >> np.uint32(16)
    h = np.uint32((np.uint64(h) * np.uint64(0x85EBCA6B)) & M32)
    h ^= h >> np.uint32(13)
    h = np.uint32((np.uint64(h) * np.uint64(0xC2B2AE35)) & M32)
    h ^= h >> np.uint32(16)
    return h


@numba.njit(inline="always", error_model="numpy")
def _adam(w, g, m, v, s0, s1, s2, s3, s4, s5, s6, s7):
    """One element; s = (decay, b1, 1-b1, b2, 1-b2, step_size, inv_sqrt_bc2, eps) as float32."""
    w = w * s0
    m = m * s1 + g * s2
    v = v * s3 + (g * s4) * g
    w = w - s5 * (m / (np.sqrt(v) * s6 + s7))
    return w, m, v


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def step_dense(w, g, m, v, s, offset, k1, k2, stochastic):
    """Moments float32 or bfloat16 (uint16 bits, always stochastically rounded)."""
    n = w.shape[0]
    sm = np.uint32(0xFFFF) if stochastic else np.uint32(0)
    for t in numba.prange((n + TASK - 1) // TASK):
        lo = t * TASK
        ws, gs, ms, vs = w[lo:lo + TASK], g[lo:lo + TASK], m[lo:lo + TASK], v[lo:lo + TASK]
        _dense_task(ws, gs, ms, vs, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], offset + lo, k1, k2, sm)


@numba.njit(inline="never", nogil=True, cache=True, error_model="numpy")
def _dense_task(w, g, m, v, s0, s1, s2, s3, s4, s5, s6, s7, offset, k1, k2, sm):
    # One task as its own function with scalar arguments: LLVM then vectorizes the loop.
    for i in range(w.shape[0]):
        h = _hash(offset + i, k1, k2)
        wi, mi, vi = _adam(_load(w, i), _load(g, i), _load(m, i), _load(v, i), s0, s1, s2, s3, s4, s5, s6, s7)
        _store(w, i, wi, _weight_noise(wi, h, sm))
        _store(m, i, mi, h >> np.uint32(16))
        _store(v, i, vi, _hash(offset + i, k2, k1) & np.uint32(0xFFFF))


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def accumulate(acc, g):
    """acc += g, an accumulated gradient: acc float32 or bfloat16 (uint16 bits), g either. The sum
    in float32, a bf16 accumulator rounded to nearest even: torch's `add_`, bit for bit."""
    n = acc.shape[0]
    for t in numba.prange((n + TASK - 1) // TASK):
        lo = t * TASK
        _accumulate_task(acc[lo:lo + TASK], g[lo:lo + TASK])


def _add(acc, g, i):  # pragma: no cover - replaced by the overload below inside compiled code
    raise NotImplementedError


@overload(_add)
def _add_impl(acc, g, i):
    if acc.dtype == types.uint16:
        def add_bf16(acc, g, i):
            # Round to nearest even in 32-bit lanes (_store's mask would widen them to 64 bits).
            b = _f32_bits(_load(acc, i) + _load(g, i))
            acc[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return add_bf16

    def add_f32(acc, g, i):
        acc[i] = acc[i] + _load(g, i)
    return add_f32


@numba.njit(inline="never", nogil=True, cache=True, error_model="numpy")
def _accumulate_task(acc, g):
    for i in range(acc.shape[0]):
        _add(acc, g, i)


@numba.njit(inline="always", error_model="numpy")
def _nearest(lut, mid, x):
    """Index of the code book entry nearest x, ties to the lower one: the number of midpoints at
    or below x. lut gives that count at the lowest float sharing x's upper 16 bits, and at most
    one midpoint lies among those floats (nearest_table checks), so one compare finishes it;
    mid[255] is NaN, which no x reaches."""
    j = lut[np.uint32(_f32_bits(x)) >> np.uint32(16)]
    return j + np.uint8(x >= mid[j])


@numba.njit(inline="always", error_model="numpy")
def _abs_bits(x):
    # |x| as its bits: for non-NaN floats integer order is float order, and an integer maximum
    # vectorizes where a float one (NaN rules) does not.
    # (numba widens integer operations to 64 bits: the cast keeps the maximum in 32-bit lanes)
    return np.uint32(np.uint32(_f32_bits(x)) & np.uint32(0x7FFFFFFF))


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def step_8bit(w, g, qm, qv, am, av, code1, lut1, mid1, code2, lut2, mid2, s, offset, k1, k2, stochastic):
    """bitsandbytes' blockwise 8-bit moments; offset is a multiple of BLOCK."""
    n = w.shape[0]
    sm = np.uint32(0xFFFF) if stochastic else np.uint32(0)
    for t in numba.prange((n + TASK - 1) // TASK):
        mb = np.empty(BLOCK, np.float32)  # one block's updated moments, between the two passes
        vb = np.empty(BLOCK, np.float32)
        for b in range(t * TASK // BLOCK, min((n + BLOCK - 1) // BLOCK, (t + 1) * TASK // BLOCK)):
            lo = b * BLOCK
            hi = min(n, lo + BLOCK)
            am[b], av[b] = _block_update(w[lo:hi], g[lo:hi], qm[lo:hi], qv[lo:hi], am[b], av[b], mb, vb, code1,
                                         code2, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], offset + lo, k1, k2, sm)
            _block_quantize(qm[lo:hi], mb, am[b], lut1, mid1)
            _block_quantize(qv[lo:hi], vb, av[b], lut2, mid2)


@numba.njit(inline="never", nogil=True, cache=True, error_model="numpy")
def _block_update(w, g, qm, qv, am, av, mb, vb, code1, code2, s0, s1, s2, s3, s4, s5, s6, s7, offset, k1, k2, sm):
    """Update one block and write its weights; the new moments go to mb, vb. Returns the new
    absmaxes."""
    for i in range(w.shape[0]):  # decoding is a table lookup: its own loop, the next one vectorizes
        mb[i], vb[i] = code1[qm[i]] * am, code2[qv[i]] * av
    bm, bv = np.uint32(0), np.uint32(0)
    for i in range(w.shape[0]):
        wi, mi, vi = _adam(_load(w, i), _load(g, i), mb[i], vb[i], s0, s1, s2, s3, s4, s5, s6, s7)
        _store(w, i, wi, _weight_noise(wi, _hash(offset + i, k1, k2), sm))
        mb[i], vb[i] = mi, vi
        bm, bv = max(bm, _abs_bits(mi)), max(bv, _abs_bits(vi))
    return _bits_f32(bm), _bits_f32(bv)


@numba.njit(inline="never", nogil=True, cache=True, error_model="numpy")
def _block_quantize(q, x, amax, lut, mid):
    # bitsandbytes' quantizer stores x / absmax; an all-zero block divides by 1 instead.
    r = np.float32(1) / amax if amax > 0 else np.float32(1)
    for i in range(q.shape[0]):
        q[i] = _nearest(lut, mid, x[i] * r)


def _order(bits: np.ndarray) -> np.ndarray:
    """float32 bits -> int64 keys in the floats' order (negative floats: larger bits, smaller)."""
    k = bits.astype(np.int64)
    return np.where(k >= 1 << 31, (1 << 31) - 1 - k, k)


def _unorder(k: np.ndarray) -> np.ndarray:
    return np.where(k >= 0, k, (1 << 31) - 1 - k).astype(np.uint32)


def midpoints(code: np.ndarray) -> np.ndarray:
    """For each pair of neighbouring entries j, j+1, the smallest float32 x between them for which
    code[j+1] - x < x - code[j] in float32 arithmetic (host_reference.nearest_code's rule): both
    sides are monotone in x, so from there on x rounds up. Found by bisection on the floats' order;
    a NaN in place 255."""
    c = code.astype(np.float32)
    lo, hi = _order(c[:-1].view(np.uint32)), _order(c[1:].view(np.uint32))  # rule false at lo, true at hi
    while np.any(hi - lo > 1):
        half = (lo + hi) // 2
        x = _unorder(half).view(np.float32)
        up = (c[1:] - x) < (x - c[:-1])
        hi, lo = np.where(up, half, hi), np.where(up, lo, half)
    return np.append(_unorder(hi).view(np.float32), np.float32("nan"))


def nearest_table(code: np.ndarray) -> np.ndarray:
    """_nearest's table, one entry per bf16 bit pattern (the floats sharing their upper 16 bits):
    the number of midpoints at or below the lowest of those floats. Raises where two midpoints
    fall among one pattern's floats, which one compare could not tell apart."""
    t = midpoints(code)[:-1]
    p = np.arange(1 << 16, dtype=np.uint32)
    neg = p >= 0x8000
    first, last = (p << 16).view(np.float32), ((p << 16) | 0xFFFF).view(np.float32)
    last = np.where(np.isnan(last), first, last)  # the infinities: their pattern's other floats are NaN
    lo, hi = np.where(neg, last, first), np.where(neg, first, last)
    ok = ~np.isnan(lo)
    base = np.searchsorted(t, lo, side="right")
    if (np.searchsorted(t, hi, side="right") - base)[ok].max() > 1:
        raise ValueError("code book has two midpoints inside one bfloat16 interval")
    return np.where(ok, base, 0).astype(np.uint8)
