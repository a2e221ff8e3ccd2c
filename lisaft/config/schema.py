"""The recipe: a typed, documented schema for everything a run depends on.

A recipe is YAML on disk and a `Recipe` object everywhere else; it is never turned back into a
loose dict inside the package. Unknown keys are errors (extra="forbid") so that a typo such as
`lisa.intervals_steps` fails loudly instead of silently training with the default.
"""

from __future__ import annotations

import difflib
import json
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from lisaft.config.compat import first_exclusion
from lisaft.config.fields import Bool, Float, Int, Section, whole_number
from lisaft.config.grpo import GrpoSection, resolve_reward_paths
from lisaft.config.hub import can_only_be_path
from lisaft.config.lora import LoraSection
from lisaft.config.optimizers import OptimizerName
from lisaft.config.overrides import Override, apply_overrides, parsed_overrides
from lisaft.config.preference_losses import PREFERENCE_LOSSES, PreferenceLoss, preference_loss
from lisaft.console import first_line
from lisaft.errors import LisaftError

Dtype = Literal["float32", "bfloat16", "float16"]
Attention = Literal["auto", "flash_attention_2", "sdpa", "eager"]
StatePolicy = Literal["discard", "offload_cpu", "offload_disk", "keep"]


def _layers_or_auto(v: Any) -> Any:
    if v == "auto":
        return v
    v = whole_number(v)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int):
        raise ValueError(f"must be a whole number of layers or auto, got {v!r}")
    if v < 1:
        raise ValueError(f"must be at least 1, or auto, got {v}")
    return v


# lisa.active_layers: γ, or "auto" (resolved from the memory estimate when a run starts).
LayersOrAuto = Annotated[int | Literal["auto"], BeforeValidator(_layers_or_auto)]


CHAT_ROLES = ("system", "user", "assistant")


class ModelSection(Section):
    name_or_path: str | None = Field(
        None, description="Local folder saved with save_pretrained, or a hub id (needs network)."
    )
    config: str | None = Field(
        None,
        description="A config.json (or a folder holding one) to build a randomly initialised "
        "model from, instead of loading weights. Exactly one of name_or_path / config.",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer folder or hub id. Default: name_or_path."
    )
    dtype: Dtype = Field(
        "bfloat16", description="Dtype of weights and gradients (moments are float32 or 8-bit; float16 is refused)."
    )
    attention: Attention = Field(
        "auto",
        description="auto picks flash_attention_2 when flash-attn and CUDA are present, else sdpa.",
    )
    gradient_checkpointing: Bool = Field(
        False, description="Recompute layer activations in backward (non-reentrant)."
    )
    offload_activations: bool = Field(
        False,
        description="Keep each checkpointed layer's input in pinned host memory instead of on the "
        "GPU, copied on a side stream that overlaps compute (long context). Needs "
        "gradient_checkpointing.",
    )
    mlp_chunk_tokens: Int | None = Field(
        None, ge=1,
        description="Run each layer's MLP over this many positions at a time, each chunk "
        "checkpointed: its intermediates (4 x intermediate_size per token) exist for one chunk "
        "only. For long context; costs one more MLP forward per step.",
    )
    sparse_embedding_grad: Bool = Field(
        True,
        description="Keep the input embedding's gradient as the rows of the step's tokens only "
        "(single process, untied embedding, fewer tokens than half the vocabulary); the update "
        "still moves every row exactly as AdamW does. Saves a dense vocab x hidden gradient.",
    )
    quantize: Literal["nf4"] | None = Field(
        None, description="nf4: load the frozen base in 4-bit NormalFloat with double quantization "
        "(QLoRA, bitsandbytes), computing in model.dtype. Needs lora.enabled and model.name_or_path.")
    layers_path: str | None = Field(
        None,
        description="Dotted attribute path of the decoder-layer ModuleList (e.g. 'model.layers') "
        "for architectures lisaft does not know.",
    )

    @field_validator("dtype")
    @classmethod
    def _no_float16(cls, v: str) -> str:
        if v == "float16":
            raise ValueError(
                "float16 weights would need loss scaling (small gradients underflow and Adam's "
                "second moments with them); use bfloat16, which has float32's range"
            )
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError("set exactly one of model.name_or_path and model.config")
        if self.config is not None and self.tokenizer is None:
            raise ValueError("model.tokenizer is required when model.config is used (random init)")
        return self


