"""The optimizer registry, step-in-backward, and moving one parameter's state in and out."""

from __future__ import annotations

import warnings

import pytest
import torch

from _tiny import tiny as _tiny

from lisaft import optim
from lisaft.optim import InBackwardOptimizer, build_optimizer, set_lr
from lisaft.recipe import OptimizerSection

NAMES = ["adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit"]
CPU = torch.device("cpu")


def tiny(seed: int = 0, layers: int = 4):
    return _tiny(seed, layers)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1000 + step))


def train(model, opt, steps: int) -> list[float]:
    losses = []
    for s in range(steps):
        x = batch(s)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def section(name: str = "adamw_32bit", **kw) -> OptimizerSection:
    return OptimizerSection(name=name, lr=kw.pop("lr", 1e-3), weight_decay=kw.pop("weight_decay", 0.1), **kw)


def test_registry_classes_and_weight_decay_groups():
    import bitsandbytes as bnb

    model = tiny()
    opt = build_optimizer(model, section("adamw_32bit"), CPU)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["fused"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert isinstance(build_optimizer(model, section("adamw_8bit"), CPU), bnb.optim.AdamW8bit)
    assert isinstance(build_optimizer(model, section("paged_adamw_32bit"), CPU), bnb.optim.PagedAdamW)
    assert isinstance(build_optimizer(model, section("paged_adamw_8bit"), CPU), bnb.optim.PagedAdamW8bit)


def test_paged_on_cpu_warns_once_in_one_line():
    optim._warned_cpu_paging.discard("paged_adamw_32bit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model = tiny()
            train(model, build_optimizer(model, section("paged_adamw_32bit"), CPU), 1)
        model = tiny()
        train(model, build_optimizer(model, section("paged_adamw_32bit", in_backward=True), CPU), 1)
    paging = [w for w in caught if "paged" in str(w.message).lower()]
    assert len(paging) == 1, [str(w.message) for w in paging]
    assert "\n" not in str(paging[0].message) and "unpaged" in str(paging[0].message)


@pytest.mark.parametrize("name", NAMES)
def test_frozen_parameters_are_skipped_and_state_is_lazy(name):
    model = tiny()
    frozen = list(model.model.layers[1].parameters())
    for p in frozen:
        p.requires_grad_(False)
    before = [p.detach().clone() for p in frozen]
    opt = build_optimizer(model, section(name), CPU)
    assert optim.resident_state_bytes(opt, CPU) == 0
    train(model, opt, 2)
    assert all(torch.equal(a, p) for a, p in zip(before, frozen))
    assert not any(optim.has_state(opt, p) for p in frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(optim.has_state(opt, p) for p in trainable)
    for p in frozen:  # unfrozen later: it trains from then on
        p.requires_grad_(True)
    train(model, opt, 1)
    assert all(optim.has_state(opt, p) for p in frozen)
    assert not all(torch.equal(a, p) for a, p in zip(before, frozen))


def test_set_lr_reaches_every_group():
    model = tiny()
    for sec in (section(), section(in_backward=True)):
        opt = build_optimizer(model, sec, CPU)
        set_lr(opt, 3e-4)
        assert {g["lr"] for g in opt.param_groups} == {3e-4}
        if isinstance(opt, InBackwardOptimizer):
            opt.remove_hooks()


@pytest.mark.parametrize("name", NAMES)
def test_in_backward_gives_the_same_update_as_step(name):
    ref = tiny()
    ref_losses = train(ref, build_optimizer(ref, section(name), CPU), 3)
    model = tiny()
    opt = build_optimizer(model, section(name, in_backward=True), CPU)
    assert isinstance(opt, InBackwardOptimizer)
    losses = []
    for s in range(3):
        x = batch(s)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        # The update already happened inside backward and each gradient was freed at once.
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses == ref_losses
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n


def test_in_backward_hooks_fire_only_on_trainable():
    model = tiny()
    frozen = list(model.model.layers[0].parameters()) + list(model.model.embed_tokens.parameters())
    for p in frozen:
        p.requires_grad_(False)
    before = [p.detach().clone() for p in frozen]
    opt = build_optimizer(model, section(in_backward=True), CPU)
    train(model, opt, 2)
    assert all(torch.equal(a, p) for a, p in zip(before, frozen))
    assert not any(optim.has_state(opt, p) for p in frozen)
    assert all(optim.has_state(opt, p) for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit", "paged_adamw_8bit"])
@pytest.mark.parametrize("in_backward", [False, True])
def test_export_import_round_trip_is_exact(name, in_backward):
    model = tiny()
    opt = build_optimizer(model, section(name, in_backward=in_backward), CPU)
    train(model, opt, 2)
    q = model.model.layers[0].mlp.up_proj.weight  # 8192 elements: 8-bit state when asked for
    live = dict(optim.holder(opt, q).state[q])
    if "8bit" in name:
        assert live["state1"].dtype == torch.uint8 and "absmax1" in live and "qmap1" in live
    exported = optim.export_state(opt, q, remove=False)
    assert "qmap1" not in exported and "qmap2" not in exported  # code books are shared, not copied
    for k, v in exported.items():
        assert torch.equal(v, live[k]) if torch.is_tensor(v) else v == live[k]
        if torch.is_tensor(v):
            assert v.data_ptr() != live[k].data_ptr()  # a copy: the optimizer keeps training
    taken = optim.export_state(opt, q, remove=True)
    assert not optim.has_state(opt, q)
    optim.import_state(opt, q, taken)
    restored = optim.holder(opt, q).state[q]
    assert set(restored) == set(live)
    for k, v in live.items():
        assert torch.equal(restored[k], v) if torch.is_tensor(v) else restored[k] == v
    if "8bit" in name:
        # Re-attached to the optimizer's own code books, not to private copies.
        assert restored["qmap1"] is optim.holder(opt, q).name2qmap["dynamic"]
    if name == "adamw_32bit":
        assert restored["step"].dtype == torch.float32 and restored["step"].device == CPU
    optim.drop_state(opt, q)
    assert not optim.has_state(opt, q)


def test_resident_bytes_counts_real_tensors_and_shared_code_books_once():
    model = tiny()
    opt = build_optimizer(model, section("adamw_32bit"), CPU)
    train(model, opt, 1)
    expected = sum(2 * p.numel() * 4 + 4 for p in model.parameters())  # two moments + step
    assert optim.resident_state_bytes(opt, CPU) == expected
    opt8 = build_optimizer(model, section("adamw_8bit"), CPU)
    train(model, opt8, 1)
    per_param = sum(optim.state_nbytes(optim.holder(opt8, p).state[p]) for p in model.parameters())
    assert optim.resident_state_bytes(opt8, CPU) == per_param + 2 * 256 * 4
