"""Writing float32 results into bfloat16 weights without losing small updates.

At fine-tuning learning rates most AdamW steps are smaller than half a bf16 ulp, and
round-to-nearest drops them; stochastic rounding keeps their expected value (docs/precision.md).
"""

from __future__ import annotations

import threading

import torch


def _mix(*values: int) -> int:
    """splitmix64 over the values: a well-spread 63-bit seed from small integers."""
    h = 0x9E3779B97F4A7C15
    for x in values:
        h = (h ^ (x & 0xFFFF_FFFF_FFFF_FFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFF_FFFF_FFFF_FFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFF_FFFF_FFFF_FFFF
        h ^= h >> 29
    return h & 0x7FFF_FFFF_FFFF_FFFF


class Rounding:
    """How float32 results are written into bfloat16 weights.

    stochastic: round up with probability equal to the distance to the lower bf16 neighbour, so
    an update far below one ulp still moves the weight by its expected value. The noise for each
    chunk comes from a generator re-seeded with (training.seed, optimizer step, unit, parameter,
    chunk): a pure function of the run's position, like LISA's sampler, so resume, data-parallel
    replicas, sharded state and offloading all see the same noise with no generator state to
    save."""

    def __init__(self, mode: str, seed: int, shard: int | None = None) -> None:
        self.mode = mode
        # training.fsdp: the rank whose slice this process updates, so no two slices share noise.
        self.shard = shard
        self.seed = int(seed)
        self.step = 0
        # One generator per thread and device: the CPU step of cpu_offload rounds several units
        # at once, each re-seeding its own generator, so no thread sees another's seed.
        self._local = threading.local()

    def key(self, *key: int) -> int:
        """The 63-bit noise key of (seed, step, *key[, shard]): the host kernel hashes it with each
        element's index (lisaft/optim/host_step.py), this class seeds a generator with it."""
        if self.shard is not None:
            key = (*key, self.shard)
        return _mix(self.seed, self.step, *key)

    def write(self, dst: torch.Tensor, src: torch.Tensor, *key: int) -> None:
        """dst (bf16) <- src (float32, consumed)."""
        if self.mode == "stochastic" and dst.dtype == torch.bfloat16:
            generators = self._local.__dict__.setdefault("generators", {})
            gen = generators.get(src.device)
            if gen is None:
                gen = generators[src.device] = torch.Generator(device=src.device)
            gen.manual_seed(self.key(*key))
            noise = torch.randint(0, 1 << 16, src.shape, generator=gen, device=src.device, dtype=torch.int32)
            # Adding below the 16 bits bf16 keeps, then truncating, rounds the magnitude up with
            # exactly the probability of its discarded fraction (sign-magnitude floats).
            src.view(torch.int32).add_(noise).bitwise_and_(-65536)
            del noise
        dst.copy_(src)
