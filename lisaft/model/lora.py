"""LoRA, DoRA and QLoRA through peft: adapters on a frozen (optionally 4-bit) base.

peft replaces each targeted nn.Linear inside the transformers model in place, so the model the
loop runs, its decoder layers and its units stay the transformers model; only the adapters (and,
with lora.train_embeddings, the embeddings and head) are trainable, and only they become units.
The PeftModel wrapper is kept for peft's own adapter format at export.

The base a run trains on is named by a cheap fingerprint (config.json and each weights file's
name, size, first and last MiB) that every checkpoint records: a resume or `lisaft generate`
against another base is refused rather than silently adding adapters to the wrong weights.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from lisaft.config.hub import is_local
from lisaft.config.schema import ModelSection, Recipe
from lisaft.console import first_line
from lisaft.errors import LisaftError
from lisaft.model.parts import DTYPES
from lisaft.model.units import Unit

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ADAPTER = "default"  # peft's adapter name; lisaft trains one
_EDGE_BYTES = 1 << 20


def require_peft():
    """peft, or one line naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise LisaftError("lora.enabled needs peft, which is not installed: pip install 'lisaft[lora]'") from None
    return peft


def quantization_config(section: ModelSection):
    """model.quantize: nf4 as transformers' BitsAndBytesConfig (QLoRA's choices: NF4, double
    quantization of the scales, computing in model.dtype)."""
    if section.quantize is None:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=DTYPES[section.dtype])


@dataclass
class Adapters:
    """The run's adapters: peft's wrapper around the training model, and the base they belong to."""

    peft_model: PreTrainedModel  # peft's PeftModel: a transformers model's save_pretrained
    base: dict  # {"base": what model.name_or_path or model.config named, "fingerprint": hex}

    def trainable_units(self, units: list[Unit]) -> list[Unit]:
        """Units holding only what trains: the frozen base is in no unit, so LISA's controller,
        the optimizers and the checkpoint never touch it."""
        kept = []
        for u in units:
            params = [p for p in u.params if p.requires_grad]
            if params:
                kept.append(Unit(u.name, u.index, params, u.layer))
        return kept

    def trainable_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{state-dict name: tensor} of every trainable parameter (the checkpoint's weights)."""
        return {n: p for n, p in model.named_parameters() if p.requires_grad}


def attach_adapters(model: nn.Module, recipe: Recipe) -> Adapters:
    """Adapters on `model` as recipe.lora says, in model.dtype (bf16 adapters take stochastically
    rounded updates like any bf16 weight), initialised from training.seed."""
    peft = require_peft()
    lora = recipe.lora
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.scale_alpha, lora_dropout=lora.dropout,
                             target_modules=lora.target_modules, use_dora=lora.dora, bias="none",
                             task_type="CAUSAL_LM")
    torch.manual_seed(recipe.training.seed)
    try:
        # autocast off: peft would otherwise keep bf16 adapters in float32.
        peft_model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as e:
        raise LisaftError(f"lora.target_modules: {first_line(e)}") from None
    dtype = DTYPES[recipe.model.dtype]
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)
    if lora.train_embeddings:
        _unfreeze_ends(model, recipe)
    from lisaft.model.checkpointing import frozen_inputs

    frozen_inputs(model)  # peft's wrapping of a checkpointed model made the input require grad again
    return Adapters(peft_model, base_fingerprint(recipe))


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model inside the block: every LoRA layer's adapters off, back on after (GRPO's
    reference under LoRA, with no second copy of the weights)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _unfreeze_ends(model: nn.Module, recipe: Recipe) -> None:
    from lisaft.model.parts import model_parts

    parts = model_parts(model, recipe.model.layers_path)
    for p in [*parts.embeddings, *parts.head]:
        if p.is_floating_point():
            p.requires_grad_(True)


