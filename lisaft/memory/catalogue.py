"""Finding a model's config: a short catalogue name, a local folder or config.json, a hub id.

The catalogue ships config.json files written from the models' published configurations, so
that estimates work offline and without downloading weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lisaft.console import first_line
from lisaft.errors import LisaftError

CATALOGUE_DIR = Path(__file__).parent / "catalogue"


def catalogue_names() -> list[str]:
    return sorted(p.stem for p in CATALOGUE_DIR.glob("*.json"))


def _normalise(ref: str) -> str:
    # "meta-llama/Meta-Llama-3.1-8B-Instruct" and "/models/Llama-3.1-8B" both mean llama-3.1-8b:
    # the estimate does not depend on the instruct tuning or the organisation.
    name = ref.rstrip("/").split("/")[-1].lower().replace("_", "-")
    name = re.sub(r"^meta-", "", name)
    name = re.sub(r"-(instruct|chat|it|base|hf|4k-instruct|4k|128k-instruct|128k)$", "", name)
    name = re.sub(r"-(instruct|chat|it)$", "", name)
    return name


def catalogue_match(ref: str) -> str | None:
    names = catalogue_names()
    if ref in names:
        return ref
    norm = _normalise(ref)
    if norm in names:
        return norm
    if norm.startswith("phi-3-mini"):
        return "phi-3-mini"
    return None


def _config_from_dict(data: dict, source: str):
    from transformers import AutoConfig

    model_type = data.get("model_type")
    if not model_type:
        raise LisaftError(f"{source}: config.json has no model_type")
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as e:
        raise LisaftError(f"{source}: not a usable config.json: {e}") from None


def load_json_config(path: Path, source: str):
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LisaftError(f"{source}: cannot read {path.name}: {e}") from None
    if not isinstance(data, dict):
        raise LisaftError(f"{source}: {path.name} is not a JSON object")
    return _config_from_dict(data, source)


def resolve_model(ref: str, key: str = "--model"):
    """(config, label) for a catalogue name, a folder holding config.json, a config.json file,
    or a hub id (needs network). Local paths win over catalogue names; a path that does not
    exist but names a catalogue model (a recipe's placeholder path) uses the catalogue."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LisaftError(f"{key}: {ref}: folder has no config.json")
        return load_json_config(path / "config.json", f"{key} {ref}"), path.name
    if path.is_file():
        label = path.resolve().parent.name if path.name == "config.json" else path.stem
        return load_json_config(path, f"{key} {ref}"), label
    name = catalogue_match(ref)
    if name is not None:
        return load_json_config(CATALOGUE_DIR / f"{name}.json", f"catalogue {name}"), name
    looks_local = ref.startswith((".", "/", "~")) or ref.count("/") > 1
    known = ", ".join(catalogue_names())
    if looks_local:
        raise LisaftError(f"{key}: {ref}: no such folder or config.json (catalogue names: {known})")
    from transformers import AutoConfig

    from lisaft.config.hub import hub_offline

    if hub_offline():
        raise LisaftError(f"{key}: {ref!r} is not a catalogue name or a local folder, and the hub cannot "
                          f"be reached from here (offline); catalogue names: {known}")
    try:
        return AutoConfig.from_pretrained(ref), ref
    except Exception as e:  # offline, no such repository, gated: all the same to the user
        first = first_line(e)
        raise LisaftError(
            f"{key}: {ref!r} is not a catalogue name, a local folder or a reachable hub id "
            f"({first}); catalogue names: {known}"
        ) from None
