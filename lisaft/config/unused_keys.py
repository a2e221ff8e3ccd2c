"""Recipe keys a run will not use, said when the run starts rather than dropped without a word
(as data.eval_fraction next to data.eval already is, in lisaft.data.examples)."""

from __future__ import annotations

from lisaft.config.optimizers import names_where, optimizer_kind
from lisaft.config.preference_losses import PREFERENCE_LOSSES, preference_loss
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
    o = recipe.optimizer
    if not optimizer_kind(o.name).projected:
        keys = [k for k, v in (("rank", o.rank), ("scale", o.scale), ("scale_type", o.scale_type)) if v is not None]
        keys += ["update_proj_gap"] if o.update_proj_gap != 200 else []
        if keys:
            verb = "is" if len(keys) == 1 else "are"
            notes.append(", ".join(f"optimizer.{k}" for k in keys) + f" {verb} ignored: only "
                         f"{' and '.join(names_where(lambda k: k.projected))} read them (optimizer.name is {o.name})")
    p = recipe.preference
    if p is not None:
        for key in ("gamma", "desirable_weight", "undesirable_weight"):
            value, default = getattr(p, key), type(p).model_fields[key].default
            if key not in preference_loss(p.loss).keys and value != default:
                readers = " and ".join(n for n in PREFERENCE_LOSSES if key in preference_loss(n).keys)
                notes.append(f"preference.{key} ({value:g}) is ignored: only {readers} reads it and "
                             f"preference.loss is {p.loss}")
    return notes