class DataSection(Section):
    train: str = Field(..., description="jsonl/json/csv/parquet file, saved dataset folder, or hub name.")
    eval: str | None = Field(None, description="Eval set, same kinds as train.")
    eval_fraction: Float = Field(
        0.0, ge=0.0, lt=1.0, description="Hold out this fraction of train for eval when eval is unset."
    )
    format: Literal["text", "instruction", "chat", "preference", "feedback", "prompts"] = Field(
        "text",
        description="text: field `text`; instruction: `instruction`, optional `input`, `output`; "
        "chat: `messages` [{role, content}]; preference: `prompt`, `chosen`, `rejected` (strings or "
        "messages; needs a `preference` section, docs/preference.md); feedback: `prompt`, `completion` "
        "(strings or messages) and a boolean `label` (preference.loss kto, docs/preference.md); prompts: "
        "`prompt` (a string, or messages rendered with the chat template and its generation prompt), every "
        "other field passed to the rewards (needs a `grpo` section, docs/grpo.md).",
    )
    max_seq_len: Int = Field(
        1024, gt=0, description="Examples are truncated to this many tokens. Above the model's "
        "max_position_embeddings it is an error, unless the model config sets rope_scaling (then a "
        "warning).")
    packing: Bool = Field(
        False, description="Put whole train examples into rows of up to max_seq_len tokens (best "
        "fit, seeded); each document attends only to itself. See docs/data.md.")
    columns: dict[str, str] = Field(
        {}, description="Rename dataset fields to the ones data.format reads, old: new; names inside "
        "chat turns too. E.g. {prompt: instruction, completion: output}, or for ShareGPT "
        "{conversations: messages, from: role, value: content}.")
    roles: dict[str, str] = Field(
        {}, description="Chat role names mapped to system, user or assistant, e.g. {human: user, "
        "gpt: assistant}. Any other role is an error naming the row.")
    template: str | None = Field(
        None, description="Instruction prompt with {instruction} and optionally {input}; the "
        "response follows it. null: the ### Instruction / ### Input / ### Response layout.")
    subset: str | None = Field(None, description="Hub datasets: the configuration (subset) name.")
    train_split: str = Field("train", description="Split of a hub or saved dataset to train on.")
    eval_split: str | None = Field(
        None, description="Split for eval when data.eval is a hub or saved dataset (null: "
        "validation, test or eval, whichever exists).")

    @field_validator("template")
    @classmethod
    def _template_fields(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(v) if name is not None}
        except ValueError as e:
            raise ValueError(f"not a valid template ({e}); write literal braces as {{{{ and }}}}") from None
        if "instruction" not in names:
            raise ValueError("must contain {instruction}")
        unknown = names - {"instruction", "input"}
        if unknown:
            raise ValueError(f"unknown field {{{sorted(unknown)[0]}}}; only {{instruction}} and {{input}} exist")
        return v

    @field_validator("roles")
    @classmethod
    def _role_targets(cls, v: dict[str, str]) -> dict[str, str]:
        for name, role in v.items():
            if role not in CHAT_ROLES:
                raise ValueError(f"{name}: {role!r} is not one of {', '.join(CHAT_ROLES)}")
        return v


