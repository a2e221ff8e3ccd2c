"""model.offload_activations: checkpointed layer inputs held in host memory give the same loss
and gradients as plain checkpointing, bit for bit, and reach LISA's frozen-input layers."""

import pytest
import torch

from lisaft.model.activation_offload import HostActivationStore, enable_offloaded_checkpoints
from tests.unit._tiny import tiny


def _checkpointed(offload: bool, freeze_below: int | None = None):
    model = tiny(seed=1)
    model.config.use_cache = False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if freeze_below is not None:  # LISA-like: embeddings and lower layers frozen
        for p in model.model.embed_tokens.parameters():
            p.requires_grad_(False)
        for layer in model.model.layers[:freeze_below]:
            for p in layer.parameters():
                p.requires_grad_(False)
    if offload:
        enable_offloaded_checkpoints(model.model.layers, torch.device("cpu"))
    return model


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("freeze_below", [None, 2])
def test_offloaded_checkpoints_are_bit_exact(freeze_below):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    ref_loss, ref = _loss_and_grads(_checkpointed(False, freeze_below), ids)
    loss, grads = _loss_and_grads(_checkpointed(True, freeze_below), ids)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys() and len(grads) > 0
    for name in ref:
        assert torch.equal(grads[name], ref[name]), name
    if freeze_below is not None:
        # the bottom trainable layer's input needs no gradient, its weights still get one
        assert any(n.startswith("model.layers.2.") for n in grads)
        assert not any(n.startswith("model.layers.1.") for n in grads)


def test_layer_inputs_go_through_the_store_and_are_released(monkeypatch):
    model = _checkpointed(True)
    puts, takes = [], []
    orig_put, orig_take = HostActivationStore.put, HostActivationStore.take

    def put(self, t):
        slot = orig_put(self, t)
        puts.append(slot)
        return slot

    def take(self, slot):
        takes.append(slot)
        return orig_take(self, slot)

    monkeypatch.setattr(HostActivationStore, "put", put)
    monkeypatch.setattr(HostActivationStore, "take", take)
    ids = torch.randint(0, 128, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(puts) == 4 and takes == puts[::-1]  # backward visits layers top down
    assert all(slot.host is None for slot in puts)  # nothing left behind after backward


def test_slots_are_freed_with_their_graph(monkeypatch):
    """Each slot (its host copy, its event) lives as long as the graph that owns it: after a
    backward, and after a grad-enabled forward whose output is dropped without one."""
    import gc
    import weakref

    model = _checkpointed(True)
    slots: list[weakref.ref] = []
    orig_put = HostActivationStore.put

    def put(self, t):
        slot = orig_put(self, t)
        slots.append(weakref.ref(slot))
        return slot

    monkeypatch.setattr(HostActivationStore, "put", put)
    ids = torch.randint(0, 128, (1, 16))
    for backward in (True, False, True):
        loss = model(input_ids=ids, labels=ids).loss
        if backward:
            loss.backward()
        del loss
        gc.collect()
        assert len(slots) == 4 and all(ref() is None for ref in slots), backward
        slots.clear()


def test_no_offload_without_checkpointing():
    model = tiny()
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        enable_offloaded_checkpoints(model.model.layers, torch.device("cpu"))


def test_recipe_key_needs_checkpointing_and_load_model_applies_it(tiny_llama_config, tmp_path):
    from lisaft.config.schema import ModelSection, recipe_from_dict
    from lisaft.errors import LisaftError
    from lisaft.model.load import load_model

    tiny_llama_config.save_pretrained(tmp_path)
    tiny_llama_config = tmp_path / "config.json"
    with pytest.raises(LisaftError, match="model.offload_activations offloads checkpointed layer inputs: set "
                       "model.gradient_checkpointing: true as well"):
        recipe_from_dict({"model": {"config": str(tiny_llama_config), "tokenizer": "x", "offload_activations": True},
                          "data": {"train": "t.jsonl"}, "training": {"max_steps": 1, "output_dir": "r"}})
    section = ModelSection(config=str(tiny_llama_config), tokenizer="x", dtype="float32",
                           attention="sdpa", gradient_checkpointing=True, offload_activations=True)
    model = load_model(section, torch.device("cpu"))
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_chunked_mlp_matches_and_composes_with_offload():
    from lisaft.model.activation_offload import chunk_mlps

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    ref_loss, ref = _loss_and_grads(_checkpointed(False), ids)
    plain = _checkpointed(False)
    chunk_mlps(plain.model.layers, 5)  # 24 positions: chunks of 5, 5, 5, 5, 4
    loss, grads = _loss_and_grads(plain, ids)
    torch.testing.assert_close(loss, ref_loss)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-6)
    both = _checkpointed(True)
    chunk_mlps(both.model.layers, 5)
    loss2, grads2 = _loss_and_grads(both, ids)
    assert torch.equal(loss2, loss) and all(torch.equal(grads2[n], grads[n]) for n in grads)
