"""What `lisaft generate` is pointed at: a run (its final/ model), a Hugging Face model folder, or
one of a run's checkpoints; the data section whose columns, roles and template its prompts follow;
and loading its model and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lisaft.config.schema import DataSection, Recipe
from lisaft.console import first_line
from lisaft.errors import LisaftError

_CHECKPOINTS = "checkpoints"  # lisaft.checkpoint.checkpointer.CHECKPOINTS, without importing torch to parse a path


@dataclass
class Target:
    model_dir: Path  # a Hugging Face folder, or a checkpoint folder when `checkpoint_recipe` is set
    format: str
    source: str  # where the format came from, for the header line
    data: DataSection | None = None  # the run's data section: columns, roles, template
    checkpoint_recipe: Recipe | None = None  # the recipe a checkpoint's model is built from


def resolve_target(path: Path, fmt: str | None) -> Target:
    """RUN (uses RUN/final and RUN/recipe.yaml), RUN/final, RUN/checkpoints/step-N, or any Hugging
    Face model folder."""
    from lisaft.data.formats import FORMATS

    path = Path(path)
    if fmt is not None and fmt not in FORMATS:
        raise LisaftError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if _is_checkpoint(path):
        return _checkpoint_target(path, fmt)
    if not path.exists():
        raise LisaftError(f"{path}: no such run or model folder")
    if path.name == _CHECKPOINTS and (path.parent / "recipe.yaml").is_file():
        raise LisaftError(f"{path}: give one checkpoint folder in it; {_checkpoints_there(path.parent)}")
    run_dir = path if (path / "recipe.yaml").is_file() else path.parent
    model_dir = path / "final" if path == run_dir else path
    if not (model_dir / "config.json").is_file() and not (model_dir / "adapter_config.json").is_file():
        what = ("the run has no final/ model yet; it is written when the run completes"
                + _newest_checkpoint_hint(run_dir)
                if path == run_dir else "not a model folder (no config.json)")
        raise LisaftError(f"{model_dir}: {what}")
    recipe_file = run_dir / "recipe.yaml"
    recipe = None
    if recipe_file.is_file():
        from lisaft.config.schema import load_recipe

        recipe = load_recipe(recipe_file, resolve_paths=False)
    return _target(model_dir, fmt, recipe, f"{recipe_file}: data.format")


def _target(model_dir: Path, fmt: str | None, recipe: Recipe | None, source: str,
            checkpoint: bool = False) -> Target:
    built_from = recipe if checkpoint else None
    data = recipe.data if recipe is not None else None
    if fmt is not None:
        return Target(model_dir, fmt, "--format", data, built_from)
    if recipe is None:
        raise LisaftError(f"{model_dir}: no recipe.yaml beside it to say how prompts were formatted; "
                          "pass --format instruction|chat|text")
    return Target(model_dir, recipe.data.format, source, data, built_from)


def _is_checkpoint(path: Path) -> bool:
    """A folder in a run's checkpoints/ (existing or not, so a wrong step gets the list), or a
    checkpoint folder moved elsewhere."""
    in_run = path.parent.name == _CHECKPOINTS and (path.parent.parent / "recipe.yaml").is_file()
    from lisaft.checkpoint.components import STATE_FILE
    from lisaft.checkpoint.run_state import recipe_file

    return in_run or ((path / STATE_FILE).is_file() and recipe_file(path).is_file())


def _checkpoint_names(run_dir: Path) -> list[str]:
    from lisaft.checkpoint.checkpointer import complete_checkpoints

    return [c.name for c in reversed(complete_checkpoints(run_dir, warn=lambda _: None))]


def _newest_checkpoint_hint(run_dir: Path) -> str:
    names = _checkpoint_names(run_dir)
    return f"; try its newest checkpoint: lisaft generate {run_dir / _CHECKPOINTS / names[-1]}" if names else ""


def _checkpoints_there(run_dir: Path) -> str:
    names = _checkpoint_names(run_dir)
    if not names:
        return "the run has no complete checkpoint"
    return "complete checkpoints of the run: " + ", ".join(names[-5:]) + (" (newest last)" if len(names) > 1 else "")


def _checkpoint_target(ckpt: Path, fmt: str | None) -> Target:
    run_dir = ckpt.parent.parent
    if not ckpt.is_dir():
        raise LisaftError(f"{ckpt}: no such checkpoint; {_checkpoints_there(run_dir)}")
    from lisaft.checkpoint.checkpointer import is_complete

    complete, why = is_complete(ckpt)
    if not complete:
        raise LisaftError(f"{ckpt}: an incomplete checkpoint ({why}); {_checkpoints_there(run_dir)}")
    from lisaft.checkpoint.run_state import recipe_file, saved_recipe

    try:
        recipe = saved_recipe(ckpt)
    except (OSError, ValueError) as e:
        raise LisaftError(f"{recipe_file(ckpt)}: cannot read the recipe the checkpoint was trained with: "
                          f"{first_line(e)}") from None
    return _target(ckpt, fmt, recipe, f"{recipe_file(ckpt)}: data.format", checkpoint=True)


def load_tokenizer(target: Target):
    """A checkpoint's tokenizer is the one its run trained with (final/ holds a copy of it)."""
    if target.checkpoint_recipe is not None:
        from lisaft.model.load import load_tokenizer as run_tokenizer

        return _from_recipe(target, lambda: run_tokenizer(target.checkpoint_recipe.model))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target.model_dir)
    except (OSError, ValueError) as e:
        raise LisaftError(f"{target.model_dir}: cannot load the tokenizer: {first_line(e)}") from None