class OptimizerSection(Section):
    name: OptimizerName = Field("adamw_32bit", description="Optimizer; see docs/lisa.md.")
    lr: Float = Field(1e-5, description="Peak learning rate.")
    weight_decay: Float = Field(0.0, ge=0.0, description="Decoupled weight decay.")
    betas: tuple[Float, Float] = Field((0.9, 0.999), description="Adam beta1, beta2.")
    eps: Float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    in_backward: Bool = Field(
        False,
        description="Step each parameter inside backward and free its gradient at once. "
        "Incompatible with grad_accum_steps > 1 and max_grad_norm.",
    )
    cpu_offload: Bool = Field(
        False,
        description="Keep the moments in host memory and step on the CPU: each gradient is copied "
        "to host memory in backward and accumulated there, the updated weights are copied back "
        "(ZeRO-Offload's design; docs/memory.md). Not with in_backward or data parallel.",
    )
    offload_accumulation: Literal["device", "host"] | None = Field(
        None,
        description="How cpu_offload sums a step's micro-batches. device: the layer-major backward (every "
        "micro-batch forward first, each decoder layer's input kept in host memory; then layer by layer from "
        "the top, each layer's gradient summed on the device over the micro-batches and shipped to the host "
        "once). host: each micro-batch's whole gradient shipped and added on the host. null: device for full "
        "fine-tuning with grad_accum_steps > 1, host otherwise (LISA, preference, model.offload_activations; "
        "docs/memory.md).",
    )
    offload_group_size: Int | None = Field(
        None, ge=1,
        description="offload_accumulation device: micro-batches per group, whose layer inputs host memory holds "
        "at once; each further group adds each gradient once on the host. null: the most the host RAM holds "
        "(at most grad_accum_steps).",
    )
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Moments of adamw_32bit where the step runs on the CPU (cpu_offload or "
        "training.device cpu): bfloat16 halves their host memory (stochastically rounded; docs/memory.md).",
    )
    bf16_update: Literal["stochastic", "nearest"] = Field(
        "stochastic",
        description="How bfloat16 weights take an update: stochastic rounding (updates below half "
        "a bf16 step still land on average) or round-to-nearest (drops them; for comparison).",
    )
    rank: Int | None = Field(
        None, ge=1, description="apollo: rank r of the random projection of each decoder matrix's gradient "
        "(null: 256, the paper's; capped at the matrix's smaller side). apollo_mini is rank 1. docs/optimizers.md")
    scale: Float | None = Field(
        None, gt=0.0, description="apollo, apollo_mini: factor α on the scaled gradient (null: 1 for apollo, "
        "sqrt(128) for apollo_mini, the paper's).")
    update_proj_gap: Int = Field(
        200, ge=1, description="apollo, apollo_mini: optimizer steps between refreshes of the random projection "
        "(T; the paper's 200).")
    scale_type: Literal["channel", "tensor"] | None = Field(
        None, description="apollo: channel (one factor per row or column of the gradient) or tensor (one per "
        "matrix); null: channel. apollo_mini is tensor.")

    @field_validator("lr")
    @classmethod
    def _lr_positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("must be > 0")
        return v


class SchedulerSection(Section):
    name: Literal["constant", "linear", "cosine"] = Field("cosine", description="LR decay shape.")
    warmup_steps: Int = Field(0, ge=0, description="Linear warmup from 0 over this many steps.")
    min_lr_ratio: Float = Field(0.0, ge=0.0, le=1.0, description="Floor of the decay, x peak lr.")


class LisaSection(Section):
    enabled: Bool = Field(False, description="Train only sampled middle layers (plus embeddings/head).")
    active_layers: LayersOrAuto = Field(
        2, description="γ: decoder layers trained per interval. auto: the largest γ whose estimated peak fits "
        "the device's memory (a GPU's total memory; on CPU the host RAM available at start), worked out when "
        "the run starts and written into the run's recipe.yaml (docs/lisa.md).")
    interval_steps: Int = Field(20, ge=1, description="K: optimizer steps between re-samples.")
    sampling: Literal["uniform", "cyclic"] = Field(
        "uniform", description="uniform: γ layers drawn afresh each interval (the paper); cyclic: every "
        "layer trains at least once in each cycle of ceil(layers/γ) intervals, in an order drawn afresh "
        "per cycle (docs/lisa.md).")
    train_embeddings: Bool = Field(True, description="Embeddings always train (paper default).")
    train_head: Bool = Field(True, description="LM head and final norm always train (paper default).")
    state_policy: StatePolicy = Field(
        "discard",
        description="Optimizer state of a deactivated layer: discard (paper), offload_cpu, "
        "offload_disk, or keep (resident, as LMFlow; for comparison).",
    )


