"""LISA: the sampler, switching whole units, the state policies and their memory, on tiny Llamas
on CPU.

The step loop here is deliberately the smallest one that exercises the controller and the unit
optimizers; the trainer's loop is tested elsewhere."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _tiny import tiny as _tiny

from lisaft.checkpoint.optimizer_files import OptimizerFiles
from lisaft.config.schema import LisaSection, OptimizerSection
from lisaft.errors import LisaftError
from lisaft.lisa import LayerSampler, LisaController
from lisaft.model.parts import model_parts
from lisaft.model.units import model_units
from lisaft.optim.adamw import is_paged
from lisaft.optim.in_backward import StepInBackward
from lisaft.optim.unit_optimizers import UnitOptimizers

CPU = torch.device("cpu")
NAMES = ["adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit"]
POLICIES = ["discard", "offload_cpu", "offload_disk", "keep"]


def tiny(seed: int = 0, layers: int = 6):
    return _tiny(seed, layers)


def setup(tmp_path, name="adamw_32bit", in_backward=False, layers=6, seed=0, model_seed=0,
          device=CPU, model=None, **lisa):
    model = model if model is not None else tiny(model_seed, layers)
    units = model_units(model_parts(model))
    section = OptimizerSection(name=name, lr=1e-3, weight_decay=0.1, in_backward=in_backward)
    opts = UnitOptimizers(units, section, device, tmp_path / "offload", seed)
    sec = LisaSection(**{"enabled": True, "active_layers": 2, "interval_steps": 2, **lisa})
    ctrl = LisaController(units, opts, sec, seed)
    hooks = StepInBackward(units, opts) if in_backward else None
    return SimpleNamespace(model=model, opts=opts, ctrl=ctrl, files=OptimizerFiles(opts, ctrl), hooks=hooks)


def run(h, start: int, stop: int, after_step=None, vocab: int = 128) -> list[float]:
    device = next(h.model.parameters()).device
    losses = []
    for step in range(start, stop):
        h.ctrl.activate_for_step(step)
        h.opts.set_lr(1e-3, step)
        x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(step)).to(device)
        loss = h.model(input_ids=x, labels=x).loss
        loss.backward()
        h.opts.step(h.ctrl.trainable_units())
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


def state_params(h) -> set[str]:
    """Names of the parameters that have moments on the device."""
    names = {p: n for n, p in h.model.named_parameters()}
    return {names[p] for opt in h.opts.resident.values() for p, st in opt.state.items() if st}


def trainable_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def unit_state_bytes(h, names) -> int:
    return sum(h.opts.resident[n].resident_bytes() for n in names if n in h.opts.resident)


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


@pytest.mark.parametrize("n, gamma", [(6, 2), (7, 2), (8, 3), (24, 2), (5, 5), (4, 1)])
def test_cyclic_trains_every_layer_in_every_cycle(n, gamma):
    s = LayerSampler(n, gamma, seed=11, sampling="cyclic")
    cycle = -(-n // gamma)
    assert s.cycle_intervals == cycle
    orders = []
    for c in range(40):
        sets = [s.active_set(c * cycle + j) for j in range(cycle)]
        for a in sets:
            assert a == sorted(set(a)) and len(a) == gamma and 0 <= a[0] and a[-1] < n
        assert set().union(*map(set, sets)) == set(range(n)), (c, sets)
        # Exactly the top-up of the cycle's last interval trains twice.
        assert sum(map(len, sets)) - n == cycle * gamma - n
        orders.append(tuple(map(tuple, sets)))
    if n > gamma:
        assert len(set(orders)) > 1  # the order is drawn afresh per cycle, not fixed


def test_cyclic_sampler_is_pure_in_any_query_order():
    s = LayerSampler(7, 2, seed=5, sampling="cyclic")
    np.random.seed(321)
    before = np.random.get_state()[1].copy()
    forward = [s.active_set(i) for i in range(60)]
    backward = [LayerSampler(7, 2, seed=5, sampling="cyclic").active_set(i) for i in reversed(range(60))][::-1]
    assert forward == backward
    rng = np.random.default_rng(0)
    fresh = LayerSampler(7, 2, seed=5, sampling="cyclic")
    for i in rng.permutation(60):
        assert fresh.active_set(int(i)) == forward[i]
    assert np.array_equal(np.random.get_state()[1], before)  # global RNG untouched
    assert forward != [LayerSampler(7, 2, seed=6, sampling="cyclic").active_set(i) for i in range(60)]
    assert forward != [LayerSampler(7, 2, seed=5).active_set(i) for i in range(60)]
    with pytest.raises(ValueError, match="sampling"):
        LayerSampler(7, 2, seed=5, sampling="round_robin")


def test_cyclic_is_uniform_over_layers_in_each_slot():
    # Each slot of a cycle is as likely to hold any layer: no layer is always trained first.
    n, gamma = 6, 2
    s = LayerSampler(n, gamma, seed=3, sampling="cyclic")
    first = np.zeros(n)
    for c in range(3000):
        first[s.active_set(c * s.cycle_intervals)] += 1
    expected = 3000 * gamma / n
    assert ((first - expected) ** 2 / expected).sum() < 20.5  # 5 degrees of freedom, p = 0.001


def test_controller_samples_cyclically_when_asked(tmp_path):
    h = setup(tmp_path, layers=6, active_layers=2, interval_steps=1, sampling="cyclic")
    seen = []
    for step in range(6):
        h.ctrl.activate_for_step(step)
        seen.append(h.ctrl.active_layers)
    assert seen == [LayerSampler(6, 2, 0, "cyclic").active_set(i) for i in range(6)]
    assert set().union(*map(set, seen[:3])) == set(range(6))


# -- switching ------------------------------------------------------------------------------------


def test_too_many_active_layers_is_a_clear_error(tmp_path):
    with pytest.raises(LisaftError, match=r"lisa\.active_layers.*4 decoder layers"):
        setup(tmp_path, layers=4, active_layers=5)


def test_units_are_embeddings_each_layer_and_head(tmp_path):
    h = setup(tmp_path, layers=3)
    names = [u.name for u in h.ctrl.units]
    assert names == ["embeddings", "layer-00000", "layer-00001", "layer-00002", "head"]
    params = [p for u in h.ctrl.units for p in u.params]
    assert len(params) == len(set(params)) == len(list(h.model.parameters()))


def test_disabled_trains_everything_with_the_same_statistics(tmp_path):
    h = setup(tmp_path, enabled=False, layers=4, active_layers=9)
    assert run(h, 0, 1)
    assert h.ctrl.activate_for_step(5) is False
    assert h.ctrl.active_layers == [0, 1, 2, 3]
    assert h.ctrl.trainable_params() == sum(p.numel() for p in h.model.parameters())
    # float32 moments, two per parameter element; the step count is a Python int.
    assert h.opts.state_bytes() == (sum(8 * p.numel() for p in h.model.parameters()), 0)


def test_optimizer_updates_exactly_the_trainable_parameters(tmp_path):
    h = setup(tmp_path, active_layers=2, interval_steps=2)
    sampler = h.ctrl.sampler
    first = set(sampler.active_set(0))
    later = {i for k in range(1, 6) for i in sampler.active_set(k)}
    late = min(later - first)
    late_before = weights(h.model)
    seen_late_train = []
    prev = weights(h.model)

    def check(step):
        nonlocal prev
        now = weights(h.model)
        changed = {n for n in now if not torch.equal(now[n], prev[n])}
        assert changed == trainable_names(h.model), step
        assert all(p.grad is None for p in h.model.parameters())
        prev = now
        if late in h.ctrl.active_layers:
            seen_late_train.append(step)

    for step in range(12):
        switched = h.ctrl.activate_for_step(step)
        assert switched == (step % 2 == 0)
        names = trainable_names(h.model)
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(h.ctrl.active_layers) == set(sampler.active_set(step // 2))
        assert any(n.startswith("model.embed_tokens") for n in names) and "lm_head.weight" in names
        assert "model.norm.weight" in names
        assert h.ctrl.trainable_params() == sum(p.numel() for p in h.ctrl.trainable_parameters())
        run(h, step, step + 1)
        assert h.ctrl.grad_bytes() == 0  # the step freed every gradient
        check(step)
    assert seen_late_train  # a layer frozen at the start did train once sampled
    late_now = h.model.model.layers[late].mlp.up_proj.weight
    assert not torch.equal(late_now, late_before[f"model.layers.{late}.mlp.up_proj.weight"])


def test_grad_bytes_are_the_trainable_gradients(tmp_path):
    h = setup(tmp_path)
    h.ctrl.activate_for_step(0)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    h.model(input_ids=x, labels=x).loss.backward()
    assert h.ctrl.grad_bytes() == 4 * h.ctrl.trainable_params()


def test_moments_survive_for_always_trained_and_resampled_layers(tmp_path):
    # Find an interval whose set shares a layer with the next one (seed search is deterministic).
    def overlap(s):
        return set(LayerSampler(6, 2, s).active_set(0)) & set(LayerSampler(6, 2, s).active_set(1))

    seed = next(s for s in range(50) if overlap(s))
    h = setup(tmp_path, seed=seed, interval_steps=3, state_policy="discard")
    shared = sorted(set(h.ctrl.sampler.active_set(0)) & set(h.ctrl.sampler.active_set(1)))[0]
    run(h, 0, 6)

    def steps(unit, p):
        return h.opts.resident[unit].state[p]["step"]

    assert steps("embeddings", h.model.model.embed_tokens.weight) == 6
    assert steps("head", h.model.lm_head.weight) == 6
    assert steps("head", h.model.model.norm.weight) == 6
    assert steps(f"layer-{shared:05d}", h.model.model.layers[shared].self_attn.q_proj.weight) == 6


@pytest.mark.parametrize("name,policy", [("adamw_32bit", "discard"), ("adamw_32bit", "offload_cpu"),
                                         ("adamw_32bit", "offload_disk"), ("adamw_8bit", "offload_disk")])
def test_device_state_stays_the_trainable_sets_over_20_intervals(tmp_path, name, policy):
    h = setup(tmp_path, name=name, layers=4, interval_steps=1, state_policy=policy)
    per_layer = {}
    ever = set()

    def check(step):
        assert state_params(h) == trainable_names(h.model)
        assert set(h.opts.resident) == {u.name for u in h.ctrl.trainable_units()}
        resident, offloaded = h.opts.state_bytes()
        code_books = 2 * 256 * 4 if name == "adamw_8bit" else 0
        assert resident == unit_state_bytes(h, h.opts.resident) + code_books
        for i in h.ctrl.active_layers:
            per_layer[i] = unit_state_bytes(h, [f"layer-{i:05d}"])
        ever.update(h.ctrl.active_layers)
        off = sum(per_layer[i] for i in ever - set(h.ctrl.active_layers))
        assert offloaded == (0 if policy == "discard" else off)
        if policy == "offload_disk":
            folder = tmp_path / "offload"
            files = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
            assert files == [f"layer-{i:05d}.pt" for i in sorted(ever - set(h.ctrl.active_layers))]

    run(h, 0, 22, after_step=check)
    assert h.ctrl.interval == 21 and len(ever) == 4


def test_keep_lets_device_state_grow(tmp_path):
    h = setup(tmp_path, interval_steps=1, state_policy="keep")
    sizes, ever = [], set()

    def check(step):
        ever.update(h.ctrl.active_layers)
        sizes.append(h.opts.state_bytes())
        layers = {int(n.split(".")[2]) for n in state_params(h) if n.startswith("model.layers.")}
        assert layers == ever

    run(h, 0, 8, after_step=check)
    assert sizes[-1][0] > sizes[0][0] and all(off == 0 for _, off in sizes)
    assert [s for s, _ in sizes] == sorted(s for s, _ in sizes)


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
def test_offload_is_bit_identical_to_keep(tmp_path, name):
    results = {}
    for policy in ("keep", "offload_cpu", "offload_disk", "discard"):
        h = setup(tmp_path / policy, name=name, interval_steps=2, state_policy=policy)
        # 14 steps, intervals 0-6: layers 0, 3 and 5 leave and come back (in intervals 5 and 6).
        results[policy] = (run(h, 0, 14), h.model)
    assert reentering(LayerSampler(6, 2, 0), 1, 6) == {0, 3, 5}
    keep_losses, keep_model = results["keep"]
    for policy in ("offload_cpu", "offload_disk"):
        losses, model = results[policy]
        assert losses == keep_losses, policy
        assert_same_weights(model, keep_model)
    assert results["discard"][0] != keep_losses  # fresh moments do change the path: the test can tell


def test_never_sampled_layers_keep_their_weights(tmp_path):
    h = setup(tmp_path, layers=8, active_layers=1, interval_steps=1)
    never = set(range(8)) - {i for k in range(5) for i in h.ctrl.sampler.active_set(k)}
    assert never
    before = weights(h.model)
    run(h, 0, 5)
    for i in never:
        for n, p in h.model.model.layers[i].named_parameters():
            assert torch.equal(p, before[f"model.layers.{i}.{n}"])


@pytest.mark.parametrize("name,policy", list(itertools.product(NAMES, POLICIES)))
def test_every_optimizer_with_every_policy(tmp_path, name, policy):
    h = setup(tmp_path, name=name, layers=4, interval_steps=1, state_policy=policy)
    before = weights(h.model)
    losses = run(h, 0, 5)
    assert all(np.isfinite(losses))
    assert not torch.equal(h.model.lm_head.weight, before["lm_head.weight"])
    if policy != "keep":
        assert state_params(h) == trainable_names(h.model)
    if policy in ("offload_cpu", "offload_disk"):
        assert h.opts.state_bytes()[1] > 0


@pytest.mark.parametrize("name", ["adamw_32bit", "paged_adamw_8bit"])
@pytest.mark.parametrize("policy", ["discard", "offload_disk"])
def test_in_backward_with_lisa_matches_the_ordinary_step(tmp_path, name, policy):
    h = setup(tmp_path / "a", name=name, interval_steps=2, state_policy=policy)
    ref = run(h, 0, 8)
    ib = setup(tmp_path / "b", name=name, in_backward=True, interval_steps=2, state_policy=policy)
    assert run(ib, 0, 8) == ref
    assert_same_weights(ib.model, h.model)
    assert state_params(ib) == trainable_names(ib.model)


def test_backward_stops_at_the_lowest_trainable_layer(tmp_path):
    h = setup(tmp_path, active_layers=1, train_embeddings=False, seed=0)
    model, ctrl = h.model, h.ctrl
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


def _save(h, folder, base=None):
    folder.mkdir(parents=True)
    h.files.write(folder, base)
    h.files.committed()
    return {"model": {k: v.clone() for k, v in h.model.state_dict().items()}, "lisa": h.ctrl.state_dict()}


def _load(h, ckpt, folder):
    h.model.load_state_dict(ckpt["model"])
    h.ctrl.load_state_dict(ckpt["lisa"])
    h.files.read(folder)


def _resume_matches(tmp_path, name, policy, in_backward=False, stop=7, total=11, **lisa):
    """Stop at `stop` (mid interval), save, rebuild everything fresh, load, continue: the same
    losses and weights as never stopping. Seed 1 samples [2,4] [0,2] [1,5] [0,2]: after the stop
    layers 0 and 2 come back with moments that were offloaded before the checkpoint."""
    lisa.setdefault("seed", 1)
    lisa.update(name=name, in_backward=in_backward, state_policy=policy)
    ref_h = setup(tmp_path / "ref", **lisa)
    ref = run(ref_h, 0, total)

    a = setup(tmp_path / "a", **lisa)
    before = run(a, 0, stop)
    folder = tmp_path / "ckpt" / "optimizer"
    ckpt = _save(a, folder)
    saved_bytes = a.opts.state_bytes()

    # Different init, so only the checkpoint can make it right.
    b = setup(tmp_path / "b", model_seed=99, **lisa)
    _load(b, ckpt, folder)
    assert b.ctrl.active_layers == a.ctrl.active_layers
    assert trainable_names(b.model) == trainable_names(a.model)
    assert b.opts.state_bytes() == saved_bytes
    after = run(b, stop, total)
    assert before + after == ref
    assert_same_weights(b.model, ref_h.model)
    return ckpt, folder


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
@pytest.mark.parametrize("policy", POLICIES)
def test_checkpoint_round_trip_continues_bit_identically(tmp_path, name, policy):
    ckpt, folder = _resume_matches(tmp_path, name, policy, interval_steps=3)
    lisa = ckpt["lisa"]
    sampler = LayerSampler(6, 2, 1)
    assert reentering(sampler, 3, 3) == {0, 2}
    assert lisa["interval"] == 2 and lisa["active_layers"] == sampler.active_set(2)
    files = {f.name for f in folder.iterdir()}
    ever = {i for k in range(3) for i in sampler.active_set(k)}
    layers = set(lisa["active_layers"]) if policy == "discard" else ever
    # One file per unit with moments: offloaded ones too; discard has only the active set's.
    assert files == {"embeddings.pt", "head.pt"} | {f"layer-{i:05d}.pt" for i in layers}


def test_checkpoint_round_trip_in_backward_and_paged(tmp_path):
    _resume_matches(tmp_path / "ib", "adamw_32bit", "offload_cpu", in_backward=True, interval_steps=3)
    _resume_matches(tmp_path / "paged", "paged_adamw_8bit", "offload_disk", interval_steps=3)


def test_checkpoint_round_trip_without_lisa(tmp_path):
    _resume_matches(tmp_path, "adamw_32bit", "discard", enabled=False, stop=3, total=5)


def test_unchanged_and_offloaded_units_are_linked_not_rewritten(tmp_path):
    h = setup(tmp_path, seed=1, interval_steps=3, state_policy="offload_disk")
    run(h, 0, 4)  # interval 0 trained [2, 4]; interval 1 trains [0, 2]: layer 4 sits on disk
    ckpt = [tmp_path / f"step-{i}" for i in range(3)]  # checkpoint folders, files under optimizer/

    def inodes(c):
        return {f.name: f.stat().st_ino for f in (c / "optimizer").iterdir()}

    _save(h, ckpt[0] / "optimizer")
    offload_file = tmp_path / "offload" / "layer-00004.pt"
    assert inodes(ckpt[0])["layer-00004.pt"] == offload_file.stat().st_ino
    _save(h, ckpt[1] / "optimizer", base=ckpt[0] / "optimizer")  # nothing stepped in between: all links
    assert inodes(ckpt[1]) == inodes(ckpt[0])
    run(h, 4, 5)
    _save(h, ckpt[2] / "optimizer", base=ckpt[1] / "optimizer")
    same = {n for n, ino in inodes(ckpt[2]).items() if ino == inodes(ckpt[1])[n]}
    assert same == {"layer-00004.pt"}  # the units that stepped were written anew


def test_offloaded_files_stay_and_a_different_sampler_is_refused(tmp_path):
    h = setup(tmp_path, state_policy="offload_disk", interval_steps=1)
    run(h, 0, 4)
    files = sorted((tmp_path / "offload").iterdir())
    assert files
    _save(h, tmp_path / "ckpt")
    assert sorted((tmp_path / "offload").iterdir()) == files  # writing a checkpoint moves nothing
    sd = h.ctrl.state_dict()
    sd["active_layers"] = [i for i in range(6) if i not in sd["active_layers"]][:2]
    other = setup(tmp_path / "other", state_policy="offload_disk", interval_steps=1)
    with pytest.raises(LisaftError, match="training.seed, lisa.active_layers or lisa.sampling"):
        other.ctrl.load_state_dict(sd)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    h = setup(tmp_path, layers=6)
    run(h, 0, 2)
    folder = tmp_path / "ckpt"
    _save(h, folder)
    (folder / "layer-00099.pt").write_bytes((folder / "head.pt").read_bytes())
    with pytest.raises(LisaftError, match="layer-00099"):
        h.files.read(folder)


def test_stale_offload_files_are_cleared(tmp_path):
    folder = tmp_path / "offload"
    folder.mkdir()
    (folder / "layer-00001.pt").write_bytes(b"stale")
    (folder / "layer-00002.pt.tmp").write_bytes(b"half")
    setup(tmp_path, state_policy="offload_disk")
    assert list(folder.iterdir()) == []


@pytest.mark.gpu  # paged state needs CUDA
@pytest.mark.parametrize("name", ["paged_adamw_32bit", "paged_adamw_8bit"])
@pytest.mark.parametrize("policy", ["discard", "offload_cpu", "offload_disk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_state_is_paged_again_and_recycled_on_cuda(tmp_path, name, policy, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.device("cuda", 0)
    # intermediate 512 x hidden 256: the MLP matrices reach bitsandbytes' paging threshold.
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(cuda, dtype)
    h = setup(tmp_path, name=name, device=cuda, model=model, active_layers=1, interval_steps=1,
              state_policy=policy)
    big = [p for layer in model.model.layers for p in layer.parameters() if p.numel() >= 100_000]
    owner = {p: u.name for u in h.ctrl.units for p in u.params}
    buffers = set()
    before = weights(model)

    def check(step):
        for p in big:
            if p.requires_grad:
                st = h.opts.resident[owner[p]].state[p]
                assert is_paged(st["exp_avg"]) and is_paged(st["exp_avg_sq"])
                buffers.update((st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr()))
        assert state_params(h) == trainable_names(model)

    losses = run(h, 0, 8, after_step=check, vocab=256)
    assert all(np.isfinite(losses))
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])
    per_layer = 2 * sum(1 for p in model.model.layers[0].parameters() if p.numel() >= 100_000)
    # Re-sampled layers reuse released paged buffers instead of allocating (and leaking) new ones.
    assert len(buffers) <= 2 * per_layer
