"""Evaluation: loss and teacher-forced token accuracy on the response tokens of data.eval."""

from __future__ import annotations

import torch

from lisaft.data.collate import collate, to_device
from lisaft.data.order import eval_index_batches
from lisaft.distributed import dist
from lisaft.model.attention import varlen_attention
from lisaft.train.preference import evaluate_pairs
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
    """eval_loss and teacher-forced argmax accuracy on response tokens, over ranks."""
    examples = session.eval_examples or []
    t = session.recipe.training
    batches = eval_index_batches(len(eval_set(session)), t.batch_size)
    mine, counted = session.parallel.eval_batches(batches)
    model = session.model
    model.eval()
    if session.objective is not None:  # pairs: the preference loss and the rewards
        scores = evaluate_pairs(session.objective, model, examples, mine, counted, session.tokenizer.pad_token_id,
                                session.device)
        model.train()
        return scores
    totals = torch.zeros(3, dtype=torch.float64)
    for n, idx in enumerate(mine):
        batch = collate([examples[i] for i in idx], session.tokenizer.pad_token_id, varlen_attention(model))
        batch = to_device(batch, session.device)
        loss_sum, n_tokens, n_correct = session.parallel.eval_sums(model, batch)
        if n < counted:
            totals += torch.tensor([loss_sum, n_tokens, n_correct], dtype=torch.float64)
    model.train()
    totals = dist.all_reduce_sum(totals.to(session.device)).cpu()
    tokens = max(totals[1].item(), 1.0)
    return {"eval_loss": totals[0].item() / tokens, "eval_token_accuracy": totals[2].item() / tokens}
