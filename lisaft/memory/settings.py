"""What an estimate is of: the typed recipe, the model's config, and the machine it is for.

The recipe is the one schema of every key the estimate reads (lisaft/config/schema.py); nothing
here renames a key. What a recipe cannot say is beside it: the device and its memory, the number
of ranks, and facts of the process (is `datasets` imported, the allocator's setting). The few
rules that derive something from several keys (which ends of the model train, the attention
kernel `auto` means) are written here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lisaft.config.overrides import Override, apply_overrides, flag_override, parsed_overrides
from lisaft.config.preference_losses import preference_loss
from lisaft.config.schema import Recipe, recipe_from_dict

GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The keys a recipe must have that the estimate never reads: for an estimate of a model alone
# (`estimate-memory --model`), and for the tests' tiny configs.
MODEL_ONLY: dict[str, dict[str, Any]] = {"data": {"train": "-"}, "training": {"output_dir": "-", "max_steps": 1}}


def moment_bytes(moments_dtype: str) -> int:
    """optimizer.moments_dtype's bytes per moment element (adamw_32bit)."""
    return DTYPE_BYTES[moments_dtype]


def recipe_for_model(ref: str, overrides: Sequence[str | Override] = ()) -> Recipe:
    """A recipe of every default for the model `ref`, then `overrides` (--set, flags): what
    `estimate-memory --model` starts from."""
    data: dict[str, Any] = {"model": {"name_or_path": ref}, **{k: dict(v) for k, v in MODEL_ONLY.items()}}
    parsed = parsed_overrides(overrides)
    return recipe_from_dict(apply_overrides(data, parsed), f"--model {ref}", parsed)


def settings_for_config(config, keys: dict[str, Any] | None = None, label: str = "model", **machine) -> Settings:
    """Settings for a transformers config built in code (tests, benchmarks): every recipe default,
    dotted `keys` set and validated as a recipe, `machine` the Settings fields beside it."""
    recipe = recipe_for_model(label, [flag_override(key, key, value) for key, value in (keys or {}).items()])
    return Settings(recipe, config, label, **machine)


