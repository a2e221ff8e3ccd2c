"""`lisaft estimate-memory`: parse the recipe and flags into Settings, compute, render."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from lisaft.errors import LisaftError
from lisaft.memory.advice import advice, largest_fitting, optimizer_grid
from lisaft.memory.catalogue import catalogue_names, resolve_model
from lisaft.memory.counts import param_counts
from lisaft.allocator import expandable_segments
from lisaft.memory.estimate import DTYPE_BYTES, GiB, Estimate, Settings, compute
from lisaft.memory.optimizer_state import OPTIMIZERS
from lisaft.recipe import Recipe, load_recipe

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1000**4, "tib": 1024**4}
_ATTENTION = ("auto", "flash_attention_2", "sdpa", "eager")


def parse_bytes(text: str, key: str = "--budget") -> int:
    """'24GiB', '80GB', '24G' (binary), '1.5 TiB', or a plain byte count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise LisaftError(f"{key}: {text!r} is not a size such as 24GiB, 80GB or 16G")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise LisaftError(f"{key}: must be positive")
    return value


def _attention_for(choice: str, device: str, dtype: str) -> str:
    # FlashAttention and SDPA keep the same tensors (q, k, v, output, log-sum-exp), so "auto"
    # needs no knowledge of whether flash-attn is installed to be estimated right.
    if choice == "auto":
        return "flash_attention_2" if device == "cuda" and dtype != "float32" else "sdpa"
    return choice


def _model_ref(recipe: Recipe) -> tuple[str, str]:
    if recipe.model.config is not None:
        return recipe.model.config, "model.config"
    return recipe.model.name_or_path, "model.name_or_path"


def settings_from_recipe(recipe: Recipe, device: str = "cuda", budget_bytes: int = 24 * GiB,
                         model: str | None = None) -> Settings:
    ref, key = (model, "--model") if model else _model_ref(recipe)
    config, label = resolve_model(ref, key)
    return Settings(
        model_label=label, config=config, dtype=recipe.model.dtype,
        attention=_attention_for(recipe.model.attention, device, recipe.model.dtype),
        gradient_checkpointing=recipe.model.gradient_checkpointing,
        offload_activations=recipe.model.offload_activations,
        mlp_chunk_tokens=recipe.model.mlp_chunk_tokens,
        optimizer=recipe.optimizer.name, in_backward=recipe.optimizer.in_backward,
        bf16_update=getattr(recipe.optimizer, "bf16_update", "stochastic"),
        expandable_segments=expandable_segments(),
        lisa=recipe.lisa.enabled, active_layers=recipe.lisa.active_layers,
        train_embeddings=recipe.lisa.train_embeddings, train_head=recipe.lisa.train_head,
        state_policy=recipe.lisa.state_policy, batch_size=recipe.training.batch_size,
        seq_len=recipe.data.max_seq_len, grad_accum_steps=recipe.training.grad_accum_steps,
        clipping=recipe.training.max_grad_norm is not None, device=device,
        budget_bytes=budget_bytes,
    )


def _device_budget(device: str) -> int:
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        return 24 * GiB
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def estimate_for_recipe(recipe: Recipe, device: str = "cuda", budget_bytes: int | None = None) -> Estimate:
    """The estimate for a run of `recipe` on `device` ("cuda", "cpu", or a torch.device); the
    budget defaults to the device's memory (GPU total memory, or physical RAM)."""
    device = getattr(device, "type", device)
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise LisaftError(f"memory estimate: unsupported device {device!r} (cuda or cpu)")
    budget = budget_bytes if budget_bytes is not None else _device_budget(device)
    s = settings_from_recipe(recipe, device=device, budget_bytes=budget)
    return compute(s.with_(datasets_imported="datasets" in sys.modules))


