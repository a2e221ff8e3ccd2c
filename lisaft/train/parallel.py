"""The run's parallel strategy, chosen once at set-up (`choose`): how the model is loaded and
placed (with LoRA's adapters), which parameters the optimizers step and what the forward waits
for, how gradients are reduced and clipped, how the loss runs, how eval batches are shared
between ranks, how the final model is exported, which weights component a checkpoint holds, what
the end-of-run report reads and which command resumes a stopped run. Nothing else in the run asks
which one it is (tests/unit/test_strategy_interface.py reads train/ and model/ for it).

    Strategy        the base: what every strategy does unless it says otherwise (one process's way)
    SingleProcess   one process holds the whole model and steps it on the training device
    DataParallel    torchrun ranks, each a whole replica; gradients all-reduced; with
                    training.shard_optimizer_state one owner rank per unit keeps its moments
    CpuOffload      one process; the optimizer step on the CPU over host copies of the weights,
                    gradients streamed out in backward (optimizer.cpu_offload)
    Fsdp            torchrun ranks; weights, gradients and moments sharded with FSDP2 (training.fsdp)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from lisaft.checkpoint.adapters import adapter_component
from lisaft.checkpoint.checkpointer import UnitWeights
from lisaft.checkpoint.components import FolderComponent
from lisaft.config.compat import check_world, offload_accumulation
from lisaft.config.schema import Recipe
from lisaft.distributed import dist
from lisaft.lisa import LisaController
from lisaft.model.load import load_model
from lisaft.model.loss import eval_sums, token_loss_sum
from lisaft.model.parts import ModelParts, model_parts, pretrained
from lisaft.model.units import Unit
from lisaft.optim.cpu_offload import OffloadedOptimizers
from lisaft.optim.gradients import clip_grad_total
from lisaft.optim.unit_optimizers import UnitOptimizers
from lisaft.train.layer_major import LayerMajor
from lisaft.train.stop import resume_command

if TYPE_CHECKING:
    import torch

    from lisaft.distributed.fsdp import LocalShards
    from lisaft.memory.estimate import Estimate
    from lisaft.metrics.phases import Phases
    from lisaft.model.lora import Adapters

    Norm = torch.Tensor | float | None  # the global gradient norm: a tensor until the step reads it

# A row of the end-of-run memory table: its name, the estimated bytes and the held ones.
ReportRow = tuple[str, int | None, int | None]


def choose(recipe: Recipe, device: torch.device) -> Strategy:
    """The strategy the recipe and the process group ask for; refuses what it cannot run, before
    anything is loaded (the rules that depend on the launch: config/compat.py check_world)."""
    check_world(recipe, dist.world_size(), dist.is_initialized(), device.type)
    if recipe.training.fsdp:
        return Fsdp(recipe)
    if recipe.optimizer.cpu_offload:
        return CpuOffload(recipe)
    if dist.world_size() > 1:
        return DataParallel(recipe)
    return SingleProcess(recipe)


class Strategy:
    """The base of every strategy: the whole model in this process, stepped on the training
    device. A strategy overrides what it does differently."""

    # The saved-activation meter tells a layer's saved tensors from its own parameters.
    measures_activations = True
    # The input embedding may take sparse gradients (lisaft/model/load.py says when that is exact).
    sparse_embedding_grad = True
    # Each unit's optimizer file is one for the whole run, not one per rank's slices.
    optimizer_files_per_rank = False
    # A resume needs a process group (torchrun) even on one rank.
    resumes_under_torchrun = False
    # The model's forward hooks gather its weights, so model/loss.py runs its own forward and the
    # head as a module (the losses' `sharded`).
    sharded_forward = False

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.adapters: Adapters | None = None  # lora.enabled: what trains, exports and is checkpointed
        # optimizer.offload_accumulation device: the step's forward and backward, layer by layer.
        self.layer_major: LayerMajor | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def load_model(self, device: torch.device) -> nn.Module:
        return load_model(self.recipe.model, device, seed=self.recipe.training.seed)

    def attach_adapters(self, model: nn.Module) -> Adapters | None:
        """lora.enabled: peft's adapters on the frozen base (model/lora.py); the export and the
        checkpoint's weights are then the adapters'."""
        if self.recipe.lora.enabled:
            from lisaft.model.lora import attach_adapters

            self.adapters = attach_adapters(model, self.recipe)
        return self.adapters

    def place(self, model: nn.Module, parts: ModelParts, device: torch.device) -> ModelParts:
        """The model laid out over the ranks; its parts as the units are built from."""
        return parts

    def optimizers(self, units: list[Unit], device: torch.device, run_dir: Path) -> UnitOptimizers:
        return UnitOptimizers(units, self.recipe.optimizer, device, offload_dir=_offload_dir(run_dir),
                              seed=self.recipe.training.seed)

    def hook_forward(self, model: nn.Module, parts: ModelParts) -> None:
        """What the forward waits for, hooked in before the first forward traces a layer."""

    def layer_agreement(self) -> Callable[[int, list[int]], None] | None:
        """What LISA calls at each switch to prove every rank trains the same layers (None: no
        collective could hang on a disagreement)."""
        return None

    def token_loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The micro-batch's summed token loss (model/loss.py)."""
        return token_loss_sum(model, batch, self.sharded_forward)

    def eval_sums(self, model: nn.Module, batch: dict) -> tuple[float, int, int]:
        """An eval batch's (loss sum, response tokens, argmax-correct ones)."""
        return eval_sums(model, batch, self.sharded_forward)

    # -- the step -------------------------------------------------------------------------------

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        pass

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
        """The global norm before clipping, on the device: the step reads it once, at its end."""
        return clip_grad_total(params, max_norm)

    def bind_local_grads(self, params: list[nn.Parameter]) -> None:
        """Hand the optimizers' own parameters their gradients (they are the parameters here)."""

    def release_local_grads(self, params: list[nn.Parameter]) -> None:
        """Drop the gradients of a step that is skipped."""
        for p in params:
            p.grad = None

    def before_last_backward(self, controller: LisaController, measure_norm: bool) -> None:
        """Called before the step's last micro-batch's backward (cpu_offload steps units there)."""

    def transfer_counts(self) -> dict[str, int] | None:
        """The step's counted copies over the link (cpu_offload's train record fields), reset."""
        return None

    def update(self, controller: LisaController, optimizers: UnitOptimizers, max_norm: float | None,
               measure_norm: bool, phases: Phases, skip_nonfinite: bool = False) -> tuple[Norm, int, bool]:
        """Reduce, clip and step the trainable units; returns (grad norm, gradient bytes held,
        whether training.on_nonfinite: skip dropped the update). The norm stays on the device
        unless skip must read it before the update."""
        trainable = controller.trainable_parameters()
        for p in trainable:
            if p.grad is not None and p.grad.is_sparse:
                # Sum the rows of repeated tokens once; the norm and the update read the values.
                p.grad = p.grad.coalesce()
        self.reduce_grads(trainable)
        grad_bytes = controller.grad_bytes()
        grad_norm = None
        if max_norm is not None or measure_norm or skip_nonfinite:
            with phases.phase("clip"):
                grad_norm = self.clip_grad_norm(trainable, max_norm)
        if skip_nonfinite and grad_norm is not None and not math.isfinite(grad_norm):
            # The norm is global (after the reduction), so every rank drops the same update.
            self.release_local_grads(trainable)
            return grad_norm, grad_bytes, True
        self.bind_local_grads(trainable)
        with phases.phase("optimizer"):
            optimizers.step(controller.trainable_units())
        return grad_norm, grad_bytes, False

    # -- evaluation, export, checkpoints --------------------------------------------------------

    def eval_batches(self, batches: list[list[int]]) -> tuple[list[list[int]], int]:
        """This rank's eval batches, and how many of them count."""
        mine = batches[dist.rank():: dist.world_size()]
        return mine, len(mine)

    def export(self, model: nn.Module, folder: Path) -> None:
        """The model's weights and config as a Hugging Face folder (collective); a LoRA run's merged
        model or peft's adapter folder, as lora.export says."""
        if not dist.is_main():
            return
        if self.adapters is not None:
            from lisaft.model.lora import save_final

            save_final(model, self.adapters, self.recipe, folder)
        else:
            pretrained(model).save_pretrained(folder, safe_serialization=True)

    def weights_component(self, model: nn.Module, units: list[Unit],
                          optimizers: UnitOptimizers) -> dict[str, FolderComponent]:
        """The checkpoint's weights, by name: one file per unit, written by rank 0; a LoRA run's
        adapters, never the frozen base (checkpoint/adapters.py)."""
        if self.adapters is not None:
            return dict(adapter_component(model, self.adapters))
        return {"weights": UnitWeights(model, units, optimizers.changes)}

    def resume_command(self, run_dir: Path) -> str:
        """The command that continues this run from its newest checkpoint (train/stop.py)."""
        return resume_command(run_dir, self.recipe.training.batch_size, torchrun=self.resumes_under_torchrun)

    # -- what the end-of-run report reads -------------------------------------------------------

    def weights_bytes(self, model: nn.Module) -> int:
        """The weight bytes this rank holds."""
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def host_rows(self, estimate: Estimate) -> list[ReportRow]:
        """Host memory the report shows beside the device's, estimated and held."""
        return []

    def held(self, measured: dict[str, int | None], device: torch.device) -> dict[str, int | None]:
        """The device rows' measured bytes, where this strategy keeps them somewhere else."""
        return measured


