"""training.fsdp: weights, gradients and optimizer state sharded over ranks with FSDP2.

Every decoder layer is one FSDP unit (`torch.distributed.fsdp.fully_shard`), and the root module
holds the rest: the embeddings and the head (output projection and final norm), which the
chunked loss needs gathered from the forward to the end of backward (see shard_model). A unit's
parameters become DTensors sharded on dim 0; a rank holds its slice and gathers a layer's whole
weights only around that layer's forward and backward, the root's from its forward to the end of
backward.

What lisaft keeps of its own, and why:
- The loss is already divided by the global token count, so gradients are summed over ranks
  (divide factor 1) and the hand-written all-reduce of data parallelism is skipped: FSDP's
  reduce-scatter leaves each rank the summed gradient of its slice, reduced in float32.
- lisaft's AdamW keeps plain-tensor state and its kernels are elementwise (8-bit: blockwise), so
  each unit's optimizer steps this rank's local slices: `LocalShards` gives every sharded
  parameter a plain tensor over the same storage, and hands it the local slice of the gradient.
- LISA flips requires_grad on the sharded parameters between steps; a frozen unit is still
  gathered for forward and backward but gets no gradient, no reduce-scatter and no moments.
  Every rank samples the same layers by construction; `check_same_layers` proves it at each
  switch, so a rank that disagrees fails with one line instead of hanging in a collective.
- Checkpoints: the weights go through torch.distributed.checkpoint (`ShardFiles`), and each
  rank writes the moments of its slices (optimizer/rank-R/). A resume on as many ranks restores
  every slice bit for bit; on another number DCP reshards the weights and lisaft/checkpoint/reshard.py the
  moments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from safetensors.torch import load_file
from torch import nn

from lisaft import internals
from lisaft.distributed import dist
from lisaft.errors import CheckpointMismatch, LisaftError
from lisaft.model.parts import ModelParts, pretrained


def shard_model(model: nn.Module, parts: ModelParts, device: torch.device) -> LocalShards:
    """Shard the model in place, one FSDP unit per training unit, on a mesh over every rank on
    the training device (the default mesh would pick CUDA whenever one exists)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.world_size(),))
    # Weights stay in their dtype (bf16 as lisaft trains them); gradients are reduced in float32.
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in parts.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # The head (output projection and final norm) stays in the root unit with the embeddings:
    # lisaft's chunked loss (lisaft/model/loss.py) calls the projection once per chunk of positions and
    # again when backward recomputes each chunk, which only a unit gathered from the forward to
    # the end of backward (the root: fully_shard does not reshard it after forward) survives.
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain sum (gloo has no pre-multiplied sum, and a factor of 1 needs none).
            module.set_force_sum_reduction_for_comms(True)
    return LocalShards(model)


