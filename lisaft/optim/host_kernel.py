"""The AdamW step on the CPU in one pass per element (numba; docs/memory.md says why numba).

Each element's weight, gradient and moments are read once and written once; everything in
between stays in registers. Weights and gradients are float32 or bfloat16 (bf16 arrays are
handed over as their uint16 bits), moments float32, bfloat16 or bitsandbytes' blockwise 8-bit
format (its dynamic code books, 256-element blocks, absmax per block), so a run may move between
this kernel and bitsandbytes' at resume.

Rounding noise is a counter hash of (key, element): the key comes from (seed, step, unit,
parameter) as lisaft/optim/rounding.py derives it, the element is the index in the parameter, so
the noise is a pure function of the run's position and costs a few integer operations.

The math, in float32 and in this order (lisaft/optim/host_reference.py does the same in torch,
and the tests hold the two bit for bit):
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


@numba.njit(inline="always", error_model="numpy")
def _nearest(code, lut, x):
    """Index of the code book entry nearest x, ties to the lower one. The table gives the largest
    entry at or below every float with x's bf16 truncation; bitsandbytes' code books hold at most
    one entry inside any bf16 interval (nearest_table checks), so one step up finds the pair
    around x. Steps are 0/1 arithmetic, not branches, so the loop vectorizes with gathers."""
    j = np.int32(lut[np.uint32(_f32_bits(x)) >> np.uint32(16)])
    j += np.int32((j < 255) & (code[min(j + 1, 255)] <= x))
    up = min(j + 1, 255)
    j += np.int32((j < 255) & ((code[up] - x) < (x - code[j])))
    return np.uint8(j)


@numba.njit(inline="always", error_model="numpy")
def _abs_bits(x):
    # |x| as its bits: for non-NaN floats integer order is float order, and an integer maximum
    # vectorizes where a float one (NaN rules) does not.
    return np.uint32(_f32_bits(x)) & np.uint32(0x7FFFFFFF)


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def step_8bit(w, g, qm, qv, am, av, code1, lut1, code2, lut2, s, offset, k1, k2, stochastic):
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
            _block_quantize(qm[lo:hi], mb, am[b], code1, lut1)
            _block_quantize(qv[lo:hi], vb, av[b], code2, lut2)


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
def _block_quantize(q, x, amax, code, lut):
    # bitsandbytes' quantizer stores x / absmax; an all-zero block divides by 1 instead.
    r = np.float32(1) / amax if amax > 0 else np.float32(1)
    for i in range(q.shape[0]):
        q[i] = _nearest(code, lut, x[i] * r)


def nearest_table(code: np.ndarray) -> np.ndarray:
    """For each bf16 bit pattern, the largest index j with code[j] at or below every float32 that
    truncates to it (0 when none): where _nearest starts. A negative pattern's floats reach down
    to the next pattern's value, a positive one's start at its own."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    neg = bits >= 0x8000
    lower = (np.where(neg, np.minimum(bits + 1, 0xFFFF), bits) << 16).view(np.float32)
    upper = (np.where(neg, bits, np.minimum(bits + 1, 0xFFFF)) << 16).view(np.float32)
    ok = ~(np.isnan(lower) | np.isnan(upper))
    # entries in (lower, upper): a positive pattern's upper end belongs to the next pattern
    top = np.where(neg, np.searchsorted(code, upper, side="right"), np.searchsorted(code, upper, side="left"))
    inside = top[ok] - np.searchsorted(code, lower[ok], side="right")
    if inside.max() > 1:  # _nearest's single step would not reach the entry below x
        raise ValueError("code book has two entries inside one bfloat16 interval")
    j = np.searchsorted(code, lower, side="right").astype(np.int64) - 1
    j[~ok] = 0
    return np.clip(j, 0, 255).astype(np.uint8)