def _check_choice(key: str, value: str | None, allowed) -> None:
    if value is not None and value not in allowed:
        raise LisaftError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def build_settings(recipe: Path | None, model: str | None, optimizer: str | None,
                   lisa_layers: int | None, no_lisa: bool, batch_size: int | None,
                   seq_len: int | None, gradient_checkpointing: bool | None,
                   attention: str | None, dtype: str | None, in_backward: bool | None,
                   budget: str, device: str) -> Settings:
    """Recipe values first, each flag given on the command line overriding its key."""
    _check_choice("--device", device, ("cuda", "cpu"))
    _check_choice("--optimizer", optimizer, OPTIMIZERS)
    _check_choice("--attention", attention, _ATTENTION)
    _check_choice("--dtype", dtype, tuple(DTYPE_BYTES))
    if lisa_layers is not None and no_lisa:
        raise LisaftError("--lisa-layers and --no-lisa contradict each other; give one")
    for key, v in (("--lisa-layers", lisa_layers), ("--batch-size", batch_size), ("--seq-len", seq_len)):
        if v is not None and v < 1:
            raise LisaftError(f"{key}: must be at least 1, got {v}")
    budget_bytes = parse_bytes(budget)

    if recipe is not None:
        s = settings_from_recipe(load_recipe(recipe), device, budget_bytes, model)
    elif model is not None:
        config, label = resolve_model(model)
        s = Settings(model_label=label, config=config, device=device, budget_bytes=budget_bytes,
                     expandable_segments=expandable_segments(),
                     attention=_attention_for("auto", device, dtype or "bfloat16"))
    else:
        raise LisaftError("give a RECIPE or --model NAME (catalogue: " + ", ".join(catalogue_names()) + ")")

    changes: dict = {}
    if optimizer is not None:
        changes["optimizer"] = optimizer
    if no_lisa:
        changes["lisa"] = False
    if lisa_layers is not None:
        changes.update(lisa=True, active_layers=lisa_layers)
    if batch_size is not None:
        changes["batch_size"] = batch_size
    if seq_len is not None:
        changes["seq_len"] = seq_len
    if gradient_checkpointing is not None:
        changes["gradient_checkpointing"] = gradient_checkpointing
    if dtype is not None:
        changes["dtype"] = dtype
    if attention is not None:
        changes["attention"] = _attention_for(attention, device, dtype or s.dtype)
    if in_backward is not None:
        changes["in_backward"] = in_backward
        if in_backward:
            changes["clipping"] = False  # in-backward steps cannot clip by the total norm
    s = s.with_(**changes)
    if s.in_backward and s.grad_accum_steps > 1:
        raise LisaftError("--in-backward cannot be combined with training.grad_accum_steps > 1")
    layers = param_counts(s.config).layer_count
    if s.lisa and s.active_layers > layers:
        key = "--lisa-layers" if lisa_layers is not None else "lisa.active_layers"
        raise LisaftError(f"{key}: {s.active_layers} is more than the model's {layers} layers")
    return s


def estimate_memory_command(recipe: Path | None = None, model: str | None = None,
                            optimizer: str | None = None, lisa_layers: int | None = None,
                            no_lisa: bool = False, batch_size: int | None = None,
                            seq_len: int | None = None, gradient_checkpointing: bool | None = None,
                            attention: str | None = None, dtype: str | None = None,
                            in_backward: bool | None = None, budget: str = "24GiB",
                            device: str = "cuda", json_out: bool = False) -> int:
    s = build_settings(recipe, model, optimizer, lisa_layers, no_lisa, batch_size, seq_len,
                       gradient_checkpointing, attention, dtype, in_backward, budget, device)
    est = compute(s)
    layers = param_counts(s.config).layer_count
    changes = [] if est.fits else advice(est, layers)
    max_seq = largest_fitting(s, "seq_len")
    max_batch = largest_fitting(s, "batch_size")
    gamma = s.active_layers if s.lisa else min(2, layers)
    grid = optimizer_grid(s, gamma)
    if json_out:
        out = est.to_json()
        out["largest_seq_len"] = max_seq
        out["largest_batch_size"] = max_batch
        out["advice"] = [{"change": c.what, "total_bytes": c.estimate.total_bytes,
                          "fits": c.estimate.fits} for c in changes]
        out["optimizers"] = {
            opt: {mode: {"total_bytes": e.total_bytes, "fits": e.fits,
                         "paged_host_bytes": e.paged_host_bytes}
                  for (o, mode), e in grid.items() if o == opt}
            for opt in OPTIMIZERS
        }
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console

    from lisaft.memory.render import render

    Console().print(render(est, changes, grid, max_seq, max_batch))
    return 0
