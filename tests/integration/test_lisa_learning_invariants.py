"""What LISA must do to the weights, checked through lisaft's own loop (build_session, train_step)
on CPU float32: with every decoder layer active it is full fine-tuning bit for bit; a layer that
is never sampled keeps its initial weights bit for bit, and every layer that is sampled trains
(LMFlow #726 froze later-sampled layers for good)."""

import torch

from lisaft.config.schema import recipe_from_dict
from lisaft.lisa import LayerSampler
from lisaft.train import build_session, train_step

N_LAYERS, K = 4, 2


class _PadOnly:
    pad_token_id = 0


def _session(tmp_path, name, config_dir, lisa: dict | None, steps: int, seed: int):
    recipe = recipe_from_dict({
        "model": {"config": str(config_dir), "tokenizer": "unused", "dtype": "float32", "attention": "sdpa"},
        "data": {"train": "unused", "max_seq_len": 16},
        "optimizer": {"name": "adamw_32bit", "lr": 1e-3},
        "scheduler": {"name": "cosine", "warmup_steps": 1},
        "lisa": {"enabled": lisa is not None, "interval_steps": K, **(lisa or {})},
        "training": {"seed": seed, "batch_size": 4, "max_steps": steps, "max_grad_norm": 1.0,
                     "output_dir": str(tmp_path / name), "device": "cpu"},
    })
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(3, 64, (32, 16), generator=g).tolist()
    examples = [{"input_ids": r, "labels": list(r)} for r in rows]
    return build_session(recipe, tmp_path / name, tokenizer=_PadOnly(), train_examples=examples,
                         eval_examples=None)


def _train(session, steps: int) -> None:
    for step in range(steps):
        train_step(session, step)


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(tmp_path, tiny_llama_config):
    tiny_llama_config.num_hidden_layers = N_LAYERS
    tiny_llama_config.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_lisa_with_every_layer_active_is_full_fine_tuning(tmp_path, tiny_llama_config):
    cfg = _config(tmp_path, tiny_llama_config)
    steps = 3 * K + 1  # crosses interval boundaries, where LISA re-samples (the same full set)
    full = _session(tmp_path, "full", cfg, None, steps, seed=3)
    lisa = _session(tmp_path, "lisa", cfg, {"active_layers": N_LAYERS, "state_policy": "discard"}, steps, seed=3)
    before = _weights(full.model)
    _train(full, steps)
    _train(lisa, steps)
    a, b = _weights(full.model), _weights(lisa.model)
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], before[name]), f"{name} did not train"
        assert torch.equal(a[name], b[name]), f"{name}: LISA with all layers active differs from full FT"


def _seed_leaving_a_layer_out(intervals: int) -> tuple[int, set[int]]:
    """A seed whose first `intervals` draws of γ=1 visit at least two layers but not all of them."""
    for seed in range(1000):
        sampler = LayerSampler(N_LAYERS, 1, seed)
        visited = {i for k in range(intervals) for i in sampler.active_set(k)}
        if 2 <= len(visited) < N_LAYERS:
            return seed, visited
    raise AssertionError("no such seed below 1000")


def test_unsampled_layer_is_untouched_and_every_sampled_layer_trains(tmp_path, tiny_llama_config):
    cfg = _config(tmp_path, tiny_llama_config)
    intervals = 3
    seed, visited = _seed_leaving_a_layer_out(intervals)
    session = _session(tmp_path, "lisa", cfg, {"active_layers": 1, "state_policy": "discard"}, intervals * K,
                       seed=seed)
    layers = list(session.parts.layers)
    before = [{n: p.detach().clone() for n, p in layer.named_parameters()} for layer in layers]
    _train(session, intervals * K)
    for i, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            if i in visited:
                assert not torch.equal(p, before[i][n]), f"sampled layer {i}: {n} did not train"
            else:
                assert torch.equal(p, before[i][n]), f"never-sampled layer {i}: {n} changed"