def base_fingerprint(recipe: Recipe) -> dict:
    """What the adapters were trained on, cheaply: reading every byte of an 8B base would take
    longer than loading it."""
    m = recipe.model
    h = hashlib.sha256()
    if m.config is not None:
        # A random init is its config and the seed that drew it.
        cfg = Path(m.config)
        cfg = cfg / "config.json" if cfg.is_dir() else cfg
        h.update(cfg.read_bytes() if cfg.is_file() else m.config.encode())
        h.update(f"seed={recipe.training.seed}".encode())
        return {"base": m.config, "fingerprint": h.hexdigest()[:16]}
    assert m.name_or_path is not None  # the schema asks for model.config or model.name_or_path
    if not is_local(m.name_or_path):
        h.update(m.name_or_path.encode())  # a hub id: its revision is the hub's to keep
        return {"base": m.name_or_path, "fingerprint": h.hexdigest()[:16]}
    folder = Path(m.name_or_path)
    for f in sorted(folder.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with f.open("rb") as fh:
                h.update(fh.read(_EDGE_BYTES))
                fh.seek(max(0, size - _EDGE_BYTES))
                h.update(fh.read(_EDGE_BYTES))
    return {"base": m.name_or_path, "fingerprint": h.hexdigest()[:16]}


class OtherBase(LisaftError):
    """Adapters met a base they were not trained on: no older checkpoint would do better."""


def check_base(saved: dict, now: dict, where: str) -> None:
    if saved.get("fingerprint") != now["fingerprint"]:
        raise OtherBase(f"{where}: its adapters were trained on base {saved.get('base')} (fingerprint "
                          f"{saved.get('fingerprint')}), but model.name_or_path now gives {now['base']} "
                          f"(fingerprint {now['fingerprint']}); point model.name_or_path at the base it trained on")


def merged_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The transformers state dict with every adapter merged into its layer, in `dtype`, on the
    CPU, the live model untouched: W + (alpha/r) B A, for DoRA m (W + s B A) / ||W + s B A|| by
    row; a 4-bit base is dequantized first (its NF4 rounding stays in the merged weight)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.integrations import dequantize_module_weight

    out: dict[str, torch.Tensor] = {}
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    with torch.no_grad():
        for name, m in adapted.items():
            base = m.get_base_layer()
            w = dequantize_module_weight(base).float()
            delta = m.get_delta_weight(ADAPTER).float()  # type: ignore[attr-defined]  # on every LoRA layer kind
            if m.use_dora.get(ADAPTER, False):
                norm = torch.linalg.norm(w + delta, dim=1)
                w = (m.lora_magnitude_vector[ADAPTER].weight.float() / norm).view(-1, 1) * (w + delta)
            else:
                w = w + delta
            out[f"{name}.weight"] = w.to(dtype).cpu()
            bias = getattr(base, "bias", None)
            if isinstance(bias, torch.Tensor):
                out[f"{name}.bias"] = bias.detach().to(dtype).cpu()
        for key, t in model.state_dict().items():
            if any(key.startswith(f"{name}.") for name in adapted):
                continue
            out[key] = (t.to(dtype) if t.is_floating_point() else t).detach().cpu()
    return out


def merged_model(model: nn.Module, dtype: torch.dtype) -> PreTrainedModel:
    """A plain transformers model (no peft, no 4-bit) holding the merged weights, on the CPU."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = merged_state_dict(model, dtype)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    plain.tie_weights()
    missing = [k for k in missing if plain.get_parameter(k).is_meta] if missing else []
    if missing or unexpected:
        raise RuntimeError(f"merging the adapters left missing {missing[:3]}, unexpected {unexpected[:3]}")
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(model.generation_config)
    return plain


def save_final(model: nn.Module, adapters: Adapters, recipe: Recipe, folder: Path) -> None:
    """RUN/final of a LoRA run: a merged transformers model, or peft's adapter folder naming the
    base it loads onto (lora.export)."""
    if recipe.lora.export == "adapter":
        adapters.peft_model.save_pretrained(folder, safe_serialization=True)
        _name_base(folder, adapters.base["base"])
        return
    merged_model(model, DTYPES[recipe.model.dtype]).save_pretrained(folder, safe_serialization=True)


def _name_base(folder: Path, base: str) -> None:
    """adapter_config.json's base_model_name_or_path: the base the recipe named (peft writes what
    transformers recorded, which for a local folder may be a relative path)."""
    import json

    cfg = folder / "adapter_config.json"
    data = json.loads(cfg.read_text())
    data["base_model_name_or_path"] = base
    cfg.write_text(json.dumps(data, indent=2))


def load_adapter_folder(folder: Path):
    """peft's adapter folder on its base (the base in its saved dtype, not quantized)."""
    import json

    require_peft()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((Path(folder) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        # The adapters in the dtype they trained in: peft would otherwise widen bf16 ones to float32.
        return PeftModel.from_pretrained(model, str(folder), autocast_adapter_dtype=False)
    except (OSError, ValueError) as e:
        raise LisaftError(f"{folder}: cannot load the adapters onto their base {base}: {first_line(e)}") from None
