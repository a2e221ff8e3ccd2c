"""What `lisaft resume` says when there is nothing it can resume: each case in its own words,
since each has its own fix (a typo in the path, a recipe given for its run, a run already done)."""

from __future__ import annotations

from pathlib import Path

from lisaft.errors import LisaftError

RECIPE_SUFFIXES = (".yaml", ".yml")


def _recipe_output_dir(path: Path) -> str | None:
    from lisaft.config.schema import load_recipe

    try:
        return load_recipe(path).training.output_dir
    except LisaftError:
        return None


def run_recipe_file(run_dir: Path) -> Path:
    """RUN_DIR/recipe.yaml, or an error that says what RUN_DIR is instead."""
    if not run_dir.exists():
        raise LisaftError(f"{run_dir}: no such folder; resume takes the run folder that `lisaft train` "
                          "wrote (the recipe's training.output_dir)")
    if run_dir.is_file():
        if run_dir.suffix.lower() in RECIPE_SUFFIXES:
            out = _recipe_output_dir(run_dir)
            where = f": `lisaft resume {out}`" if out else " (its training.output_dir)"
            raise LisaftError(f"{run_dir} is a recipe file; resume takes the run folder it trains into{where}")
        raise LisaftError(f"{run_dir} is a file; resume takes the run folder that `lisaft train` wrote")
    recipe_file = run_dir / "recipe.yaml"
    inside = next((p for p in run_dir.parents if (p / "recipe.yaml").is_file()), None)
    if not recipe_file.is_file() and inside is not None and (inside / "checkpoints").is_dir():
        what = "exported model" if run_dir.name == "final" else "folder"
        raise LisaftError(f"{run_dir} is the run's {what}, not the run; resume takes the run folder: "
                          f"`lisaft resume {inside}`")
    if not recipe_file.is_file():
        runs = sorted(p.name for p in run_dir.iterdir() if (p / "recipe.yaml").is_file()) if run_dir.is_dir() else []
        hint = f"; runs in it: {', '.join(runs[:5])}" if runs else ""
        raise LisaftError(f"{run_dir}: not a lisaft run (no recipe.yaml in it){hint}")
    return recipe_file


def nothing_left(run_dir: Path, step: int, max_steps: int | None,
                 max_steps_given: int | None) -> LisaftError | None:
    """The error when the newest checkpoint is already at or past where the resume would stop
    (not known before set-up for a run whose length is training.epochs: max_steps None)."""
    if max_steps is None or step < max_steps:
        return None
    if max_steps_given is not None:
        return LisaftError(f"--max-steps {max_steps_given} is not past the newest checkpoint, at step {step}; "
                           f"give a larger N to train further")
    return LisaftError(f"{run_dir}: the run is complete at step {step} of {max_steps}; pass --max-steps N "
                       f"(N > {step}) to train further")