def load_sharded(section, device: torch.device) -> tuple[nn.Module, LocalShards]:
    """model.name_or_path under training.fsdp without the whole model on any rank: built on the
    meta device, sharded as shard_model shards, each rank's slices allocated on `device` and read
    straight from the safetensors files (DCP's Hugging Face reader reads only the rows a slice
    covers, so neither the device nor host RAM ever holds more than this rank's slices). Then the
    buffers the checkpoint does not hold (the rotary inverse frequencies) are computed again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lisaft.model.load import build_on_meta
    from lisaft.model.parts import model_parts

    model, folder = build_on_meta(section, device)
    fresh = _buffer_sources(model, section.name_or_path)
    shards = shard_model(model, model_parts(model, section.layers_path), device)
    model.to_empty(device=device)
    reader = dcp.HuggingFaceStorageReader(str(folder))
    saved = reader.read_metadata().state_dict_metadata
    state = get_model_state_dict(model)
    aliases = _tied_names(model)
    for name in [n for n in state if n not in saved]:
        if aliases.get(name) in saved:
            del state[name]  # a tied weight: reading its twin fills both
        else:
            raise LisaftError(f"model.name_or_path: {section.name_or_path}: its safetensors have no {name}, "
                              "which this architecture needs; under training.fsdp the files must hold the "
                              "model's own parameter names (save it with save_pretrained)")
    with torch.no_grad():
        dcp.load(state, storage_reader=reader)
        for module, source in fresh:
            for name in internals.non_persistent_buffers(module):
                getattr(module, name).copy_(getattr(source, name))
    return model, shards


def _buffer_sources(model: nn.Module, ref: str) -> list[tuple[nn.Module, nn.Module]]:
    """For every module with buffers outside the checkpoint (rotary embeddings: inv_freq), a new
    instance built from its config on the CPU, which computes them as loading would. Checked
    before anything is allocated, so a module that cannot be rebuilt is refused at no cost."""
    out = []
    for name, module in model.named_modules():
        if not internals.non_persistent_buffers(module):
            continue
        try:
            with torch.device("cpu"):
                source = type(module)(module.config)
            ok = all(getattr(source, b).shape == getattr(module, b).shape
                     for b in internals.non_persistent_buffers(module))
        except Exception:
            ok = False
        if not ok:
            raise LisaftError(f"model.name_or_path: {ref}: {name} ({type(module).__name__}) keeps buffers outside "
                              "the checkpoint that lisaft cannot compute again; set training.fsdp false")
        out.append((module, source))
    return out


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Each tied parameter's name, mapped to the first name of the same parameter."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


class LocalShards:
    """Plain tensors over this rank's slices of the sharded parameters, for the optimizers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.rank = dist.rank()
        self._local: dict[int, nn.Parameter] = {}

    def local(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        out = []
        for p in params:
            shadow = self._local.get(id(p))
            if shadow is None:
                with torch.no_grad():
                    # Shares the slice's storage: an update of the shadow is an update of p.
                    shadow = self._local[id(p)] = nn.Parameter(local_tensor(p), requires_grad=False)
            out.append(shadow)
        return out

    def bind_grads(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The local tensors of params, each holding its slice of the reduced gradient."""
        shadows = self.local(params)
        for p, shadow in zip(params, shadows):
            shadow.grad = None if p.grad is None else local_tensor(p.grad)
        return shadows

    def release_grads(self, params: list[nn.Parameter]) -> None:
        for shadow in self.local(params):
            shadow.grad = None

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
        """The global gradient norm (on the device, unread): local sums of squares summed over
        ranks; with max_norm the slices are scaled as clip_grad_norm scales whole gradients."""
        grads = [s.grad for s in self.bind_grads(params) if s.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            sq += g.float().pow(2).sum()
        dist.all_reduce_sum(sq)
        total = sq.sqrt()
        if max_norm is not None:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return total

    def check_same_layers(self, interval: int, layers: list[int]) -> None:
        """Every rank must train the same layers, or the next collective would hang."""
        mine = [interval, *layers]
        every: list = [None] * dist.world_size()
        torch_dist.all_gather_object(every, mine)
        if any(other != mine for other in every):
            raise LisaftError(f"ranks disagree on LISA's layers for interval {interval}: "
                              f"{[o[1:] for o in every]}; every rank must run the same recipe and lisaft")

    def write_hf_model(self, folder: Path) -> None:
        """The model as a Hugging Face folder (weights and config), without the whole model in
        one rank's memory: every rank writes its slices (DCP's Hugging Face writer), then rank 0
        joins them into whole tensors, one tensor in memory at a time, in files of at most
        EXPORT_FILE_BYTES with the usual index. Collective."""
        import shutil

        import torch.distributed.checkpoint as dcp

        state = ShardFiles(self.model).state()
        writer = dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True, enable_consolidation=True,
                                              fqn_to_index_mapping=_file_indices(state))
        dcp.save(state, storage_writer=writer)
        if dist.is_main():
            shutil.rmtree(folder / "sharded")  # the slices, now joined
        if dist.is_main():
            _write_config(self.model, folder)


class ShardFiles:
    """A checkpoint folder component (checkpoint/components.py FolderComponent): shards/, the sharded weights
    and buffers written through torch.distributed.checkpoint (each rank its slices, rank 0 the
    metadata). DCP reads them back on any number of ranks: each rank loads the rows its slices
    cover now, from whichever files hold them, without gathering a unit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state(self) -> dict[str, Any]:  # DCP's state-dict values: the sharded parameters
        """The sharded state dict: DTensors over this rank's slices of the weights."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        # The root keeps its weights gathered after a forward (eval, or the last micro-batch):
        # register the slices again so the state dict holds the sharded parameters.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return get_model_state_dict(self.model)

    def write(self, folder: Path, base: Path | None) -> list[Path]:
        import torch.distributed.checkpoint as dcp

        folder.mkdir(parents=True, exist_ok=True)
        # sync_files: the writer fsyncs what it wrote before the checkpoint's marker is written.
        dcp.save(self.state(), storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
        return []

    @torch.no_grad()
    def read(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        if any(folder.glob("rank-*.safetensors")):
            self._read_rank_files(folder)
            return
        if not (folder / ".metadata").is_file():
            raise CheckpointMismatch(f"checkpoint {folder.parent.name} has no weight shards (written without "
                                     "training.fsdp)")
        # In place: the state dict's DTensors share storage with the parameters' local slices,
        # which the unit optimizers also hold (LocalShards).
        dcp.load(self.state(), storage_reader=dcp.FileSystemReader(folder))

    def _read_rank_files(self, folder: Path) -> None:
        """Checkpoints written before shards moved to DCP: shards/rank-R.safetensors, one per rank, read
        on as many ranks as wrote them."""
        path = folder / f"rank-{dist.rank()}.safetensors"
        if not path.is_file():
            raise CheckpointMismatch(f"checkpoint {folder.parent.name} has no weight shards for rank {dist.rank()} "
                                     "(its shards/rank-R files can only be resumed on as many ranks as wrote them)")
        saved = load_file(str(path), device="cpu")
        for name, t in self.state().items():
            local = local_tensor(t)
            if name not in saved or saved[name].shape != local.shape:
                raise CheckpointMismatch(f"checkpoint {folder.parent.name}: {name} does not match this model's shard")
            local.copy_(saved[name])

    def committed(self) -> None:
        pass


def _write_config(model: nn.Module, folder: Path) -> None:
    """config.json (and generation_config.json) as save_pretrained writes them beside weights."""
    import copy

    from torch.distributed.fsdp import FSDPModule

    model = pretrained(model)
    config = copy.deepcopy(model.config)
    # fully_shard swapped the model's class for a subclass named FSDP<class>: name the model's own.
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config.architectures = [cls.__name__]
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)


# The largest file of an export, as Hugging Face's save_pretrained cuts them by default.
EXPORT_FILE_BYTES = 5 * 10**9


def _file_indices(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Which export file (from 1) holds each tensor: in state-dict order, a new file when the
    next tensor would pass EXPORT_FILE_BYTES."""
    out, index, size = {}, 1, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > EXPORT_FILE_BYTES:
            index, size = index + 1, 0
        out[name], size = index, size + nbytes
    return out


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a sharded (DTensor) parameter; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t