def load_model(target: Target):
    """The model in eval mode, on the GPU when there is one."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if target.checkpoint_recipe is not None:
        model = _checkpoint_model(target, device)
    elif (target.model_dir / "adapter_config.json").is_file():
        from lisaft.model.lora import load_adapter_folder

        model = load_adapter_folder(target.model_dir)  # lora.export: adapter
    else:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype="auto")
        except (OSError, ValueError) as e:
            raise LisaftError(f"{target.model_dir}: cannot load the model: {first_line(e)}") from None
    return model.to(device).eval()


def _checkpoint_model(target: Target, device):
    """Built as training built it (lisaft/model/load.py), then the checkpoint's weights read in."""
    # The checkpoint module's own reader of weights/ (or a training.fsdp run's shards/), the one
    # resume uses, so the two cannot drift apart.
    from lisaft.checkpoint.checkpointer import load_weights
    from lisaft.model.load import load_model as run_model

    recipe = target.checkpoint_recipe
    assert recipe is not None, "a checkpoint target carries the recipe it was trained with"
    section = recipe.model
    # Training's memory savers change nothing a forward computes; FlashAttention where it can run
    # here, else sdpa: the same attention.
    section = section.model_copy(update={
        "gradient_checkpointing": False, "offload_activations": False, "mlp_chunk_tokens": None,
        "attention": "auto" if section.attention == "flash_attention_2" else section.attention})
    model = _from_recipe(target, lambda: run_model(section, device, seed=recipe.training.seed))
    from safetensors import SafetensorError

    try:
        if recipe.lora.enabled:  # the base from its recipe, the adapters from the checkpoint
            from lisaft.checkpoint.adapters import read_adapters
            from lisaft.model.lora import attach_adapters

            read_adapters(target.model_dir, model, _from_recipe(target, lambda: attach_adapters(model, recipe)))
        else:
            load_weights(target.model_dir, model)
    except (OSError, RuntimeError, ValueError, LisaftError, SafetensorError) as e:
        raise LisaftError(f"{target.model_dir}: cannot read its weights into the model its recipe.json "
                          f"builds: {first_line(e)}") from None
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = True  # training turns the cache off; generation wants it
    return model


def _from_recipe(target: Target, load):
    try:
        return load()
    except LisaftError as e:  # it names a recipe key: say which recipe
        raise LisaftError(f"{target.model_dir / 'recipe.json'}: {e}") from None