class SingleProcess(Strategy):
    """One process, the whole model on the training device: the base's way, unchanged."""


class DataParallel(Strategy):
    """torchrun ranks, each holding the whole model; the gradients are summed over ranks."""

    def optimizers(self, units: list[Unit], device: torch.device, run_dir: Path) -> UnitOptimizers:
        # Sharded state: each unit's owner is its index modulo the world size, stable across LISA
        # intervals, and embeddings and head land on different ranks.
        return UnitOptimizers(units, self.recipe.optimizer, device, offload_dir=_offload_dir(run_dir),
                              seed=self.recipe.training.seed,
                              owner_per_unit=self.recipe.training.shard_optimizer_state)

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        dist.all_reduce_grads(params)


class CpuOffload(Strategy):
    """optimizer.cpu_offload: the same unit optimizers over host copies of the weights."""

    offloaded: OffloadedOptimizers

    def optimizers(self, units: list[Unit], device: torch.device, run_dir: Path) -> UnitOptimizers:
        self.offloaded = OffloadedOptimizers(units, self.recipe.optimizer, device, offload_dir=_offload_dir(run_dir),
                                             seed=self.recipe.training.seed)
        t = self.recipe.training
        # Exact: where nothing waits for the global norm, each unit steps as its gradients arrive.
        self.offloaded.step_as_ready = t.max_grad_norm is None and t.on_nonfinite != "skip"
        return self.offloaded

    def hook_forward(self, model: nn.Module, parts: ModelParts) -> None:
        # The next step's forward starts before the CPU step ends: each unit waits for its own.
        self.offloaded.wait_in_forward(model, parts.layers)
        if offload_accumulation(self.recipe) == "device":
            from lisaft.memory.layer_major import run_group_size

            size = run_group_size(self.recipe, self.offloaded.train_device.type)
            self.layer_major = LayerMajor(model, parts, self.offloaded, size)

    def transfer_counts(self) -> dict[str, int] | None:
        return self.offloaded.counts.take()

    def before_last_backward(self, controller: LisaController, measure_norm: bool) -> None:
        self.offloaded.arm(controller.trainable_units(), measure_norm)

    def host_rows(self, estimate: Estimate) -> list[ReportRow]:
        """The moments, the weights' host copy and the gradient accumulators (the device rows show
        no gradients or moments for such a run). On a CPU device the host is the device: the
        estimate counts moments and accumulators in the device rows (held() puts the measured
        bytes there too) and the weights' copy among its fixed terms."""
        held = self.offloaded.host_bytes()
        est = estimate.host_components
        if estimate.settings.device == "cpu":
            return [("host: weight copies", estimate.components.get("host_weight_copies"), held["host_weights"])]
        return [("host: optimizer states", est.get("moments"), self.offloaded.state_bytes()[1]),
                ("host: weight copies", est.get("host_weights"), held["host_weights"]),
                ("host: gradient accumulators", est.get("gradient_accumulators"), held["grad_accumulators"])]

    def held(self, measured: dict[str, int | None], device: torch.device) -> dict[str, int | None]:
        if device.type != "cpu":
            return measured
        return {**measured, "grad_bytes": self.offloaded.host_bytes()["grad_accumulators"],
                "optimizer_state_bytes": self.offloaded.state_bytes()[1]}

    def update(self, controller: LisaController, optimizers: UnitOptimizers, max_norm: float | None,
               measure_norm: bool, phases: Phases, skip_nonfinite: bool = False) -> tuple[Norm, int, bool]:
        # The gradients are in host memory: the norm, the clipping and the step run there, and
        # no gradient is held on the device.
        with phases.phase("optimizer"):
            norm = self.offloaded.clip_and_step(controller.trainable_units(), max_norm, measure_norm, skip_nonfinite)
        return norm, 0, skip_nonfinite and norm is not None and not math.isfinite(norm)


