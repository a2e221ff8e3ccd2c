"""Evaluation: the objective's eval loss and figures (SFT: token accuracy) on data.eval."""

from __future__ import annotations

import torch

from lisaft.data.order import eval_index_batches
from lisaft.distributed import dist
from lisaft.train.session import Session


def eval_set(session: Session) -> list[dict]:
    """The examples evaluated: all of data.eval, or the first training.eval_batches global batches
    of it (batch_size x grad_accum_steps x ranks examples each, which a resume on another number of
    ranks keeps), so the same examples are scored however the ranks share them out."""
    examples = session.eval_examples or []
    t = session.recipe.training
    if t.eval_batches is None:
        return examples
    return examples[: t.eval_batches * t.batch_size * t.grad_accum_steps * dist.world_size()]


@torch.no_grad()
def evaluate(session: Session) -> dict:
    """The objective's eval record fields (eval_loss and its own), over ranks."""
    t = session.recipe.training
    batches = eval_index_batches(len(eval_set(session)), t.batch_size)
    mine, counted = session.parallel.eval_batches(batches)
    model = session.model
    model.eval()
    scores = session.objective.evaluate(model, session.eval_examples or [], mine, counted)
    model.train()
    return scores
