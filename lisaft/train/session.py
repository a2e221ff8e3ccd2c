"""Set-up shared by `train` and `resume`: everything a run needs, built from the recipe alone.

Every stateful piece of a run saves itself (state_dict / load_state_dict, or its own folder) and
`checkpoint_components` hands them to the checkpointer by name; a new stateful component is one
more line there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lisaft.checkpoint.checkpointer import Checkpointer
from lisaft.checkpoint.components import OptionalComponent, OwnFile, PerRank
from lisaft.checkpoint.optimizer_files import OptimizerFiles
from lisaft.checkpoint.run_state import RECIPE, RecipeRecord, RngState
from lisaft.config.schema import Recipe
from lisaft.data.digest import examples_digest
from lisaft.data.order import DataOrder
from lisaft.data.packing import Packing, pack_examples
from lisaft.distributed import dist
from lisaft.lisa import LisaController
from lisaft.memory.auto_layers import LayerChoice, resolve_for_run
from lisaft.model.parts import ModelParts
from lisaft.model.units import Unit
from lisaft.optim.in_backward import StepInBackward
from lisaft.optim.lr_schedule import Schedule
from lisaft.optim.unit_optimizers import UnitOptimizers
from lisaft.train import objectives
from lisaft.train.objectives import Objective
from lisaft.train.parallel import Strategy, choose

if TYPE_CHECKING:
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
    skipped_steps: int = 0            # steps training.on_nonfinite: skip dropped
    updated_step: int = 0             # the last step that updated the weights (not skipped)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd.get("tokens_seen", 0))
        self.window = dict(sd.get("window") or {})
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        self.updated_step = int(sd.get("updated_step", self.step))


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
    parallel: Strategy                    # one process, data parallel, CPU offload or FSDP (train/parallel.py)
    objective: Objective                  # the stage: SFT's tokens, pairs, ... (train/objectives/)
    in_backward: StepInBackward | None = None
    peaks: MemoryPeaks = field(default_factory=MemoryPeaks)
    packing: Packing | None = None  # data.packing: train_examples are its rows
    auto_layers: LayerChoice | None = None  # what lisa.active_layers: auto chose, when it was asked
    adapters: Adapters | None = None      # lora.enabled (lisaft/model/lora.py): only they train
    _checkpointer: Checkpointer | None = field(default=None, repr=False)

    def checkpointer(self) -> Checkpointer:
        """The run's one checkpointer (its components remember what they last saved or read, so
        the next checkpoint links what did not change since), handed checkpoint_components."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.run_dir, self.recipe.training.keep_last,
                                              checkpoint_components(self))
        return self._checkpointer


def checkpoint_components(session: Session) -> dict[str, Any]:
    """Every piece of a checkpoint, by name, in the order a resume loads them: the weights first
    (the CPU-offload optimizer copies them when its files are read), the LISA position before the
    optimizer files (which place moments by it), the RNG last. A new stateful piece of a run is
    one more line here (lisaft/checkpoint/components.py: how each kind is stored);
    OptionalComponent(component, default) lets checkpoints written before it still resume."""
    parallel = session.parallel
    return {
        **parallel.weights_component(session.model, session.units, session.optimizers),
        "progress": session.progress,
        "data": session.order,
        "lisa": session.controller,
        "schedule": session.schedule,
        # A resume over data that packs into other rows is refused.
        **({"packing": session.packing} if session.packing is not None else {}),
        # The objective's own: a reference's log-probs computed once before step 1, ...
        **session.objective.checkpoint_components(session.train_examples, session.eval_examples),
        RECIPE: OwnFile(RecipeRecord(session.recipe)),
        "optimizer": OptimizerFiles(session.optimizers, session.controller,
                                    per_rank=parallel.optimizer_files_per_rank),
        # A resume on more ranks than wrote the checkpoint has none for the new ranks.
        "rng": OptionalComponent(PerRank(RngState()), warning=f"no RNG state for rank {dist.rank()}"),
    }


