"""Recipe keys a run will not use, said when the run starts rather than dropped without a word
(as data.eval_fraction next to data.eval already is, in lisaft.data.examples)."""

from __future__ import annotations

from lisaft.config.schema import Recipe


def unused_keys(recipe: Recipe) -> list[str]:
    """One sentence per key that is set but has no effect on this run."""
    t, d = recipe.training, recipe.data
    notes = []
    if t.epochs is not None and t.max_steps is not None:
        notes.append(f"training.epochs ({t.epochs:g}) is ignored: training.max_steps ({t.max_steps}) is set "
                     "too, and counts; remove one of them")
    if t.eval_every and d.eval is None and not d.eval_fraction:
        notes.append(f"training.eval_every ({t.eval_every}) is ignored: there is no eval set (data.eval is "
                     "null and data.eval_fraction 0), so the run evaluates nothing")
    return notes