class Fsdp(Strategy):
    """training.fsdp (lisaft/distributed/fsdp.py): each rank holds and steps its slices."""

    # Under FSDP the gathered weights are not the parameters the meter excludes.
    measures_activations = False
    # The embedding is a sharded unit with a dense gradient, even on one rank.
    sparse_embedding_grad = False
    optimizer_files_per_rank = True
    resumes_under_torchrun = True
    sharded_forward = True

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(recipe)
        self.shards: LocalShards | None = None

    def load_model(self, device: torch.device) -> nn.Module:
        if self.recipe.model.config is not None:
            # A random init from model.config is built whole and then sharded, so it equals the
            # one-process init.
            return super().load_model(device)
        from lisaft.distributed.fsdp import load_sharded

        # Shard by shard from the checkpoint: no rank holds the whole model.
        model, self.shards = load_sharded(self.recipe.model, device)
        return model

    def place(self, model: nn.Module, parts: ModelParts, device: torch.device) -> ModelParts:
        from lisaft.distributed.fsdp import shard_model

        if self.shards is None:
            self.shards = shard_model(model, parts, device)
        return model_parts(model, self.recipe.model.layers_path)  # sharding replaced every parameter

    def _local(self) -> LocalShards:
        if self.shards is None:
            raise AssertionError("the model is not sharded yet: place() comes first")
        return self.shards

    def optimizers(self, units: list[Unit], device: torch.device, run_dir: Path) -> UnitOptimizers:
        # The unit optimizers over this rank's slices.
        return UnitOptimizers(units, self.recipe.optimizer, device, offload_dir=_offload_dir(run_dir),
                              seed=self.recipe.training.seed, slices=self._local())

    def layer_agreement(self) -> Callable[[int, list[int]], None] | None:
        return self._local().check_same_layers

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        pass  # the reduce-scatter in backward summed them

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
        return self._local().clip_grad_norm(params, max_norm)

    def bind_local_grads(self, params: list[nn.Parameter]) -> None:
        self._local().bind_grads(params)

    def release_local_grads(self, params: list[nn.Parameter]) -> None:
        super().release_local_grads(params)
        self._local().release_grads(params)

    def eval_batches(self, batches: list[list[int]]) -> tuple[list[list[int]], int]:
        # A forward is collective: every rank runs as many; a rank short of batches runs one
        # again and does not count it.
        mine, counted = super().eval_batches(batches)
        if batches:
            rounds = -(-len(batches) // dist.world_size())
            mine = [*mine, *[batches[0]] * (rounds - len(mine))]
        return mine, counted

    def export(self, model: nn.Module, folder: Path) -> None:
        self._local().write_hf_model(folder)

    def weights_bytes(self, model: nn.Module) -> int:
        from lisaft.distributed.fsdp import local_tensor

        # A parameter is a DTensor: this rank holds its local slice.
        return sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())

    def weights_component(self, model: nn.Module, units: list[Unit],
                          optimizers: UnitOptimizers) -> dict[str, FolderComponent]:
        """Each rank's slices through torch.distributed.checkpoint: a resume on as many ranks
        restores them bit for bit, on another number DCP reshards them."""
        from lisaft.distributed.fsdp import ShardFiles

        return {"shards": ShardFiles(model)}


def _offload_dir(run_dir: Path) -> Path:
    return run_dir / "lisa_offload" / f"rank-{dist.rank()}"
