"""What a CUDA training process holds beyond its tensors (lisaft/env/allocator.py picks the
allocator setting these depend on).

Each term is a documented fact of PyTorch or CUDA, or a figure fitted to the NVML measurements
listed in docs/memory.md (the GPU runs of issue 12), and says which:

- `cuda_context`: the CUDA context of a PyTorch process before any kernel ran. Measured as
  NVML-used with the context alone on an H200 (torch 2.11+cu130): 0.60 GiB.
- `cuda_kernels`: what NVML-used grows by once training has run, beyond the context, the
  caching allocator's reserve and paged optimizer state: kernel images loaded lazily
  (CUDA_MODULE_LOADING=LAZY, PyTorch's default) for every kernel the step uses (PyTorch's own,
  cuBLAS/cuBLASLt's GEMMs, bitsandbytes' optimizer kernels) and the libraries' device-side
  state. FITTED: 0.87 GiB (LISA recipe) and 0.81 GiB (full fine-tuning, in_backward) were
  measured; the estimate takes 860 MiB. Not seen by torch.cuda.memory_* counters.
- `cublas_workspace`: PyTorch gives every (cuBLAS handle, stream) pair a workspace from the
  caching allocator (aten/src/ATen/cuda/CublasHandlePool.cpp): 32 MiB on compute capability 9
  and newer (Hopper, Blackwell), 8 MiB + 128 KiB before; cuBLASLt shares it. Handles are per
  thread, and training runs matmuls on two: the forward on the main thread, the backward on
  autograd's device thread. The estimate takes the 32 MiB size (the larger) for both.
- `allocator_overhead`: the caching allocator reserves more than it hands out. With its
  default segments, blocks freed by one phase (activations, recompute buffers) are cached in
  segments that a later phase's differently sized tensors (gradients) cannot reuse. FITTED:
  reserved was 7% (LISA) and 11% (full, in_backward) above the estimated allocated bytes; the
  estimate takes 9%. With `expandable_segments:True` a segment grows and shrinks in place by
  mapping pages, so freed blocks coalesce and are reused whatever the next size: ASSUMED 2%
  until benchmarks/gpu_8b_24gb.py's headroom run measures it. Either way the reserve is never
  below one 2 MiB segment of the small pool (allocations up to 1 MiB) plus one 20 MiB segment
  of the large pool (allocations of 1-10 MiB): the allocator's own granularity
  (c10/cuda/CUDACachingAllocator.cpp, kSmallBuffer and kLargeBuffer).

NCCL's buffers (multi-GPU runs only) and cuDNN's workspace (no convolutions in a decoder) are
not modelled: neither exists in a single-GPU run of the models lisaft trains.
"""

from __future__ import annotations

MiB = 1024**2

CUDA_CONTEXT_BYTES = 600 * MiB
CUDA_KERNELS_BYTES = 860 * MiB
CUBLAS_WORKSPACE_BYTES = 32 * MiB
MATMUL_THREADS = 2  # the forward's thread and autograd's backward thread
RESERVE_DEFAULT = 0.09
RESERVE_EXPANDABLE = 0.02
MIN_RESERVE_BYTES = 2 * MiB + 20 * MiB

def allocator_overhead(allocated: int, expandable: bool) -> int:
    """Reserved minus allocated at the peak, for `allocated` bytes handed out."""
    rate = RESERVE_EXPANDABLE if expandable else RESERVE_DEFAULT
    return max(int(rate * allocated), MIN_RESERVE_BYTES)


def cublas_workspace_bytes() -> int:
    return MATMUL_THREADS * CUBLAS_WORKSPACE_BYTES