class TrainingSection(Section):
    seed: Int = Field(42, description="Seeds model init, data order, LISA sampling, dropout.")
    batch_size: Int = Field(1, ge=1, description="Sequences per micro-batch (per rank).")
    grad_accum_steps: Int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    max_steps: Int | None = Field(
        None, ge=1, description="Optimizer steps in the run. Give this or training.epochs.")
    epochs: Float | None = Field(
        None, gt=0, description="Passes over the train set, instead of max_steps: max_steps becomes "
        "ceil(epochs x train rows / (batch_size x grad_accum_steps x ranks)), worked out when the run "
        "starts and written beside it in the run's recipe.yaml. When both are set, max_steps counts (a "
        "warning says so).")
    max_grad_norm: Float | None = Field(1.0, description=(
        "Clip total grad norm; null disables (and lets optimizer.cpu_offload step each unit as its gradients "
        "arrive, hiding the CPU step behind backward)."))
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A step whose loss or gradient norm is not finite (NaN, inf). stop: the run "
        "ends there with one line (exit 1), keeps its checkpoints and writes no final/. skip: the step "
        "updates nothing and is counted (metrics field skipped_steps); not with optimizer.in_backward. "
        "May change on resume.")
    accept_data_change: Bool = Field(
        False, description="Resume over training data that changed since the checkpoint (its digest of token "
        "ids and labels, or its count, differs), with a warning; without it such a resume is refused. For "
        "`lisaft resume RUN --set training.accept_data_change=true`.")
    log_every: Int = Field(1, ge=1, description="Write a train record every N steps.")
    eval_every: Int = Field(0, ge=0, description="Evaluate every N steps (0: only at the end); without "
                            "an eval set (data.eval, data.eval_fraction) nothing is evaluated and a warning says so.")
    eval_batches: Int | None = Field(None, ge=1, description="Cap eval at the first N global batches of data.eval "
                                      "(batch_size x grad_accum_steps x ranks examples each; null: all).")
    save_every: Int = Field(0, ge=0, description="Checkpoint every N steps (0: only on stop/end).")
    keep_last: Int = Field(2, ge=1, description="Complete checkpoints kept on disk.")
    output_dir: str = Field(..., description="Run directory; a relative path means the recipe file's "
                            "folder (the current directory when given with --set).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available.")
    compile: Bool = Field(
        False, description="Compile each decoder layer with torch.compile (regional: same weights, same "
        "checkpoints). An 11% faster LISA step on a 2-core CPU, after 4-20 s of compiling at start-up "
        "(docs/lisa.md). Needs a C++ compiler (CPU) or triton (CUDA).")
    shard_optimizer_state: Bool = Field(
        False,
        description="Data parallel only: each rank keeps the moments of its share of the trainable "
        "parameters and broadcasts their update (optimizer memory / ranks; same results).",
    )
    fsdp: Bool = Field(
        False,
        description="Under torchrun: shard weights, gradients and optimizer state over the ranks with "
        "FSDP2 (one FSDP unit per training unit), for models larger than one card; LISA works. "
        "adamw_32bit and adamw_8bit only; a resume may change the number of ranks if the global batch "
        "stays the same (docs/distributed.md).",
    )
    threads: int | Literal["auto"] = Field(
        "auto", description="CPU threads for torch's kernels. auto: the CPUs this process may use "
        "(affinity and container quota), shared among data-parallel processes on the machine; "
        "OMP_NUM_THREADS, when set, counts instead. See docs/threads.md.")

    @model_validator(mode="after")
    def _length(self) -> TrainingSection:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set training.max_steps (optimizer steps) or training.epochs (passes "
                             "over the train set)")
        return self

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, v: Any) -> Any:
        if v == "auto":
            return v
        try:
            n = whole_number(v)
        except ValueError:
            n = None
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"must be a whole number of threads (1 or more) or auto, got {v!r}")
        return n

    @field_validator("max_grad_norm")
    @classmethod
    def _norm_positive(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise ValueError("must be > 0, or null to disable clipping")
        return v


# Each loss's β when the recipe gives none, with its source: config/preference_losses.py.
PREFERENCE_BETA: dict[str, float] = {n: preference_loss(n).beta for n in PREFERENCE_LOSSES}


class PreferenceSection(Section):
    loss: PreferenceLoss = Field(
        ..., description="dpo: −log σ(β((logp_c − ref_c) − (logp_r − ref_r))), log-probs summed over "
        "each completion, the reference's computed once before step 1; simpo: −log σ(β(avg_c − avg_r) − γ), "
        "avg the mean log-prob per completion token, no reference; orpo: the chosen answers' NLL plus "
        "β times the odds-ratio loss, no reference; ipo: (h − 1/(2β))², h the difference of the "
        "per-token log-ratios to the reference; kto (data.format feedback): 1 − σ(β(r − z)) for a desirable answer, "
        "1 − σ(β(z − r)) for an undesirable one, r its log-ratio to the reference, z the batch's KL estimate. "
        "docs/preference.md")
    beta: Float = Field(
        0.1, gt=0.0, description="DPO's β, SimPO's β, ORPO's λ (the odds-ratio term's weight), IPO's τ. When "
        "unset, the loss's own default: dpo 0.1 (the DPO paper, TRL's DPOConfig), simpo 2.0 (the SimPO paper, "
        "torchtune's SimPOLoss), orpo 0.1 (the ORPO paper, TRL's ORPOConfig), ipo 0.1 (TRL's DPOConfig), "
        "kto 0.1 (the KTO paper, TRL's KTOConfig).")
    gamma: Float = Field(
        0.5, ge=0.0, description="SimPO's target reward margin γ (TRL's CPOConfig simpo_gamma and torchtune's "
        "SimPOLoss: 0.5). Read by simpo only.")
    desirable_weight: Float = Field(
        1.0, gt=0.0, description="KTO's weight of a desirable answer's loss (TRL's KTOConfig: 1.0); with fewer "
        "desirable than undesirable rows the paper keeps desirable_weight × desirable rows over undesirable_weight "
        "× undesirable rows between 1 and 4/3. Read by kto only.")
    undesirable_weight: Float = Field(
        1.0, gt=0.0, description="KTO's weight of an undesirable answer's loss (TRL's KTOConfig: 1.0). Read by "
        "kto only.")
    reference: str | None = Field(
        None, description="The reference model of a loss with one (dpo, ipo, kto; a local folder or hub id), loaded "
        "only for the one pass that computes the reference log-probs before step 1. null: the initial policy "
        "itself.")

    @model_validator(mode="before")
    @classmethod
    def _beta_of_the_loss(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("beta") is None and data.get("loss") in PREFERENCE_LOSSES:
            data = {**data, "beta": PREFERENCE_BETA[data["loss"]]}
        return data


LoggingBackend = Literal["jsonl", "tensorboard", "wandb"]


class LoggingSection(Section):
    backends: list[LoggingBackend] = Field(
        ["jsonl"],
        description="Where records go: jsonl (RUN/metrics.jsonl, always on), tensorboard "
        "(RUN/logs/tensorboard), wandb (RUN/logs/wandb). See docs/logging.md.",
    )
    wandb_project: str = Field("lisaft", description="W&B project the run is logged under.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: write locally, upload later with `wandb sync`; online: "
        "stream to the W&B server (needs `wandb login`).",
    )


class Recipe(Section):
    model: ModelSection
    data: DataSection
    optimizer: OptimizerSection = OptimizerSection()
    scheduler: SchedulerSection = SchedulerSection()
    lisa: LisaSection = LisaSection()
    lora: LoraSection = LoraSection()
    training: TrainingSection
    logging: LoggingSection = LoggingSection()
    preference: PreferenceSection | None = Field(
        None, description="Preference tuning: DPO, SimPO, ORPO, IPO on data.format preference, KTO on data.format "
        "feedback; null: SFT.")
    grpo: GrpoSection | None = Field(
        None, description="GRPO: online RL on verifiable rewards, on data.format prompts (TRL 1.16's names "
        "and defaults, docs/grpo.md); null: no online stage.")

    @model_validator(mode="after")
    def _combinations(self) -> Recipe:
        # The table lives in config/compat.py, beside the rules that depend on the number of ranks.
        if (message := first_exclusion(self)) is not None:
            raise ValueError(message)
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)



# Keys a resume may change; the change is reported. Gradient checkpointing recomputes the same
# activations, so turning it on after an out-of-memory stop continues the same run.
CADENCE_KEYS = (
    "training.max_steps", "training.log_every", "training.eval_every", "training.eval_batches",
    "training.save_every", "training.keep_last", "training.device", "training.threads",
    "training.on_nonfinite", "training.accept_data_change",
    "model.gradient_checkpointing",
    "logging.backends", "logging.wandb_project", "logging.wandb_mode",
)

# Recipe fields holding paths: resolved against the recipe file's folder, or the current directory
# for a value given with --set.
_PATH_FIELDS = (
    ("model", "name_or_path"), ("model", "config"), ("model", "tokenizer"),
    ("data", "train"), ("data", "eval"), ("training", "output_dir"), ("preference", "reference"),
)


def _resolve_paths(data: dict, base: Path, only: list[Override] | None = None) -> None:
    """Resolve relative paths against `base`; with `only`, just the keys those overrides set."""
    for section, key in _PATH_FIELDS:
        sec = data.get(section)
        if not isinstance(sec, dict) or not isinstance(sec.get(key), str):
            continue
        if only is not None and not any(o.covers((section, key)) for o in only):
            continue
        value = sec[key]
        p = Path(value).expanduser()
        if p.is_absolute():
            continue
        candidate = base / p
        # A hub id ("name" or "org/name") stays as it is unless something of that name sits beside
        # the recipe; a value that can only be a path ("./x", "a/b/c", "x.jsonl") is resolved
        # even when missing, so the error names the full path.
        if key in ("name_or_path", "tokenizer", "train", "eval", "reference") and not candidate.exists() \
                and not can_only_be_path(value, data_file=section == "data"):
            continue
        sec[key] = str(candidate.resolve())


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section type a field holds (`X` or an optional `X | None`), or None for a plain key."""
    from typing import get_args

    for t in (annotation, *get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _known_keys(loc: tuple) -> list[str]:
    """The keys allowed where `loc` points (a section or the top level)."""
    model: Any = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        section = _section(field.annotation) if field is not None else None
        if section is None:
            return []
        model = section
    return list(model.model_fields)


def _message(e: ErrorDetails) -> str:
    if e["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(e["loc"][-1]), _known_keys(e["loc"]), n=1, cutoff=0.6)
        prefix = "".join(f"{p}." for p in e["loc"][:-1])
        if not close and len(e["loc"]) == 1:  # a section's key given without its section
            close = [f"{name}.{e['loc'][0]}" for name in _known_keys(e["loc"])
                     if e["loc"][0] in _known_keys((name, e["loc"][0]))][:1]
        return "unknown key" + (f"; did you mean {prefix}{close[0]}?" if close else "")
    if e["type"] == "missing":
        return "required key is missing"
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a section of keys (a YAML mapping), got {type(e['input']).__name__}"
    if e["type"] == "bool_type":
        return "must be true or false"
    if e["type"] == "string_type":
        return "must be text"
    if e["type"] == "literal_error":
        choices = re.findall(r"'([^']*)'", e["ctx"]["expected"])
        close = difflib.get_close_matches(str(e["input"]), choices, n=1, cutoff=0.6)
        return f"{e['input']!r} is not one of {', '.join(choices)}" + (f"; did you mean {close[0]}?" if close else "")
    # pydantic's own words, minus its prefixes and any internal class name.
    return re.sub(r"\b\w+Section\b", "section", e["msg"].removeprefix("Value error, "))


def format_validation_error(err: ValidationError, source: str, overrides: tuple[Override, ...] = ()) -> str:
    """One line. A mistake in a key given with --set is blamed on the --set, the rest on `source`
    (with the --set items when the recipe-wide check failed, where both may play a part)."""
    from_file: list[str] = []
    from_set: list[str] = []
    recipe_wide = False
    for e in err.errors():
        # A failed Annotated/Literal/union member adds a non-key part to loc; keep the key path.
        keys = tuple(p for p in e["loc"]
                     if not (isinstance(p, str) and ("[" in p or p in ("int", "float", "bool"))))
        loc = ".".join(map(str, keys))
        line = f"{loc}: {_message(e)}" if loc else _message(e)
        recipe_wide |= len(keys) <= 1  # the recipe or a whole section: a --set may play a part
        by = next((o for o in overrides if keys and o.covers(keys)), None)
        if by is not None and e["type"] == "string_type" and not isinstance(by.value, str):
            # YAML read the text as something else ("Q: {instruction}" is a mapping).
            line += f" (YAML read {by.raw!r} as a {type(by.value).__name__}); to pass it as text, quote it: " \
                    + by.as_text()
        if by is not None:
            from_set.append(by.blame(line))
        else:
            from_file.append(line)
    parts = list(dict.fromkeys(from_set))
    if from_file:
        where = source + ("".join(f" {typed}" for typed in dict.fromkeys(o.typed for o in overrides))
                          if recipe_wide else "")
        parts.insert(0, f"{where}: invalid recipe: " + "; ".join(dict.fromkeys(from_file)))
    return "; ".join(parts)


def recipe_from_dict(data: dict, source: str = "recipe", overrides: tuple[Override, ...] = ()) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise LisaftError(format_validation_error(e, source, overrides)) from None


def load_recipe(path: str | Path, overrides: Sequence[str | Override] | None = None,
                resolve_paths: bool = True) -> Recipe:
    """Read a recipe YAML, apply --set overrides (or a command's flags, config/overrides.py
    flag_override), resolve relative paths, validate."""
    path = Path(path)
    if not path.is_file():
        raise LisaftError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(e, "problem", None) or first_line(e)
        raise LisaftError(f"{path}: {where}not valid YAML: {what}") from None
    except UnicodeDecodeError:
        raise LisaftError(f"{path}: not a text file") from None
    except OSError as e:
        raise LisaftError(f"{path}: cannot read the recipe: {e.strerror or e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LisaftError(f"{path}: a recipe must be a YAML mapping of sections, got {type(data).__name__}")
    parsed = parsed_overrides(overrides or [])
    if resolve_paths:  # the file's paths mean its folder, the command line's the current directory
        _resolve_paths(data, path.resolve().parent)
        resolve_reward_paths(data, path.resolve().parent)
    data = apply_overrides(data, parsed)
    if resolve_paths and parsed:
        _resolve_paths(data, Path.cwd(), only=list(parsed))
        if any(o.covers(("grpo", "reward_funcs")) for o in parsed):
            resolve_reward_paths(data, Path.cwd())
    return recipe_from_dict(data, str(path), parsed)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _choices(field) -> str:
    """' One of: a, b.' for a key that takes one of a fixed set of words, read from its type."""
    from typing import get_args, get_origin

    if get_origin(field.annotation) is not Literal:
        return ""
    return " One of: " + ", ".join(f"`{v}`" for v in get_args(field.annotation)) + "."


def reference_markdown() -> str:
    """docs/recipes.md, generated from the schema so the reference cannot drift from the code
    (tests/unit/test_recipe.py checks it)."""
    lines = ["# Recipe reference", "",
             "Generated from `lisaft/config/schema.py` by `python -m lisaft.config.schema > docs/recipes.md`.",
             "Unknown keys are errors. Any key can be overridden on the command line with",
             "`--set section.key=value` (the value is parsed as YAML; quote text that YAML would read",
             "otherwise: `--set 'data.template=\"Q: {instruction}\"'`). A relative path in the recipe",
             "file resolves against the file's folder; one given with `--set` against the current",
             "directory, as any path typed on a command line.", ""]
    for name, f in Recipe.model_fields.items():
        section = _section(f.annotation)
        assert section is not None, f"Recipe.{name} is not a section"
        lines += [f"## {name}", ""] + ([f.description, ""] if f.description else [])
        lines += ["| key | default | meaning |", "| --- | --- | --- |"]
        for key, field in section.model_fields.items():
            default = "required" if field.is_required() else json.dumps(
                field.default if not isinstance(field.default, tuple) else list(field.default))
            lines.append(f"| `{name}.{key}` | {default} | {field.description or ''}{_choices(field)} |")
        lines.append("")
    lines += ["## Keys a resume may change", "",
              ", ".join(f"`{k}`" for k in CADENCE_KEYS) + ". On another number of ranks than wrote "
              "the checkpoint, also `training.batch_size` and `training.grad_accum_steps`, as long as "
              "batch_size x grad_accum_steps x ranks stays the same (docs/distributed.md). Every other key "
              "alters the training path and is refused by `lisaft resume`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown(), end="")