def with_keys(recipe: Recipe, keys: dict[str, Any]) -> Recipe:
    """`recipe` with dotted `keys` set, not validated again: the estimator's own variations (advice,
    the tables) estimate what a recipe with those keys would hold."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in keys.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    return recipe.model_copy(update={
        section: getattr(recipe, section).model_copy(update=changes) for section, changes in sections.items()})


@dataclass(frozen=True)
class Settings:
    """Everything an estimate depends on: the recipe, the model's config, the machine."""

    recipe: Recipe
    config: object  # transformers PretrainedConfig of model.name_or_path or model.config
    model_label: str
    device: str = "cuda"  # cuda | cpu: where the run trains
    budget_bytes: int = 24 * GiB
    host_budget_bytes: int | None = None  # the machine's RAM, for cpu_offload's host memory
    ranks: int = 1  # processes under training.fsdp: the figures are one rank's (memory/sharded.py)
    datasets_imported: bool = False  # on CPU, the process baseline includes `datasets`
    expandable_segments: bool = True  # CUDA allocator setting (lisaft sets it unless the user did)
    active_layers_auto: bool = False  # lisa.active_layers was auto; the recipe holds the choice
    # Without data.packing a batch's rows are padded to its longest, under a mask; a measurement
    # whose rows are all data.max_seq_len long has no padding to hide (the tests' tiny batches).
    # With it, such rows are each one whole document: sdpa needs no mask for them either.
    full_rows: bool = False

    def with_(self, **changes) -> Settings:
        """Another machine (device, budget_bytes, ranks, ...) for the same recipe."""
        return replace(self, **changes)

    def with_keys(self, keys: dict[str, Any]) -> Settings:
        """The same machine, the recipe with dotted `keys` set (as `--set` takes them)."""
        return replace(self, recipe=with_keys(self.recipe, keys)) if keys else self

    @property
    def active_layers(self) -> int:
        """γ under LISA; `auto` not yet chosen counts as 1 (the choice needs the estimate)."""
        gamma = self.recipe.lisa.active_layers
        return 1 if gamma == "auto" else gamma

    @property
    def auto(self) -> bool:
        return self.recipe.lisa.enabled and (self.active_layers_auto or self.recipe.lisa.active_layers == "auto")

    @property
    def attention(self) -> str:
        # FlashAttention and SDPA keep the same tensors (q, k, v, output, log-sum-exp), so "auto"
        # needs no knowledge of whether flash-attn is installed to be estimated right.
        choice = self.recipe.model.attention
        if choice == "auto":
            return "flash_attention_2" if self.device == "cuda" and self.recipe.model.dtype != "float32" else "sdpa"
        return choice

    @property
    def sequences(self) -> int:
        """Sequences per micro-batch with gradients: training.batch_size, twice over for pairs (the
        chosen and the rejected answer of each go through one forward, train/objectives/pairs.py)."""
        p = self.recipe.preference
        return self.recipe.training.batch_size * (preference_loss(p.loss).sequences if p is not None else 1)

    @property
    def reference_sequences(self) -> int:
        """Sequences per batch of the reference pass: a pair's two, an unpaired answer and its KL
        sequence (train/objectives/feedback.py)."""
        return self.recipe.training.batch_size * 2

    @property
    def kl_pass(self) -> bool:
        """KTO's forward without gradients over the step's KL sequences before the first micro-batch."""
        p = self.recipe.preference
        return p is not None and preference_loss(p.loss).data_format == "feedback"

    @property
    def reference_pass(self) -> bool:
        """A loss with a reference computes its log-probs in one pass before step 1."""
        return self.recipe.preference is not None and preference_loss(self.recipe.preference.loss).reference

    @property
    def clipping(self) -> bool:
        return self.recipe.training.max_grad_norm is not None

    @property
    def lora(self) -> bool:
        return self.recipe.lora.enabled

    @property
    def fsdp(self) -> bool:
        return self.recipe.training.fsdp

    @property
    def embeddings_train(self) -> bool:
        """What trains at the model's ends, the one rule: everything in full fine-tuning; under
        LISA lisa.train_embeddings and lisa.train_head; with adapters lora.train_embeddings for
        the embeddings, the head and the final norm alike."""
        r = self.recipe
        if r.lora.enabled:
            return r.lora.train_embeddings
        return not r.lisa.enabled or r.lisa.train_embeddings

    @property
    def head_trains(self) -> bool:
        """The output head and the final norm (embeddings_train's rule)."""
        r = self.recipe
        if r.lora.enabled:
            return r.lora.train_embeddings
        return not r.lisa.enabled or r.lisa.train_head

    def head_weight_trains(self, tied: bool) -> bool:
        """A head tied to the embeddings is the embeddings' matrix: it trains when they do."""
        return self.embeddings_train if tied else self.head_trains

    def to_json(self) -> dict:
        """The settings as `estimate-memory --json` has always named them."""
        r = self.recipe
        lora = r.lora
        targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
        return {
            "model": self.model_label, "dtype": r.model.dtype, "attention": self.attention,
            "gradient_checkpointing": r.model.gradient_checkpointing,
            "offload_activations": r.model.offload_activations,
            "mlp_chunk_tokens": r.model.mlp_chunk_tokens, "optimizer": r.optimizer.name,
            "bf16_update": r.optimizer.bf16_update, "moments_dtype": r.optimizer.moments_dtype,
            "sparse_embedding_grad": r.model.sparse_embedding_grad,
            "expandable_segments": self.expandable_segments,
            "in_backward": r.optimizer.in_backward, "cpu_offload": r.optimizer.cpu_offload,
            "lisa": r.lisa.enabled, "active_layers": self.active_layers if r.lisa.enabled else None,
            "active_layers_auto": self.auto,
            "train_embeddings": r.lisa.train_embeddings, "train_head": r.lisa.train_head,
            "state_policy": r.lisa.state_policy, "batch_size": r.training.batch_size,
            "seq_len": r.data.max_seq_len, "grad_accum_steps": r.training.grad_accum_steps,
            "clipping": self.clipping, "device": self.device, "fsdp": r.training.fsdp, "ranks": self.ranks,
            "model_from_config": r.model.config is not None,
            "preference": r.preference.loss if r.preference is not None else None,
            "sequences": self.sequences,
            "lora": {"rank": lora.rank, "targets": targets, "dora": lora.dora, "dropout": lora.dropout,
                     "train_embeddings": lora.train_embeddings, "quantize": r.model.quantize}
            if lora.enabled else None,
        }
