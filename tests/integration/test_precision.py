"""bfloat16 weights at fine-tuning learning rates: with stochastic rounding (the default) the run
learns as the float32 run does; with round-to-nearest most updates are lost. This is why the
default exists."""

import pytest
import torch

from lisaft.config.schema import load_recipe
from lisaft.train import build_session, train_step
from lisaft.train.evaluate import evaluate


def _loss_drop(tiny_run, dtype: str, name: str, rounding: str, steps: int = 30) -> float:
    path = tiny_run(f"{dtype}-{name}-{rounding}.yaml",
                    model={"dtype": dtype},
                    optimizer={"name": name, "lr": 2e-5, "bf16_update": rounding},
                    scheduler={"name": "constant", "warmup_steps": 0},
                    lisa={"enabled": False},
                    training={"max_steps": steps, "eval_batches": 4})
    recipe = load_recipe(path)
    session = build_session(recipe, tiny_run.dir / f"run-{dtype}-{name}-{rounding}")
    before = evaluate(session)["eval_loss"]
    for step in range(steps):
        train_step(session, step)
    return before - evaluate(session)["eval_loss"]


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
def test_bf16_keeps_the_float32_loss_decrease_only_with_stochastic_rounding(tiny_run, name):
    reference = _loss_drop(tiny_run, "float32", name, "stochastic")
    assert reference > 0
    stochastic = _loss_drop(tiny_run, "bfloat16", name, "stochastic")
    nearest = _loss_drop(tiny_run, "bfloat16", name, "nearest")
    assert stochastic >= 0.9 * reference, (stochastic, reference)
    assert nearest < 0.6 * reference, (nearest, reference)


def test_sparse_embedding_gradient_trains_as_the_dense_one(tiny_run):
    # 1 x 32 tokens a step against a 110-token vocabulary: the sparse gradient is the smaller.
    runs = {}
    for sparse in (True, False):
        path = tiny_run(f"sparse-{sparse}.yaml", model={"sparse_embedding_grad": sparse},
                        lisa={"enabled": False}, training={"batch_size": 1, "max_steps": 6})
        session = build_session(load_recipe(path), tiny_run.dir / f"run-{sparse}")
        emb = session.model.get_input_embeddings()
        assert emb.sparse is sparse
        results = [train_step(session, step) for step in range(6)]
        runs[sparse] = ([r.loss for r in results], emb.weight.detach().clone(), max(r.grad_bytes for r in results))
    (ls, ws, gs), (ld, wd, gd) = runs[True], runs[False]
    assert ls == pytest.approx(ld, rel=1e-5)
    assert torch.allclose(ws, wd, atol=1e-6)
    assert gd - gs > 0.5 * wd.numel() * 4  # the dense vocab x hidden gradient is gone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_last_step_moves_the_weights(tiny_run, dtype):
    """A decay to min_lr_ratio 0 used to end on a step at LR 0: a whole forward and backward for
    no update. Now the floor comes one step after the last, in float32 and bfloat16 alike."""
    path = tiny_run(f"last-{dtype}.yaml", model={"dtype": dtype},
                    scheduler={"name": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.0},
                    lisa={"enabled": False}, training={"max_steps": 2, "max_grad_norm": None})
    session = build_session(load_recipe(path), tiny_run.dir / f"run-last-{dtype}")
    train_step(session, 0)
    before = [p.detach().clone() for p in session.model.parameters()]
    last = train_step(session, 1)
    assert last.lr > 0
    moved = sum(not torch.equal(b, p) for b, p in zip(before, session.model.parameters()))
    assert moved >= len(before) // 2, (moved, len(before))
