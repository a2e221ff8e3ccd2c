"""One host read of the device per optimizer step (lisaft/train/step.py): the loss sums, token
counts and gradient norm stay on the device until the step ends, so on CUDA the device never
idles while the host waits for a micro-batch's loss. On CPU the reads are counted: every
scalar read (`item`, `float`, `int`, `bool` of a tensor go through aten._local_scalar_dense) and
every `tolist`. With training.on_nonfinite: skip the norm is read once more, before the update
it decides on (not tested here: it is the documented exception)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lisaft.config.schema import recipe_from_dict
from lisaft.train import build_session, train_step
from lisaft.train.step import StepTotals


class _PadOnly:
    pad_token_id = 0


class _Reads(TorchDispatchMode):
    """Scalar reads outside the model's forward: transformers' own (its padded-sdpa mask checks
    read the padding mask) are the model's, not the step's."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.scalars, self.in_model = 0, False
        self.hooks = [model.register_forward_pre_hook(lambda m, a: setattr(self, "in_model", True)),
                      model.register_forward_hook(lambda m, a, o: setattr(self, "in_model", False))]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.in_model:
            self.scalars += 1
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)


def _session(tmp_path, tiny_llama_config, **settings):
    tiny_llama_config.save_pretrained(tmp_path / "model")
    recipe = recipe_from_dict({
        "model": {"config": str(tmp_path / "model"), "tokenizer": "unused", "dtype": "float32", "attention": "sdpa"},
        "data": {"train": "unused", "max_seq_len": 16},
        "optimizer": {"name": "adamw_32bit", "lr": 1e-3, **settings.pop("optimizer", {})},
        "training": {"seed": 3, "batch_size": 2, "grad_accum_steps": 4, "max_steps": 4, "max_grad_norm": 0.5,
                     "output_dir": str(tmp_path / "run"), "device": "cpu", **settings},
    })
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, 64, (int(n),), generator=g).tolist() for n in torch.randint(4, 16, (32,), generator=g)]
    examples = [{"input_ids": r, "labels": list(r)} for r in rows]
    return build_session(recipe, tmp_path / "run", tokenizer=_PadOnly(), train_examples=examples, eval_examples=None)


def _reads(monkeypatch, session, step: int, forward=None):
    lists = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: lists.append(t.numel()) or tolist(t))
    kwargs = {"forward": forward} if forward is not None else {}
    with _Reads(session.model) as reads:
        result = train_step(session, step, **kwargs)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return result, reads.scalars, lists


IN_BACKWARD = {"max_grad_norm": None, "grad_accum_steps": 1, "optimizer": {"in_backward": True}}


@pytest.mark.parametrize("settings", [{}, IN_BACKWARD], ids=["clipped", "in-backward"])
def test_one_host_read_per_step(tmp_path, tiny_llama_config, monkeypatch, settings):
    session = _session(tmp_path, tiny_llama_config, **settings)
    for step in range(2):
        result, scalars, lists = _reads(monkeypatch, session, step)
        assert scalars == 0 and len(lists) == 1, (scalars, lists)
        assert result.grad_norm is not None and result.grad_norm > 0 and result.loss > 0
        assert result.tokens > 0 and result.padding >= 0


def test_the_loss_is_the_micro_batches_sum_over_the_global_label_tokens(tmp_path, tiny_llama_config, monkeypatch):
    from lisaft.model.loss import token_loss_sum

    session = _session(tmp_path, tiny_llama_config)
    seen = []

    def forward(model, batch):
        loss = token_loss_sum(model, batch)
        seen.append((float(loss), int((batch["labels"][:, 1:] != -100).sum())))
        return loss

    result = train_step(session, 0, forward=forward)
    assert len(seen) == 4
    assert result.loss == sum(loss for loss, _ in seen) / sum(n for _, n in seen)


def test_totals_sum_in_float64_and_leave_out_what_was_not_measured():
    totals = StepTotals(torch.device("cpu"))
    losses = [torch.tensor(x, dtype=torch.float32) for x in (0.1, 0.2, 0.3)]
    for loss in losses:
        totals.add("loss", loss)
    read = totals.read({"grad_norm": None, "tokens": torch.tensor(3.0)})
    # The host's own float64 sum of the float32 losses, as the step summed them before.
    assert read == {"loss": float(losses[0]) + float(losses[1]) + float(losses[2]), "tokens": 3.0}


SPARSE = {"batch_size": 1, "grad_accum_steps": 1, "optimizer": {"name": "adamw_8bit"}}


def test_sparse_embedding_gradients_add_their_documented_reads(tmp_path, tiny_llama_config, monkeypatch):
    """The exception train_step's docstring names: a sparse embedding gradient (a vocabulary larger
    than the step's tokens) is stepped by chunks of whole rows, found with one `tolist` of the
    chunk bounds per step; on CUDA its `coalesce` syncs as well, which a CPU cannot count."""
    session = _session(tmp_path, tiny_llama_config, **SPARSE)
    assert session.model.get_input_embeddings().sparse
    for step in range(2):
        _, scalars, lists = _reads(monkeypatch, session, step)
        assert scalars == 0 and len(lists) == 2, (scalars, lists)
