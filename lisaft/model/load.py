"""Loading models and tokenizers, choosing attention, compiling layers (the parts LISA works on:
parts.py)."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from lisaft.config.hub import hub_error, hub_offline, is_local
from lisaft.config.schema import ModelSection
from lisaft.console import first_line, warn
from lisaft.errors import LisaftError
from lisaft.model.parts import DTYPES, input_embeddings, model_parts, output_embeddings, pretrained


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(choice: str, device: torch.device, dtype: str) -> str:
    """auto → flash_attention_2 where it can run, sdpa otherwise. An explicit FlashAttention
    request that cannot run is an error rather than a silent downgrade."""
    fa_ok = flash_attn_available() and device.type == "cuda" and dtype != "float32"
    if choice == "auto":
        return "flash_attention_2" if fa_ok else "sdpa"
    if choice == "flash_attention_2" and not fa_ok:
        if not flash_attn_available():
            why = "the flash-attn package is not installed (pip install flash-attn)"
        elif device.type != "cuda":
            why = "it needs a CUDA device and this run is on CPU"
        else:
            why = "it needs model.dtype bfloat16 or float16"
        raise LisaftError(f"model.attention: flash_attention_2 cannot run: {why}; or set model.attention: sdpa")
    return choice


_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "vocab.txt", "spiece.model")


def _check_folder(path: Path, key: str, what: str) -> None:
    """What a folder lacks, said before transformers guesses (it blames sentencepiece, or reports
    an unreadable file as missing)."""
    if not path.is_dir():
        raise LisaftError(f"{key}: {path} is a file; give the folder that holds the {what}")
    if what == "model":
        if not (path / "config.json").is_file():
            raise LisaftError(f"{key}: {path}: no config.json, so no saved model is in it (save one "
                              "with save_pretrained, or build a random one with model.config)")
        if not any(any(path.glob(g)) for g in _WEIGHT_GLOBS):
            raise LisaftError(f"{key}: {path}: no weights (model.safetensors) in it; for a random "
                              "init from its config.json use model.config instead")
    elif not any((path / f).is_file() for f in _TOKENIZER_FILES):
        fix = ("set model.tokenizer to a tokenizer folder" if key == "model.name_or_path"
               else "point it to a tokenizer folder")
        raise LisaftError(f"{key}: {path}: no tokenizer in it (none of {', '.join(_TOKENIZER_FILES[:3])}); {fix}")
    for f in sorted(path.iterdir()):
        if f.is_file() and not os.access(f, os.R_OK):
            raise LisaftError(f"{key}: {f}: permission denied; make it readable (chmod a+r)")


def load_config(ref: str):
    from transformers import AutoConfig

    path = Path(ref)
    if not path.exists():
        raise LisaftError(f"model.config: {ref}: no such file or folder")
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for bad configs
        raise LisaftError(f"model.config: {ref}: not a usable config.json: {e}") from None


def context_length(config) -> int | None:
    """Positions the model was trained for (max_position_embeddings, or n_positions)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None) if not isinstance(config, dict) else config.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context_length(config, max_seq_len: int) -> None:
    """A longer sequence than the model has positions for: an error, unless the config scales
    RoPE beyond it (then the user chose it, and a warning says so)."""
    limit = context_length(config)
    if limit is None or max_seq_len <= limit:
        return
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    scaling = get("rope_parameters") or get("rope_scaling")
    # transformers fills in {"rope_type": "default"} for an unscaled model.
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        warn(f"data.max_seq_len: {max_seq_len} is above the model's max_position_embeddings "
             f"{limit}; relying on its rope_scaling {scaling}")
        return
    raise LisaftError(f"data.max_seq_len: {max_seq_len} is above the model's context length "
                      f"(max_position_embeddings {limit}) and its config sets no rope_scaling; use "
                      f"{limit} or less")


