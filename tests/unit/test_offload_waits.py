"""optimizer.cpu_offload with overlap: nothing reads the weights while a CPU step may still be
copying them back. Eval waits for every step in flight; training.compile compiles the layers only
after the forward's waiters are hooked (dynamo skips a hook added after a layer was traced, and
DPO's reference pass, with reference: null, is the model's first forward)."""

from __future__ import annotations

import torch

from lisaft.config.schema import recipe_from_dict
from lisaft.train import build_session, loop


class _Order:
    def __init__(self):
        self.calls: list[str] = []

    def wait(self):
        self.calls.append("wait")


class _Session:
    def __init__(self, order: _Order):
        self.optimizers = order
        self.progress = type("P", (), {"step": 3})()


def test_eval_waits_for_the_cpu_steps_in_flight(monkeypatch):
    order = _Order()
    monkeypatch.setattr(loop, "evaluate", lambda session: order.calls.append("evaluate") or {"eval_loss": 1.0})
    written = []
    metrics = type("M", (), {"write": lambda self, rec: written.append(rec)})()
    display = type("D", (), {"eval": lambda self, rec: None})()
    loop._evaluate(_Session(order), metrics, display)
    assert order.calls == ["wait", "evaluate"] and written == [{"step": 3, "eval_loss": 1.0}]


class _PadOnly:
    pad_token_id = 0


def test_layers_are_compiled_after_the_waiters_are_hooked(tmp_path, tiny_llama_config, monkeypatch):
    import lisaft.model.load as load

    hooked: list[list[int]] = []
    monkeypatch.setattr(load, "compile_layers",
                        lambda layers, device: hooked.append([len(la._forward_pre_hooks) for la in layers]))
    tiny_llama_config.save_pretrained(tmp_path / "model")
    recipe = recipe_from_dict({
        "model": {"config": str(tmp_path / "model"), "tokenizer": "unused", "dtype": "float32", "attention": "sdpa"},
        "data": {"train": "unused", "max_seq_len": 16},
        "optimizer": {"name": "adamw_32bit", "lr": 1e-3, "cpu_offload": True},
        "training": {"seed": 3, "batch_size": 2, "max_steps": 2, "output_dir": str(tmp_path / "run"),
                     "device": "cpu", "compile": True},
    })
    g = torch.Generator().manual_seed(7)
    examples = [{"input_ids": r, "labels": list(r)} for r in torch.randint(3, 64, (8, 12), generator=g).tolist()]
    build_session(recipe, tmp_path / "run", tokenizer=_PadOnly(), train_examples=examples, eval_examples=None)
    assert len(hooked) == 1 and all(n >= 1 for n in hooked[0]), hooked
