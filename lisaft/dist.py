"""Process-group facts for the loop. Single-process runs see rank 0 of world 1, so every file
write can be guarded by `is_main()` from the start and data-parallel runs need no other change."""

from __future__ import annotations

import os

import torch.distributed as torch_dist


def is_initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    return torch_dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return torch_dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_initialized():
        torch_dist.barrier()