def load_tokenizer(section: ModelSection):
    from transformers import AutoTokenizer

    ref = section.tokenizer or section.name_or_path
    assert ref is not None  # the schema asks for model.tokenizer when model.config is used
    key = "model.tokenizer" if section.tokenizer else "model.name_or_path"
    if is_local(ref):
        if key == "model.name_or_path":  # an empty or wrong folder is a model problem first
            _check_folder(Path(ref), key, "model")
        _check_folder(Path(ref), key, "tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(ref, local_files_only=not is_local(ref) and hub_offline())
    except Exception as e:
        if is_local(ref):
            raise LisaftError(f"{key}: {ref}: cannot load a tokenizer from it: {first_line(e)}") from None
        raise hub_error(key, ref, e) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


def load_model(section: ModelSection, device: torch.device, seed: int = 0) -> nn.Module:
    """The model in `section.dtype` on `device`, attention chosen, checkpointing set up."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[section.dtype]
    attn = resolve_attention(section.attention, device, section.dtype)
    if section.config is not None:
        config = load_config(section.config)
        torch.manual_seed(seed)
        # Built directly on the training device: an 8B model in bf16 never passes through host RAM.
        model = _from_config(config, dtype, attn, device)
    else:
        ref = section.name_or_path
        assert ref is not None  # the schema asks for exactly one of model.config and model.name_or_path
        if is_local(ref):
            _check_folder(Path(ref), "model.name_or_path", "model")
        # model.quantize (QLoRA): bitsandbytes quantizes each weight as it is read, on the device.
        quantized = _quantized_loading(section, device)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                ref, dtype=dtype, attn_implementation=attn, local_files_only=not is_local(ref) and hub_offline(),
                **quantized)
        except Exception as e:
            if is_local(ref):
                raise LisaftError(f"model.name_or_path: {ref}: cannot load a model from it: {first_line(e)}") from None
            raise hub_error("model.name_or_path", ref, e) from None
    if section.quantize is None:
        model.to(device)
    elif device.type == "cpu":
        from lisaft.internals import keep_4bit_layout_on_cpu

        keep_4bit_layout_on_cpu(model)
    apply_model_settings(model, section, device)
    return model


def _quantized_loading(section: ModelSection, device: torch.device) -> dict:
    if section.quantize is None:
        return {}
    from lisaft.model.lora import quantization_config

    return {"quantization_config": quantization_config(section), "device_map": {"": device}}


def build_on_meta(section: ModelSection, device: torch.device) -> tuple[nn.Module, Path]:
    """model.name_or_path's architecture on the meta device (no weights anywhere yet), with the
    settings load_model applies, and the folder that holds its safetensors: training.fsdp
    shards it first and then reads each rank's rows (lisaft/distributed/fsdp.py load_sharded)."""
    from transformers import AutoConfig

    ref = section.name_or_path
    assert ref is not None  # training.fsdp reads from a saved model (fsdp.py's loader)
    folder = Path(ref) if is_local(ref) else _hub_folder(ref)
    _check_folder(folder, "model.name_or_path", "model")
    if not any(folder.glob("*.safetensors")):
        raise LisaftError(f"model.name_or_path: {ref}: training.fsdp reads each rank's rows from safetensors "
                          "files and this model has none; save it with save_pretrained (safetensors)")
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise LisaftError(f"model.name_or_path: {ref}: not a usable config.json: {first_line(e)}") from None
    attn = resolve_attention(section.attention, device, section.dtype)
    model = _from_config(config, DTYPES[section.dtype], attn, torch.device("meta"))
    apply_model_settings(model, section, device)
    return model, folder


def _from_config(config, dtype: torch.dtype, attn: str, device: torch.device) -> nn.Module:
    """The architecture of `config`, its tensors created on `device` (meta: none at all)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)


def _hub_folder(ref: str) -> Path:
    """The local snapshot of a hub model's config and safetensors (fetched unless offline)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, allow_patterns=["*.json", "*.safetensors"],
                                      local_files_only=hub_offline()))
    except Exception as e:
        raise hub_error("model.name_or_path", ref, e) from None


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant gradient checkpointing, under the name this transformers has: newer 5.x
    releases call it activation_checkpointing_enable, earlier ones (5.17 among them)
    gradient_checkpointing_enable. Non-reentrant works with frozen inputs, so the input hook both
    add is removed (frozen_inputs) and backward stops at the lowest trainable layer."""
    from lisaft.model.checkpointing import frozen_inputs

    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        pretrained(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    frozen_inputs(model)


def apply_model_settings(model: nn.Module, section: ModelSection, device: torch.device) -> None:
    """Checkpointing, long-context memory, no KV cache, train mode: what every loaded model gets."""
    if section.gradient_checkpointing:
        enable_checkpointing(model)
    if section.offload_activations or section.mlp_chunk_tokens:
        long_context_memory(model, section, device)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    model.train()


def sparse_grad_is_smaller(num_embeddings: int, tokens_per_step: int) -> bool:
    """A sparse embedding gradient holds a row (and an index) per token, twice while duplicates
    are summed: it pays while the step has fewer tokens than half the vocabulary."""
    return 2 * tokens_per_step < num_embeddings


def use_sparse_embedding_grad(model: nn.Module, enabled: bool, trains: bool, tokens_per_step: int,
                              world_size: int) -> bool:
    """Switch the input embedding to sparse gradients when that is exact and smaller: one
    process (the gradient all-reduce is dense), an untied nn.Embedding that trains."""
    emb = input_embeddings(model)
    out = output_embeddings(model)
    tied = out is not None and out.weight is emb.weight
    on = (enabled and trains and world_size == 1 and isinstance(emb, nn.Embedding) and not tied
          and sparse_grad_is_smaller(emb.num_embeddings, tokens_per_step))
    if isinstance(emb, nn.Embedding):
        emb.sparse = on
    return on


def compile_layers(layers: nn.ModuleList, device: torch.device) -> None:
    """training.compile: each decoder layer compiled in place (regional compilation: one small
    graph that every layer reuses, seconds to build rather than the whole model's minutes). The
    modules keep their parameters and names, so checkpoints and the unit optimizers are unchanged."""
    import shutil

    compilers = (os.environ.get("CXX", ""), "c++", "g++", "clang++")
    if device.type == "cpu" and not any(shutil.which(c) for c in compilers if c):
        raise LisaftError("training.compile: torch.compile on CPU needs a C++ compiler and none is on "
                          "PATH; install one (g++) or set training.compile false")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise LisaftError("training.compile: torch.compile on CUDA needs triton, which is not installed; "
                          "pip install triton or set training.compile false")
    for layer in layers:
        layer.compile()


def long_context_memory(model: nn.Module, section: ModelSection, device: torch.device) -> None:
    """model.offload_activations: each checkpointed decoder layer keeps its input in pinned host
    memory instead of on the device; model.mlp_chunk_tokens: MLPs run in checkpointed chunks
    (lisaft/model/activation_offload.py)."""
    from lisaft.model.activation_offload import chunk_mlps, enable_offloaded_checkpoints

    layers = model_parts(model, section.layers_path).layers
    try:
        if section.mlp_chunk_tokens:
            chunk_mlps(layers, section.mlp_chunk_tokens)
        if section.offload_activations:
            enable_offloaded_checkpoints(layers, device)
    except RuntimeError as e:
        key = "model.offload_activations" if "checkpoint" in str(e) else "model.mlp_chunk_tokens"
        raise LisaftError(f"{key}: {e}") from None
