"""LISA: the sampler, switching, the state policies and their memory, on tiny Llamas on CPU.

The step loop here is deliberately the smallest one that exercises the controller; the trainer's
loop is tested elsewhere."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from _tiny import tiny as _tiny

from lisaft import optim
from lisaft.errors import LisaftError
from lisaft.lisa import LayerSampler, LisaController
from lisaft.models import model_parts
from lisaft.optim import build_optimizer
from lisaft.recipe import LisaSection, OptimizerSection

CPU = torch.device("cpu")
NAMES = ["adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit"]
POLICIES = ["discard", "offload_cpu", "offload_disk", "keep"]


def tiny(seed: int = 0, layers: int = 6):
    return _tiny(seed, layers)


def setup(tmp_path, name="adamw_32bit", in_backward=False, layers=6, seed=0, model_seed=0, **lisa):
    model = tiny(model_seed, layers)
    opt = build_optimizer(model, OptimizerSection(name=name, lr=1e-3, weight_decay=0.1,
                                                  in_backward=in_backward), CPU)
    sec = LisaSection(**{"enabled": True, "active_layers": 2, "interval_steps": 2, **lisa})
    ctrl = LisaController(model, model_parts(model), sec, opt, CPU, tmp_path / "offload", seed)
    return model, opt, ctrl


def run(model, opt, ctrl, start: int, stop: int, after_step=None) -> list[float]:
    losses = []
    for step in range(start, stop):
        ctrl.activate_for_step(step)
        x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if after_step:
            after_step(step)
    return losses


def reentering(sampler: LayerSampler, first: int, last: int) -> set[int]:
    """Layers that come back in intervals first..last after having left the active set: only
    these show whether offloaded moments really return."""
    back, had, prev = set(), set(), set(sampler.active_set(0))
    for k in range(1, last + 1):
        now = set(sampler.active_set(k))
        if k >= first:
            back |= (now - prev) & had
        had |= prev
        prev = now
    return back


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_weights(a, b):
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), n


def state_params(opt, model) -> set[str]:
    return {n for n, p in model.named_parameters() if optim.has_state(opt, p)}


def state_bytes_of(opt, params) -> list[int]:
    return [optim.state_nbytes(optim.holder(opt, p).state[p]) for p in params]


def trainable_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# -- sampler --------------------------------------------------------------------------------------


def test_sampler_is_a_pure_function_of_seed_and_interval():
    s = LayerSampler(8, 2, seed=0)
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    torch_before = torch.random.get_rng_state()
    # Pinned: the same layers on any machine and any numpy version keeping PCG64's stream.
    assert [s.active_set(i) for i in range(6)] == [[5, 7], [1, 6], [2, 3], [2, 6], [2, 3], [2, 7]]
    assert np.array_equal(np.random.get_state()[1], before)  # global RNGs untouched
    assert torch.equal(torch.random.get_rng_state(), torch_before)
    assert LayerSampler(8, 2, seed=0).active_set(1000) == s.active_set(1000)
    assert [LayerSampler(8, 2, seed=1).active_set(i) for i in range(6)] != [s.active_set(i) for i in range(6)]
    for i in range(200):
        a = s.active_set(i)
        assert a == sorted(set(a)) and len(a) == 2 and 0 <= a[0] and a[-1] < 8
    assert LayerSampler(5, 5, seed=3).active_set(7) == [0, 1, 2, 3, 4]
    assert LayerSampler(4, 1, seed=-1).active_set(0) == LayerSampler(4, 1, seed=-1).active_set(0)


def test_sampler_is_uniform_over_layers_and_pairs():
    n, gamma, intervals = 8, 2, 4000
    s = LayerSampler(n, gamma, seed=7)
    layer_counts = np.zeros(n)
    pair_counts = dict.fromkeys(itertools.combinations(range(n), gamma), 0)
    for i in range(intervals):
        a = s.active_set(i)
        layer_counts[a] += 1
        pair_counts[tuple(a)] += 1
    expected = intervals * gamma / n
    chi2_layers = ((layer_counts - expected) ** 2 / expected).sum()
    assert chi2_layers < 24.3  # 7 degrees of freedom, p = 0.001
    pairs = np.array(list(pair_counts.values()))
    e_pair = intervals / len(pairs)
    assert ((pairs - e_pair) ** 2 / e_pair).sum() < 55.5  # 27 degrees of freedom, p = 0.001


# -- switching ------------------------------------------------------------------------------------


def test_too_many_active_layers_is_a_clear_error(tmp_path):
    with pytest.raises(LisaftError, match=r"lisa\.active_layers.*4 decoder layers"):
        setup(tmp_path, layers=4, active_layers=5)


def test_disabled_trains_everything_with_the_same_statistics(tmp_path):
    model, opt, ctrl = setup(tmp_path, enabled=False, layers=4, active_layers=9)
    assert run(model, opt, ctrl, 0, 1)
    assert ctrl.activate_for_step(5) is False
    assert ctrl.active_layers == [0, 1, 2, 3]
    assert ctrl.trainable_params() == sum(p.numel() for p in model.parameters())
    assert ctrl.state_bytes() == (sum(8 * p.numel() + 4 for p in model.parameters()), 0)


def test_optimizer_updates_exactly_the_trainable_parameters(tmp_path):
    model, opt, ctrl = setup(tmp_path, active_layers=2, interval_steps=2)
    sampler = ctrl.sampler
    first = set(sampler.active_set(0))
    later = {i for k in range(1, 6) for i in sampler.active_set(k)}
    late = min(later - first)
    late_before = weights(model)
    seen_late_train = []

    prev = weights(model)

    def check(step):
        nonlocal prev
        now = weights(model)
        changed = {n for n in now if not torch.equal(now[n], prev[n])}
        assert changed == trainable_names(model), step
        assert {n for n, p in model.named_parameters() if p.grad is not None} == set()
        prev = now
        if late in ctrl.active_layers:
            seen_late_train.append(step)

    for step in range(12):
        switched = ctrl.activate_for_step(step)
        assert switched == (step % 2 == 0)
        names = trainable_names(model)
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(ctrl.active_layers) == set(sampler.active_set(step // 2))
        assert any(n.startswith("model.embed_tokens") for n in names) and "lm_head.weight" in names
        assert "model.norm.weight" in names
        assert not any(p.grad is not None for p in model.parameters() if not p.requires_grad)
        assert ctrl.trainable_params() == sum(p.numel() for p in ctrl.trainable_parameters())
        run(model, opt, ctrl, step, step + 1)
        assert ctrl.grad_bytes() == 0  # zero_grad(set_to_none) ran
        check(step)
    assert seen_late_train  # a layer frozen at the start did train once sampled
    late_now = model.model.layers[late].mlp.up_proj.weight
    assert not torch.equal(late_now, late_before[f"model.layers.{late}.mlp.up_proj.weight"])


def test_grad_bytes_are_the_trainable_gradients(tmp_path):
    model, opt, ctrl = setup(tmp_path)
    ctrl.activate_for_step(0)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x).loss.backward()
    assert ctrl.grad_bytes() == 4 * ctrl.trainable_params()


def test_moments_survive_for_always_trained_and_resampled_layers(tmp_path):
    # Find an interval whose set shares a layer with the next one (seed search is deterministic).
    def overlap(s):
        return set(LayerSampler(6, 2, s).active_set(0)) & set(LayerSampler(6, 2, s).active_set(1))

    seed = next(s for s in range(50) if overlap(s))
    model, opt, ctrl = setup(tmp_path, seed=seed, interval_steps=3, state_policy="discard")
    shared = sorted(set(ctrl.sampler.active_set(0)) & set(ctrl.sampler.active_set(1)))[0]
    run(model, opt, ctrl, 0, 6)
    st = lambda p: optim.holder(opt, p).state[p]  # noqa: E731
    assert st(model.model.embed_tokens.weight)["step"].item() == 6
    assert st(model.lm_head.weight)["step"].item() == 6
    assert st(model.model.norm.weight)["step"].item() == 6
    assert st(model.model.layers[shared].self_attn.q_proj.weight)["step"].item() == 6


@pytest.mark.parametrize("name,policy", [("adamw_32bit", "discard"), ("adamw_32bit", "offload_cpu"),
                                         ("adamw_32bit", "offload_disk"), ("adamw_8bit", "offload_disk")])
def test_device_state_stays_the_trainable_sets_over_50_intervals(tmp_path, name, policy):
    model, opt, ctrl = setup(tmp_path, name=name, layers=4, interval_steps=1, state_policy=policy)
    per_layer = {}
    ever = set()

    def check(step):
        assert state_params(opt, model) == trainable_names(model)
        resident, offloaded = ctrl.state_bytes()
        trainable_state = sum(state_bytes_of(opt, ctrl.trainable_parameters()))
        code_books = 2 * 256 * 4 if name == "adamw_8bit" else 0
        assert resident == trainable_state + code_books
        for i in ctrl.active_layers:
            per_layer[i] = sum(state_bytes_of(opt, model.model.layers[i].parameters()))
        ever.update(ctrl.active_layers)
        off = sum(per_layer[i] for i in ever - set(ctrl.active_layers))
        assert offloaded == (0 if policy == "discard" else off)
        if policy == "offload_disk":
            folder = tmp_path / "offload"
            files = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
            assert files == [f"layer-{i:04d}-rank0.pt" for i in sorted(ever - set(ctrl.active_layers))]

    run(model, opt, ctrl, 0, 52, after_step=check)
    assert ctrl.interval == 51 and len(ever) == 4


def test_keep_lets_device_state_grow(tmp_path):
    model, opt, ctrl = setup(tmp_path, interval_steps=1, state_policy="keep")
    sizes, ever = [], set()

    def check(step):
        ever.update(ctrl.active_layers)
        sizes.append(ctrl.state_bytes())
        layers = {int(n.split(".")[2]) for n in state_params(opt, model) if n.startswith("model.layers.")}
        assert layers == ever

    run(model, opt, ctrl, 0, 8, after_step=check)
    assert sizes[-1][0] > sizes[0][0] and all(off == 0 for _, off in sizes)
    assert [s for s, _ in sizes] == sorted(s for s, _ in sizes)


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
def test_offload_is_bit_identical_to_keep(tmp_path, name):
    results = {}
    for policy in ("keep", "offload_cpu", "offload_disk", "discard"):
        model, opt, ctrl = setup(tmp_path / policy, name=name, interval_steps=2, state_policy=policy)
        results[policy] = (run(model, opt, ctrl, 0, 16), model)
    assert reentering(LayerSampler(6, 2, 0), 1, 7)
    keep_losses, keep_model = results["keep"]
    for policy in ("offload_cpu", "offload_disk"):
        losses, model = results[policy]
        assert losses == keep_losses, policy
        assert_same_weights(model, keep_model)
    assert results["discard"][0] != keep_losses  # fresh moments do change the path: the test can tell


def test_never_sampled_layers_keep_their_weights(tmp_path):
    model, opt, ctrl = setup(tmp_path, layers=8, active_layers=1, interval_steps=1)
    never = set(range(8)) - {i for k in range(5) for i in ctrl.sampler.active_set(k)}
    assert never
    before = weights(model)
    run(model, opt, ctrl, 0, 5)
    for i in never:
        for n, p in model.model.layers[i].named_parameters():
            assert torch.equal(p, before[f"model.layers.{i}.{n}"])


@pytest.mark.parametrize("name,policy", list(itertools.product(NAMES, POLICIES)))
def test_every_optimizer_with_every_policy(tmp_path, name, policy):
    model, opt, ctrl = setup(tmp_path, name=name, layers=4, interval_steps=1, state_policy=policy)
    before = weights(model)
    losses = run(model, opt, ctrl, 0, 5)
    assert all(np.isfinite(losses))
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])
    if policy != "keep":
        assert state_params(opt, model) == trainable_names(model)
    if policy in ("offload_cpu", "offload_disk"):
        assert ctrl.state_bytes()[1] > 0


@pytest.mark.parametrize("name", ["adamw_32bit", "paged_adamw_8bit"])
@pytest.mark.parametrize("policy", ["discard", "offload_disk"])
def test_in_backward_with_lisa_matches_the_ordinary_step(tmp_path, name, policy):
    model, opt, ctrl = setup(tmp_path / "a", name=name, interval_steps=2, state_policy=policy)
    ref = run(model, opt, ctrl, 0, 8)
    model_ib, opt_ib, ctrl_ib = setup(tmp_path / "b", name=name, in_backward=True, interval_steps=2,
                                      state_policy=policy)
    assert run(model_ib, opt_ib, ctrl_ib, 0, 8) == ref
    assert_same_weights(model_ib, model)
    assert state_params(opt_ib, model_ib) == trainable_names(model_ib)


def test_backward_stops_at_the_lowest_trainable_layer(tmp_path):
    model, opt, ctrl = setup(tmp_path, active_layers=1, train_embeddings=False, seed=0)
    step = next(s for s in range(50) if ctrl.sampler.active_set(s // 2)[0] >= 3)
    ctrl.activate_for_step(step)
    lowest = ctrl.active_layers[0]
    out_requires_grad = {}
    emb = model.get_input_embeddings()
    assert not emb._forward_hooks  # no enable_input_require_grads
    hooks = [emb.register_forward_hook(lambda m, i, o: out_requires_grad.__setitem__("emb", o.requires_grad))]
    for i, layer in enumerate(model.model.layers):
        def record(m, args, out, i=i):
            h = out[0] if isinstance(out, tuple) else out
            out_requires_grad[i] = h.requires_grad
        hooks.append(layer.register_forward_hook(record))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=x, labels=x).loss
    for h in hooks:
        h.remove()
    assert out_requires_grad["emb"] is False
    assert all(out_requires_grad[i] is False for i in range(lowest))
    assert all(out_requires_grad[i] is True for i in range(lowest, 6))

    # The graph reaches exactly the trainable leaves: nothing below the lowest layer is visited.
    leaves, seen, todo = set(), set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.add(id(node.variable))
        todo.extend(n for n, _ in node.next_functions)
    assert leaves == {id(p) for p in ctrl.trainable_parameters()}
    loss.backward()
    assert model.model.embed_tokens.weight.grad is None


# -- checkpoints ----------------------------------------------------------------------------------


def _resume_matches(tmp_path, name, policy, in_backward=False, stop=7, total=11, **lisa):
    """Stop at `stop` (mid interval), save, rebuild everything fresh, load, continue: the same
    losses and weights as never stopping. Seed 1 samples [2,4] [0,2] [1,5] [0,2]: after the stop
    layers 0 and 2 come back with moments that were offloaded before the checkpoint."""
    lisa.setdefault("seed", 1)
    lisa.update(name=name, in_backward=in_backward, state_policy=policy)
    model, opt, ctrl = setup(tmp_path / "ref", **lisa)
    ref = run(model, opt, ctrl, 0, total)

    model_a, opt_a, ctrl_a = setup(tmp_path / "a", **lisa)
    before = run(model_a, opt_a, ctrl_a, 0, stop)
    import io

    buf = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "lisa": ctrl_a.state_dict()}, buf)
    saved_offload = ctrl_a.state_bytes()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    # Different init, so only the checkpoint can make it right.
    model_b, opt_b, ctrl_b = setup(tmp_path / "b", model_seed=99, **lisa)
    model_b.load_state_dict(ckpt["model"])
    ctrl_b.load_state_dict(ckpt["lisa"])
    assert ctrl_b.active_layers == ctrl_a.active_layers
    assert trainable_names(model_b) == trainable_names(model_a)
    assert ctrl_b.state_bytes() == saved_offload
    after = run(model_b, opt_b, ctrl_b, stop, total)
    assert before + after == ref
    assert_same_weights(model_b, model)
    return ckpt


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
@pytest.mark.parametrize("policy", POLICIES)
def test_state_dict_round_trip_continues_bit_identically(tmp_path, name, policy):
    ckpt = _resume_matches(tmp_path, name, policy, interval_steps=3)
    lisa = ckpt["lisa"]
    sampler = LayerSampler(6, 2, 1)
    assert reentering(sampler, 3, 3) == {0, 2}
    assert lisa["interval"] == 2 and lisa["active_layers"] == sampler.active_set(2)
    for st in lisa["optimizer"].values():
        assert all(v.device == CPU for v in st.values() if torch.is_tensor(v))
    layers_with_state = {int(n.split(".")[2]) for n in lisa["optimizer"] if n.startswith("model.layers.")}
    ever = {i for k in range(3) for i in sampler.active_set(k)}
    # The checkpoint covers offloaded moments too; discard has only the active set's.
    assert layers_with_state == (set(lisa["active_layers"]) if policy == "discard" else ever)


def test_state_dict_round_trip_in_backward_and_paged(tmp_path):
    _resume_matches(tmp_path / "ib", "adamw_32bit", "offload_cpu", in_backward=True, interval_steps=3)
    _resume_matches(tmp_path / "paged", "paged_adamw_8bit", "offload_disk", interval_steps=3)


def test_state_dict_round_trip_without_lisa(tmp_path):
    _resume_matches(tmp_path, "adamw_32bit", "discard", enabled=False, stop=3, total=5)


def test_state_dict_leaves_offloaded_files_and_refuses_a_different_sampler(tmp_path):
    model, opt, ctrl = setup(tmp_path, state_policy="offload_disk", interval_steps=1)
    run(model, opt, ctrl, 0, 4)
    files = sorted((tmp_path / "offload").iterdir())
    assert files
    ctrl.state_dict()
    assert sorted((tmp_path / "offload").iterdir()) == files  # reading a checkpoint moves nothing
    sd = ctrl.state_dict()
    sd["active_layers"] = [i for i in range(6) if i not in sd["active_layers"]][:2]
    _, _, other = setup(tmp_path / "other", state_policy="offload_disk", interval_steps=1)
    with pytest.raises(LisaftError, match="training.seed or lisa.active_layers"):
        other.load_state_dict(sd)


def test_stale_offload_files_of_this_rank_are_cleared(tmp_path):
    folder = tmp_path / "offload"
    folder.mkdir()
    (folder / "layer-0001-rank0.pt").write_bytes(b"stale")
    (folder / "layer-0002-rank0.tmp").write_bytes(b"half")
    (folder / "layer-0001-rank1.pt").write_bytes(b"another rank's")
    setup(tmp_path, state_policy="offload_disk")
    assert sorted(p.name for p in folder.iterdir()) == ["layer-0001-rank1.pt"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="paged state needs CUDA")
@pytest.mark.parametrize("name", ["paged_adamw_32bit", "paged_adamw_8bit"])
@pytest.mark.parametrize("policy", ["discard", "offload_cpu", "offload_disk"])
def test_paged_state_is_paged_again_and_recycled_on_cuda(tmp_path, name, policy):
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.device("cuda", 0)
    # intermediate 512 x hidden 256: the MLP matrices reach bitsandbytes' paging threshold.
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(cuda)
    opt = build_optimizer(model, OptimizerSection(name=name, lr=1e-3), cuda)
    sec = LisaSection(enabled=True, active_layers=1, interval_steps=1, state_policy=policy)
    ctrl = LisaController(model, model_parts(model), sec, opt, cuda, tmp_path / "offload", 0)
    big = [p for layer in model.model.layers for p in layer.parameters() if p.numel() >= 100_000]
    buffers = set()
    for step in range(8):
        ctrl.activate_for_step(step)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step)).to(cuda)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.isfinite(loss)
        for p in big:
            if p.requires_grad:
                st = opt.state[p]
                assert optim.is_paged(st["state1"]) and optim.is_paged(st["state2"])
                buffers.update((st["state1"].data_ptr(), st["state2"].data_ptr()))
        assert state_params(opt, model) == trainable_names(model)
    per_layer = 2 * sum(1 for p in model.model.layers[0].parameters() if p.numel() >= 100_000)
    # Re-sampled layers reuse released paged buffers instead of allocating (and leaking) new ones.
    assert len(buffers) <= 2 * per_layer
