"""Set-up shared by `train` and `resume`: everything a run needs, built from the recipe alone.

Every stateful piece of a run saves itself (state_dict / load_state_dict) and `Session.components`
hands them to the checkpointer by name; a new stateful component is one more entry there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lisaft.checkpoint.checkpointer import Checkpointer
from lisaft.checkpoint.optimizer_files import OptimizerFiles
from lisaft.config.schema import Recipe
from lisaft.data.order import DataOrder
from lisaft.data.packing import Packing, pack_examples
from lisaft.distributed import dist
from lisaft.errors import LisaftError
from lisaft.lisa import LisaController
from lisaft.memory.auto_layers import LayerChoice, resolve_for_run
from lisaft.model.load import ModelParts
from lisaft.model.units import Unit
from lisaft.optim.cpu_offload import OffloadedOptimizers
from lisaft.optim.in_backward import StepInBackward
from lisaft.optim.lr_schedule import Schedule
from lisaft.optim.unit_optimizers import UnitOptimizers

if TYPE_CHECKING:
    from lisaft.distributed.fsdp import LocalShards
    from lisaft.model.lora import Adapters


class Tokenizer(Protocol):
    """What training needs of a tokenizer; benchmarks pass an object with just a pad id."""

    pad_token_id: int


@dataclass
class Progress:
    """The run's counters, saved with every checkpoint."""

    step: int = 0                     # optimizer steps completed
    tokens_seen: int = 0              # global non-padding tokens trained on
    world_size: int = 1               # processes of this run now (a resume may change it)
    window: dict = field(default_factory=dict)  # the logging window not yet written (loss sums)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd.get("tokens_seen", 0))
        self.window = dict(sd.get("window") or {})


@dataclass
class MemoryPeaks:
    """What the end-of-run table compares with the estimate: the largest figures seen."""

    grad_bytes: int = 0
    state_bytes: int = 0
    activation_bytes: int | None = None   # saved for backward by the longest micro-batch so far
    activation_seq_len: int = 0           # that micro-batch's padded length


@dataclass
class Session:
    """Everything set up for a run; built identically by `train` and `resume`."""

    recipe: Recipe
    run_dir: Path
    device: torch.device
    tokenizer: Tokenizer
    model: nn.Module
    parts: ModelParts
    units: list[Unit]
    optimizers: UnitOptimizers
    controller: LisaController
    train_examples: list[dict[str, Any]]
    eval_examples: list[dict[str, Any]] | None
    order: DataOrder
    schedule: Schedule
    progress: Progress
    in_backward: StepInBackward | None = None
    peaks: MemoryPeaks = field(default_factory=MemoryPeaks)
    packing: Packing | None = None  # data.packing: train_examples are its rows
    shards: LocalShards | None = None     # training.fsdp (lisaft/distributed/fsdp.py)
    auto_layers: LayerChoice | None = None  # what lisa.active_layers: auto chose, when it was asked
    adapters: Adapters | None = None      # lora.enabled (lisaft/model/lora.py): only they train

    def checkpointer(self) -> Checkpointer:
        """The checkpointer, handed every stateful component. JSON components load in the order
        given (the LISA position before the optimizer files, which place moments by it)."""
        t = self.recipe.training
        components = {"progress": self.progress, "data": self.order, "lisa": self.controller,
                      "schedule": self.schedule}
        if self.packing is not None:
            components["packing"] = self.packing  # a resume over data that packs otherwise is refused
        checkpointer = Checkpointer(
            self.run_dir, self.model, self.units, keep_last=t.keep_last,
            components=components,
            folders={"optimizer": OptimizerFiles(self.optimizers, self.controller)},
        )
        if self.adapters is not None:
            from lisaft.checkpoint.adapters import with_adapters

            return with_adapters(checkpointer, self.model, self.adapters)
        return checkpointer if self.shards is None else self.shards.checkpointer(checkpointer)


