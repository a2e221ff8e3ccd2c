"""The AdamW step of one parameter on the CPU through the fused host kernel.

lisaft/optim/adamw.py calls `step_param` for every parameter that lives in host memory (resident
training on `training.device: cpu`, and `optimizer.cpu_offload`'s host copies), so both run the
same arithmetic and stay bit for bit equal; a float32 weight with float32 moments and a dense
gradient steps by torch's fused AdamW kernel instead, in both alike (adamw.py `_on_host`).
Where numba (the `host-step` extra) cannot load, `available()` is false after one warning line
and the caller keeps its torch path; bfloat16 moments, which that path lacks, then run
host_reference's torch version of the same math.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from lisaft.console import warn
from lisaft.optim import host_reference

_kernel = None
_tried = False
_code_books: dict[str, tuple] = {}
TASKS_PER_GRAB = 4  # host_kernel.TASK elements each (16 KiB of 8-bit moments)
# numba's default thread pool (workqueue) must not be entered by two threads at once; each call
# already spreads over every core, so callers take turns.
_lock = threading.Lock()
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Elements below which a call runs on the calling thread alone: torch's at::internal::GRAIN_SIZE.
SERIAL_BELOW = 1 << 15

_missing = ""  # why the kernel did not load
_warned = False
# Below this many parameters stepped on the host the kernel's start-up (numba's compile, its
# thread pool) outweighs what it saves: the quickstart trains faster on torch's path.
FUSED_MATTERS = 2**25
# Seconds per 10^9 parameters on torch's path and in the kernel, float32 and 8-bit moments
# (docs/memory.md, benchmarks/results/host_step/host_step.json: 2 cores, bf16 weights).
SECONDS_PER_G = {False: (5.91, 0.66), True: (15.39, 1.61)}


def available() -> bool:
    """Whether the kernel loaded (`note_missing` says what its absence costs a run)."""
    global _kernel, _tried, _missing
    if not _tried:
        _tried = True
        try:
            from lisaft.optim import host_kernel
            _kernel = host_kernel
        except ImportError as e:
            _missing = str(e)
    return _kernel is not None


def note_missing(params: int, eight_bit: bool) -> None:
    """Warn once when the kernel did not load and a run steps enough parameters on the host for
    it to matter, with the cost for that many."""
    global _warned
    if available() or params < FUSED_MATTERS or _warned:
        return
    _warned = True
    torch_s, kernel_s = SECONDS_PER_G[eight_bit]
    warn(f"host step kernel unavailable ({_missing}; pip install 'lisaft[host-step]'): the CPU optimizer step of "
         f"{params / 1e6:.0f}M parameters runs torch's unfused path, measured at about {params * torch_s / 1e9:.2g} s "
         f"per step where the kernel takes {params * kernel_s / 1e9:.2g} s (2 cores, docs/memory.md)")


def adam_scalars(group: dict, step: int) -> np.ndarray:
    """The per-step constants of the update, each rounded to float32 once."""
    lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
    return np.array([1 - lr * wd, b1, 1 - b1, b2, 1 - b2, lr / (1 - b1 ** step),
                     1 / math.sqrt(1 - b2 ** step), eps], dtype=np.float32)


def noise_keys(key: int) -> tuple[int, int]:
    """Two 32-bit words of a parameter's 63-bit rounding key (Rounding.key)."""
    return key & 0xFFFFFFFF, (key >> 31) & 0xFFFFFFFF


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _codes(code1: torch.Tensor, code2: torch.Tensor) -> tuple:
    if "maps" not in _code_books:
        assert _kernel is not None  # only the kernel's path reads the tables
        c1, c2 = code1.numpy(), code2.numpy()
        _code_books["maps"] = tuple(a for c in (c1, c2) for a in (c, _kernel.nearest_table(c), _kernel.midpoints(c)))
    return _code_books["maps"]


def accumulate(acc: torch.Tensor, g: torch.Tensor) -> None:
    """acc += g for a contiguous host accumulator: the kernel's one pass over every core where it
    loaded, torch's add_ otherwise; the same bits either way (float32 sum, rounded to nearest)."""
    if not (available() and acc.dtype in _KERNEL_DTYPES and g.dtype in _KERNEL_DTYPES) or g.is_sparse:
        acc.add_(g)
        return
    assert _kernel is not None and acc.is_contiguous()
    a, b = _np(acc.view(-1)), _np(g.reshape(-1))
    with _lock:
        _take_threads(a.shape[0])
        _kernel.accumulate(a, b)


def _take_threads(elements: int) -> None:
    assert _kernel is not None
    # numba's thread count is per calling thread: follow torch's (training.threads), except for a
    # tensor too small to share: there a fork and join costs more than the work, and on a busy
    # machine the join waits for a thread the scheduler parked (one call took 24 ms at load 10).
    # torch's own CPU kernels run inline below the same grain.
    threads = 1 if elements < SERIAL_BELOW else min(torch.get_num_threads(), _kernel.numba.config.NUMBA_NUM_THREADS)
    _kernel.numba.set_num_threads(max(1, threads))
    if threads <= 1:
        return
    # Tasks are handed out a few at a time instead of split evenly up front: when another
    # process holds one core, the other thread takes the busy one's share (8-bit on two cores
    # shared with one other process: 3.0 instead of 4.8 ns per element). Tasks are whole 8-bit
    # blocks and independent, so the result is the same bit for bit in any order.
    _kernel.numba.set_parallel_chunksize(TASKS_PER_GRAB)


def step_chunk(w: torch.Tensor, g: torch.Tensor, st: dict, lo: int, hi: int, s: np.ndarray, key: int,
               stochastic: bool, maps: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Elements lo:hi of a parameter: w and g are those elements (1-D), st the whole state; an
    8-bit state's lo is a multiple of 256. Kernel if loaded, else the torch reference."""
    k1, k2 = noise_keys(key)
    m, v = st["exp_avg"].view(-1)[lo:hi], st["exp_avg_sq"].view(-1)[lo:hi]
    eight = m.dtype == torch.uint8
    if eight:
        blo, bhi = lo // host_reference.BLOCK, -(-hi // host_reference.BLOCK)
        am, av = st["absmax1"][blo:bhi], st["absmax2"][blo:bhi]
    if _kernel is None:
        sl = [float(x) for x in s]
        if eight:
            assert maps is not None  # an 8-bit state always comes with its code books
            host_reference.step_8bit(w, g, m, v, am, av, maps[0], maps[1], sl, lo, k1, k2, stochastic)
        else:
            host_reference.step_dense(w, g, m, v, sl, lo, k1, k2, stochastic)
        return
    with _lock:
        _take_threads(hi - lo)
        if eight:
            assert maps is not None
            _kernel.step_8bit(_np(w), _np(g), m.numpy(), v.numpy(), am.numpy(), av.numpy(), *_codes(*maps), s,
                              lo, np.uint32(k1), np.uint32(k2), stochastic)
        else:
            _kernel.step_dense(_np(w), _np(g), _np(m), _np(v), s, lo, np.uint32(k1), np.uint32(k2), stochastic)
