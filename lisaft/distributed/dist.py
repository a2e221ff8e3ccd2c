"""Process-group facts for the loop. Single-process runs see rank 0 of world 1, so every file
write can be guarded by `is_main()` from the start and data-parallel runs need no other change."""

from __future__ import annotations

import importlib
import os
from datetime import timedelta

import torch
import torch.distributed as torch_dist

from lisaft.errors import LisaftError


def is_initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    return torch_dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return torch_dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    """Processes of this run on this machine (torchrun sets LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_initialized():
        torch_dist.barrier()


# Rank 0 alone joins the exported model's shards and merges adapters while the other ranks wait
# at the next collective: NCCL's default 10 minutes is less than that takes for 8B on a slow disk.
TIMEOUT = timedelta(minutes=60)


def local_cuda_index() -> int:
    """The CUDA device this process drives, as CUDA numbers the devices it sees: LOCAL_RANK when
    every GPU of the machine is visible, 0 when a launcher shows each process its own one."""
    count = torch.cuda.device_count()
    if count == 1 or local_rank() < count:
        return 0 if count == 1 else local_rank()
    raise LisaftError(f"training.device: LOCAL_RANK {local_rank()} but this process sees {count} CUDA "
                      "devices; show each process one GPU (CUDA_VISIBLE_DEVICES) or all of them")


def resolve_device(choice: str) -> torch.device:
    """training.device as this process's device: cuda is this rank's GPU (local_cuda_index)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LisaftError("training.device: cuda was asked for but no CUDA device is visible")
        return torch.device("cuda", local_cuda_index())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL for a CUDA training device, gloo for the CPU, whether or not CUDA is visible."""
    return "nccl" if device.type == "cuda" else "gloo"


# torch modules whose functions take `group=group.WORLD` as a default argument: imported once the
# group exists (transformers imports them lazily, loading a config), each default holds the group,
# so destroy_process_group cannot free it and its gloo threads live on into interpreter exit,
# where one sometimes aborts the finished run ("terminate called without an active exception").
# Imported before the group exists, the defaults are None.
_WORLD_DEFAULTS = ("torch.distributed.nn.functional", "torch.distributed.optim.zero_redundancy_optimizer",
                   "torch.distributed.fsdp.sharded_grad_scaler")


def init_from_env(device: torch.device | None = None) -> bool:
    """Join the process group torchrun describes in the environment, with the backend of the
    training device (default: the CPU). Returns True when this process is a rank of a torchrun
    launch, even of one process (training.fsdp on one rank needs the group)."""
    if is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    device = torch.device("cpu") if device is None else device
    backend = backend_for(device)
    for name in _WORLD_DEFAULTS:
        importlib.import_module(name)
    if backend == "nccl":
        torch.cuda.set_device(device)
        # device_id binds the group to this GPU at once: no guess from the rank, no lazy init.
        torch_dist.init_process_group(backend=backend, timeout=TIMEOUT, device_id=device)
    else:
        torch_dist.init_process_group(backend=backend, timeout=TIMEOUT)
    return True


def shutdown() -> None:
    if is_initialized():
        torch_dist.destroy_process_group()


def launched() -> bool:
    """Whether this process is a rank that torchrun started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def leave_process(code: int) -> None:
    """End a torchrun rank whose command has finished and left the group, without the
    interpreter's teardown of C++ objects. Objects a collective backend keeps beyond
    destroy_process_group (FSDP's device mesh keeps gloo's threads alive) are destroyed there in
    no set order, and a thread still joinable then aborts the finished run ("terminate called
    without an active exception", SIGABRT, docs/distributed.md). Everything Python's own exit
    does first is done here: the other threads are waited for, the atexit functions run, the
    streams are flushed."""
    import logging
    import sys

    from lisaft import internals

    internals.run_exit_handlers()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any: stop decisions must be collective, or the
    ranks would part ways at the next collective."""
    if not is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32,
                     device="cuda" if torch_dist.get_backend() == "nccl" else "cpu")
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return bool(t.item())


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value`, on every rank: a choice every rank must share (the
    memory budget behind lisa.active_layers: auto) must not depend on which rank made it."""
    if not is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device="cuda" if torch_dist.get_backend() == "nccl" else "cpu")
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MIN)
    return int(t.item())


# Collectives of the training loop (no-ops in a single process).


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if is_initialized():
        torch_dist.all_reduce(value)
    return value


def all_reduce_grads(params: list) -> None:
    """Sum the trainable set's gradients over ranks. The loss is already divided by the global
    token count, so a sum gives exactly the single-process gradient."""
    if not is_initialized() or world_size() == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        # One collective per dtype over a flat copy, not one per tensor.
        flat = torch.cat([g.reshape(-1) for g in group])
        torch_dist.all_reduce(flat)
        _copy_back(flat, group)


@torch.no_grad()
def broadcast_from_owners(params: list, owner: dict) -> None:
    groups: dict = {}
    for p in params:
        groups.setdefault((owner[id(p)], p.dtype), []).append(p.data)
    for (src, _), tensors in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        torch_dist.broadcast(flat, src=src)
        _copy_back(flat, tensors)


def _copy_back(flat: torch.Tensor, tensors: list) -> None:
    for t, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
        t.copy_(part.view_as(t))
