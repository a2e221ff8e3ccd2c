"""Host tensors carved from power-of-two slabs: no overlap, and arena_bytes is what HostArena takes."""

import random

import torch

from lisaft.optim.host_arena import MIN_SLAB_BYTES, HostArena, arena_bytes, slab_size


def test_slab_size_is_a_power_of_two_that_holds_the_largest_tensor():
    assert slab_size(1_050_673_152, 16 * 2**30) == 2**30  # Llama-3.1-8B's embedding in bf16
    assert slab_size(1000, 16 * 2**30) == MIN_SLAB_BYTES
    assert slab_size(1000, 5000) < MIN_SLAB_BYTES  # a tiny model takes a tiny slab


def test_tensors_do_not_overlap_and_the_packing_is_predicted():
    rng = random.Random(0)
    shapes = [(rng.randint(1, 300),) for _ in range(200)]
    dtypes = [rng.choice([torch.bfloat16, torch.float32, torch.int64]) for _ in shapes]
    sizes = [s[0] * d.itemsize for s, d in zip(shapes, dtypes)]
    arena = HostArena(4096, pin=False)
    tensors = [arena.tensor(s, d) for s, d in zip(shapes, dtypes)]
    for i, t in enumerate(tensors):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(tensors))
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    assert arena.nbytes == arena_bytes(sizes, 4096) >= sum(sizes)
