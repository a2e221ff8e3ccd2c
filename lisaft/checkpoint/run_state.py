"""The components of a checkpoint that belong to no other layer: the random generators and the
recipe the run trained with, and what the resume policy reads of a checkpoint before set-up."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from lisaft.checkpoint.components import read_components
from lisaft.config.schema import Recipe, recipe_from_dict

RECIPE = "recipe"  # its component's name, hence RUN/checkpoints/step-N/recipe.json


class RngState:
    """Python, numpy, torch CPU and CUDA generator states of this process (stored per rank)."""

    def state_dict(self) -> dict:
        py = random.getstate()
        np_state = np.random.get_state()
        state = {
            "python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        n = state["numpy"]
        np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class RecipeRecord:
    """The resolved recipe the run trains with. Loading it changes nothing: what a resume may
    change decides the set-up, so the resume policy compares it first (saved_recipe)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def state_dict(self) -> dict:
        return self.recipe.model_dump(mode="json")

    def load_state_dict(self, sd: dict) -> None:
        pass  # compared before set-up (lisaft/train/resume.py recipe_changes)


def recipe_file(ckpt: Path) -> Path:
    return ckpt / f"{RECIPE}.json"


def saved_recipe(ckpt: Path) -> Recipe:
    """The recipe a checkpoint was trained with. Raises OSError or ValueError when unreadable,
    LisaftError when it does not validate."""
    path = recipe_file(ckpt)
    return recipe_from_dict(json.loads(path.read_text()), str(path))


def saved_world_size(ckpt: Path) -> int:
    """How many processes wrote the checkpoint (its progress component)."""
    return int(read_components(ckpt).get("progress", {}).get("world_size", 1))