def build_session(recipe: Recipe, run_dir: Path, tokenizer: Tokenizer | None = None,
                  train_examples: list | None = None, eval_examples: list | None = None,
                  resuming: bool = False) -> Session:
    """Load tokenizer, data and model and build optimizer and LISA controller. Raises
    LisaftError for anything the user can fix; writes nothing. Benchmarks pass their own
    tokenizer (anything with pad_token_id) and tokenized examples to skip loading. A DPO run
    not `resuming` computes its reference log-probs here, before the optimizer exists."""
    from lisaft.env.threads import apply_threads
    from lisaft.model.load import compile_layers, load_tokenizer
    from lisaft.model.units import model_units

    t = recipe.training
    device = dist.resolve_device(t.device)
    dist.init_from_env(device)  # a torchrun launch: the backend of the training device
    parallel = choose(recipe, device)  # refuses what it cannot run before anything loads
    apply_threads(t.threads, dist.local_world_size())
    # Before the sampler exists: auto becomes a number here, and the run's recipe.yaml keeps it.
    auto_layers = resolve_for_run(recipe, device.type)
    if tokenizer is None:
        tokenizer = load_tokenizer(recipe.model)
    train_examples, eval_examples, packing = _data(recipe, tokenizer, train_examples, eval_examples)
    objective = objectives.choose(recipe, parallel, tokenizer, device, run_dir)
    objective.before_model(train_examples, eval_examples, resuming)
    model, parts, adapters = _model(recipe, parallel, device)
    objective.with_model(model, train_examples, eval_examples, resuming)
    units = model_units(parts) if adapters is None else adapters.trainable_units(model_units(parts))
    optimizers = parallel.optimizers(units, device, run_dir)
    parallel.hook_forward(model, parts)
    if t.compile:
        # Last: the first traced forward sees the waiters just hooked (dynamo skips a hook it did
        # not see), and DPO's reference pass above ran eagerly rather than tracing without them.
        compile_layers(parts.layers, device)
    controller = LisaController(units, optimizers, recipe.lisa, seed=t.seed, check_agreement=parallel.layer_agreement())
    in_backward = StepInBackward(units, optimizers) if recipe.optimizer.in_backward else None
    order = DataOrder(len(train_examples), t.batch_size, t.seed, dist.rank(), dist.world_size(),
                      unit="packed rows" if packing else "examples", digest=examples_digest(train_examples),
                      accept_change=t.accept_data_change, whole=objective.sees_global_batch)
    if packing is not None:
        packing.accept_change = t.accept_data_change
    assert t.max_steps is not None  # training.epochs was resolved into it above
    schedule = Schedule(recipe.optimizer.lr, recipe.scheduler, horizon=t.max_steps)
    return Session(recipe, run_dir, device, tokenizer, model, parts, units, optimizers, controller,
                   train_examples, eval_examples, order, schedule, Progress(world_size=dist.world_size()),
                   parallel, objective, in_backward=in_backward, packing=packing, auto_layers=auto_layers,
                   adapters=adapters)


def _data(recipe: Recipe, tokenizer: Tokenizer, train_examples: list | None,
          eval_examples: list | None) -> tuple[list, list | None, Packing | None]:
    """The train rows (packed with data.packing) and eval examples; sets training.max_steps of a
    run defined by training.epochs."""
    from lisaft.data.examples import load_splits
    from lisaft.data.order import steps_for_epochs

    t = recipe.training
    if train_examples is None:
        train_examples, eval_examples = load_splits(recipe.data, tokenizer, t.seed)
    packing = pack_examples(train_examples, recipe.data.max_seq_len, t.seed) if recipe.data.packing else None
    if packing is not None:
        train_examples = packing.rows
    if t.max_steps is None:  # training.epochs: the run's length follows from the train set
        assert t.epochs is not None  # the schema asks for one of the two
        t.max_steps = steps_for_epochs(t.epochs, len(train_examples),
                                       t.batch_size * t.grad_accum_steps * dist.world_size())
    return train_examples, eval_examples, packing


def _model(recipe: Recipe, parallel: Strategy,
           device: torch.device) -> tuple[nn.Module, ModelParts, Adapters | None]:
    """The model, loaded and placed as the parallel strategy says, its parts, and its adapters
    (lora.enabled)."""
    from lisaft.model.load import check_context_length, use_sparse_embedding_grad
    from lisaft.model.parts import model_parts

    t = recipe.training
    model = parallel.load_model(device)
    check_context_length(model.config, recipe.data.max_seq_len)
    adapters = parallel.attach_adapters(model)
    use_sparse_embedding_grad(model, recipe.model.sparse_embedding_grad and parallel.sparse_embedding_grad,
                              trains=_embeddings_train(recipe),
                              tokens_per_step=t.batch_size * t.grad_accum_steps * recipe.data.max_seq_len,
                              world_size=dist.world_size())
    parts = model_parts(model, recipe.model.layers_path)
    return model, parallel.place(model, parts, device), adapters


def _embeddings_train(recipe: Recipe) -> bool:
    if recipe.lora.enabled:
        return recipe.lora.train_embeddings
    return not recipe.lisa.enabled or recipe.lisa.train_embeddings