def build_session(recipe: Recipe, run_dir: Path, tokenizer: Tokenizer | None = None,
                  train_examples: list | None = None, eval_examples: list | None = None) -> Session:
    """Load tokenizer, data and model and build optimizer and LISA controller. Raises
    LisaftError for anything the user can fix; writes nothing. Benchmarks pass their own
    tokenizer (anything with pad_token_id) and tokenized examples to skip loading."""
    from lisaft.data.examples import load_splits
    from lisaft.data.order import steps_for_epochs
    from lisaft.env.threads import apply_threads
    from lisaft.model.load import (
        check_context_length,
        compile_layers,
        load_model,
        load_tokenizer,
        model_parts,
        resolve_device,
        use_sparse_embedding_grad,
    )
    from lisaft.model.units import model_units

    t = recipe.training
    if t.fsdp:
        from lisaft.distributed.fsdp import check_supported

        check_supported(recipe)
    apply_threads(t.threads, dist.local_world_size())
    if recipe.optimizer.in_backward and dist.world_size() > 1:
        raise LisaftError("optimizer.in_backward cannot run data parallel: each update would run "
                          "before the gradient all-reduce; set it false")
    device = resolve_device(t.device)
    # Before the sampler exists: auto becomes a number here, and the run's recipe.yaml keeps it.
    auto_layers = resolve_for_run(recipe, device.type)
    if tokenizer is None:
        tokenizer = load_tokenizer(recipe.model)
    if train_examples is None:
        train_examples, eval_examples = load_splits(recipe.data, tokenizer, t.seed)
    packing = pack_examples(train_examples, recipe.data.max_seq_len, t.seed) if recipe.data.packing else None
    if packing is not None:
        train_examples = packing.rows
    if t.max_steps is None:  # training.epochs: the run's length follows from the train set
        t.max_steps = steps_for_epochs(t.epochs, len(train_examples),
                                       t.batch_size * t.grad_accum_steps * dist.world_size())
    shards = None
    if t.fsdp and recipe.model.config is None:
        from lisaft.distributed.fsdp import load_sharded

        # Shard by shard from the checkpoint: no rank holds the whole model. A random init from
        # model.config is built whole and then sharded, so it equals the one-process init.
        model, shards = load_sharded(recipe.model, device)
    else:
        model = load_model(recipe.model, device, seed=t.seed)
    check_context_length(model.config, recipe.data.max_seq_len)
    adapters = _attach_adapters(model, recipe)
    # Not under FSDP, even on one rank: the embedding is a sharded unit with a dense gradient.
    use_sparse_embedding_grad(model, recipe.model.sparse_embedding_grad and not t.fsdp,
                              trains=_embeddings_train(recipe),
                              tokens_per_step=t.batch_size * t.grad_accum_steps * recipe.data.max_seq_len,
                              world_size=dist.world_size())
    parts = model_parts(model, recipe.model.layers_path)
    if t.compile:
        compile_layers(parts.layers, device)
    if t.fsdp:
        from lisaft.distributed.fsdp import shard_model

        if shards is None:
            shards = shard_model(model, parts, device)
        parts = model_parts(model, recipe.model.layers_path)  # sharding replaced every parameter
    units = model_units(parts) if adapters is None else adapters.trainable_units(model_units(parts))
    # Sharded state: each unit's owner is its index modulo the world size, stable across LISA
    # intervals, and embeddings and head land on different ranks.
    # optimizer.cpu_offload: the same unit optimizers over host copies of the weights;
    # training.fsdp: the unit optimizers over this rank's slices.
    optimizers_class = OffloadedOptimizers if recipe.optimizer.cpu_offload else UnitOptimizers
    on_slices = {"shards": shards} if shards is not None else {}
    optimizers = optimizers_class(units, recipe.optimizer, device,
                                  offload_dir=run_dir / "lisa_offload" / f"rank-{dist.rank()}", seed=t.seed,
                                  shard=t.shard_optimizer_state, **on_slices)
    controller = LisaController(units, optimizers, recipe.lisa, seed=t.seed)
    if shards is not None:
        controller.check_agreement = shards.check_same_layers
    in_backward = StepInBackward(units, optimizers) if recipe.optimizer.in_backward else None
    order = DataOrder(len(train_examples), t.batch_size, t.seed, dist.rank(), dist.world_size(),
                      unit="packed rows" if packing else "examples")
    schedule = Schedule(recipe.optimizer.lr, recipe.scheduler, horizon=t.max_steps)
    return Session(recipe, run_dir, device, tokenizer, model, parts, units, optimizers, controller,
                   train_examples, eval_examples, order, schedule, Progress(world_size=dist.world_size()),
                   in_backward=in_backward, packing=packing, shards=shards, auto_layers=auto_layers,
                   adapters=adapters)


def _attach_adapters(model: nn.Module, recipe: Recipe) -> Adapters | None:
    if not recipe.lora.enabled:
        return None
    from lisaft.model.lora import attach_adapters

    return attach_adapters(model, recipe)


def _embeddings_train(recipe: Recipe) -> bool:
    if recipe.lora.enabled:
        return recipe.lora.train_embeddings
    return not recipe.lisa.enabled or recipe.lisa.train_embeddings
