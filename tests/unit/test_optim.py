"""The unit optimizer: the AdamW arithmetic, moment dtypes, chunking, state round trips, and
bf16 rounding.

These tests pin the torch path: the one on CUDA, and on the CPU where the host kernel cannot load.
With the kernel, the CPU step is its own one-pass arithmetic (tests/unit/test_host_step.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _tiny import tiny as _tiny

from lisaft.config.schema import OptimizerSection
from lisaft.optim import adamw as optim
from lisaft.optim import build
from lisaft.optim.adamw import Rounding
from lisaft.optim.build import build_unit_optimizer
from lisaft.optim.gradients import clip_grad_norm, grad_nbytes
from lisaft.optim.unit_optimizers import host_state_dict

NAMES = ["adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit"]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.setattr(optim.host_step, "available", lambda: False)


def tiny(seed: int = 0, layers: int = 2, dtype=torch.float32):
    return _tiny(seed, layers).to(dtype)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1000 + step))


def section(name: str = "adamw_32bit", **kw) -> OptimizerSection:
    return OptimizerSection(name=name, lr=kw.pop("lr", 1e-3), weight_decay=kw.pop("weight_decay", 0.1), **kw)


def make(model, name="adamw_32bit", rounding="stochastic", **kw):
    sec = section(name, bf16_update=rounding, **kw)
    return build_unit_optimizer(list(model.parameters()), sec, CPU, Rounding(rounding, seed=0), 0, None)


def train(model, opt, steps: int) -> list[float]:
    losses = []
    for s in range(steps):
        if isinstance(opt, optim.AdamW):
            opt.rounding.step = s
        x = batch(s)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_float32_update_is_torch_adamw_bit_for_bit():
    # float32 weights take torch's fused kernel (one pass, the Trainer's adamw_torch_fused); its
    # rounding differs from the single-tensor path in the last bit, so the fused path is the reference.
    a, b = tiny(), tiny()
    ours = make(a)
    decay = [p for p in b.parameters() if p.ndim >= 2]
    rest = [p for p in b.parameters() if p.ndim < 2]
    ref = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3,
                            weight_decay=0.1, fused=True)
    assert train(a, ours, 4) == train(b, ref, 4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_8bit_update_is_bitsandbytes_adamw8bit_bit_for_bit():
    import bitsandbytes as bnb

    a, b = tiny(), tiny()
    ours = make(a, "adamw_8bit")
    decay = [p for p in b.parameters() if p.ndim >= 2]
    rest = [p for p in b.parameters() if p.ndim < 2]
    ref = bnb.optim.AdamW8bit([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3,
                              weight_decay=0.1)
    assert train(a, ours, 4) == train(b, ref, 4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_give_the_whole_tensor_update(monkeypatch, name, dtype):
    # Round-to-nearest: stochastic rounding draws its noise per chunk, by design.
    a, b = tiny(dtype=dtype), tiny(dtype=dtype)
    whole = train(a, make(a, name, rounding="nearest"), 3)
    # 512 elements: chunks end inside every matrix, on 8-bit block boundaries. float32 weights of
    # adamw_32bit step whole through the fused kernel; turning that off makes them go by chunks.
    monkeypatch.setattr(optim, "CHUNK", 512)
    monkeypatch.setattr(optim.AdamW, "_fusable", lambda self, p: False)
    slices = []
    real_slice = optim._GradChunks.slice
    monkeypatch.setattr(optim._GradChunks, "slice", lambda self, lo, hi: slices.append(lo) or real_slice(self, lo, hi))
    assert train(b, make(b, name, rounding="nearest"), 3) == whole
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    big = [p for p in b.parameters() if p.numel() > 512]
    assert big and sum(1 for lo in slices if lo > 0) >= 3 * len(big)  # every large matrix in pieces


@pytest.mark.parametrize("name", NAMES)
def test_moment_dtypes_whatever_the_weight_dtype(name):
    model = tiny(dtype=torch.bfloat16)
    opt = make(model, name)
    train(model, opt, 1)
    for p in model.parameters():
        st = opt.state[p]
        quantized = name.endswith("_8bit") and p.numel() >= optim.MIN_8BIT_NUMEL
        want = torch.uint8 if quantized else torch.float32
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == want
        assert ("absmax1" in st) == quantized
    # Weight decay on matrices and embeddings only.
    wd = {p: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert all(wd[p] == (0.1 if p.ndim >= 2 else 0.0) for p in model.parameters())


def test_float32_second_moment_of_bf16_weights_decays():
    # A bf16 second moment times 0.999 rounds back to itself; float32 moments decay as Adam says.
    model = tiny(dtype=torch.bfloat16)
    opt = make(model)
    train(model, opt, 1)
    p = model.lm_head.weight
    v1 = opt.state[p]["exp_avg_sq"].clone()
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(opt.state[p]["exp_avg_sq"], v1 * 0.999, rtol=1e-6)


def test_paged_on_cpu_warns_once_in_one_line():
    build._warned_cpu_paging.discard("paged_adamw_8bit")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        make(tiny(), "paged_adamw_8bit")
        make(tiny(), "paged_adamw_8bit")
    msgs = [str(x.message) for x in w if "unpaged" in str(x.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "optimizer.name paged_adamw_8bit" in msgs[0]


@pytest.mark.parametrize("name", NAMES)
def test_frozen_parameters_are_skipped_and_state_is_lazy(name):
    model = tiny()
    opt = make(model, name)
    assert not opt.state
    frozen = model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    before = frozen.clone()
    train(model, opt, 2)
    assert torch.equal(frozen, before) and not opt.state.get(frozen)
    assert opt.state[model.lm_head.weight]["step"] == 2


@pytest.mark.parametrize("name", NAMES)
def test_step_param_gives_the_same_update_as_step(name):
    a, b = tiny(), tiny()
    opt_a, opt_b = make(a, name), make(b, name)
    for s in range(3):
        x = batch(s)
        a(input_ids=x, labels=x).loss.backward()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        b(input_ids=x, labels=x).loss.backward()
        for p in b.parameters():
            opt_b.step_param(p)
            p.grad = None
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_is_exact(name, dtype):
    a, b = tiny(dtype=dtype), tiny(dtype=dtype)
    opt_a = make(a, name)
    train(a, opt_a, 2)
    saved = host_state_dict(opt_a)
    b.load_state_dict(a.state_dict())
    opt_b = make(b, name)
    opt_b.load_state_dict(saved)
    for p, q in zip(a.parameters(), b.parameters()):
        for k, v in opt_a.state[p].items():
            w = opt_b.state[q][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if torch.is_tensor(v) else v == w
    x = batch(7)
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.rounding.step = 7
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_release_empties_state_and_counts():
    model = tiny()
    opt = make(model, "adamw_8bit")
    train(model, opt, 1)
    numel = sum(p.numel() for p in model.parameters())
    assert opt.resident_bytes() >= 2 * numel
    opt.release()
    assert not opt.state and opt.resident_bytes() == 0


# -- rounding -------------------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    r = Rounding("stochastic", seed=3)
    base = torch.tensor(0.02, dtype=torch.bfloat16)
    ulp = 2.0 ** (-6 - 7)  # 0.02 lies in [2^-6, 2^-5); bf16 keeps 7 fraction bits
    x = torch.full((200_000,), base.float().item() + 0.1 * ulp)  # a tenth of an ulp above
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    r.write(out, x.clone(), 0)
    vals = set(out.float().unique().tolist())
    assert vals <= {base.float().item(), base.float().item() + ulp}
    share_up = (out.float() > base.float()).double().mean().item()
    assert abs(share_up - 0.1) < 0.005  # 7.5 standard deviations of a fair 10% coin
    nearest = torch.empty_like(out)
    Rounding("nearest", seed=3).write(nearest, x.clone(), 0)
    assert torch.equal(nearest.float(), torch.full_like(x, base.float().item()))


def test_rounding_noise_is_a_pure_function_of_seed_step_and_key():
    x = torch.linspace(-1, 1, 10_000) * 1.001

    def once(seed, step, *key):
        r = Rounding("stochastic", seed)
        r.step = step
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        r.write(out, x.clone(), *key)
        return out

    assert torch.equal(once(0, 5, 1, 2, 0), once(0, 5, 1, 2, 0))
    for other in (once(1, 5, 1, 2, 0), once(0, 6, 1, 2, 0), once(0, 5, 2, 2, 0), once(0, 5, 1, 2, 1)):
        assert not torch.equal(once(0, 5, 1, 2, 0), other)
    # Negative values too land on one of the two bf16 neighbours: within one ulp of x.
    assert bool(((once(0, 5, 0).float() - x).abs() <= x.abs() * 2 ** -7).all())


# -- sparse embedding gradients -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_in", [512, 64])
def test_a_sparse_row_gradient_updates_every_row_as_its_dense_form(monkeypatch, name, dtype, rows_in):
    # 512 rows x 32: chunks of 64 rows, the same 2048 elements as the dense chunks (so the same
    # rounding noise), with rows without a gradient among them; their moments must still decay
    # and their weights still move. rows_in=64: the gradient's rows all fall in the first chunk,
    # so seven chunks hold no gradient row at all (a real vocabulary's rare tokens).
    monkeypatch.setattr(optim, "CHUNK", 2048)
    torch.manual_seed(0)
    weight = torch.randn(512, 32).to(dtype)
    dense_p, sparse_p = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.clone())
    opts = [build_unit_optimizer([p], section(name, bf16_update="stochastic"), CPU, Rounding("stochastic", 0), 0, None)
            for p in (dense_p, sparse_p)]
    for step in range(3):
        rows = torch.randint(0, rows_in, (40,), generator=torch.Generator().manual_seed(step))
        values = torch.randn(40, 32, generator=torch.Generator().manual_seed(100 + step)).to(dtype)
        sparse = torch.sparse_coo_tensor(rows[None], values, (512, 32), check_invariants=True).coalesce()
        dense_p.grad, sparse_p.grad = sparse.to_dense(), sparse
        for opt in opts:
            opt.rounding.step = step
            opt.step()
    assert torch.equal(dense_p, sparse_p)
    touched = torch.randint(0, rows_in, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    untouched = sorted(set(range(512)) - set(touched))
    assert not torch.equal(sparse_p[untouched[0]], weight[untouched[0]])  # momentum moved it


def test_clip_grad_norm_counts_sparse_values_and_scales_them():
    dense = torch.nn.Parameter(torch.zeros(3))
    emb = torch.nn.Parameter(torch.zeros(5, 2))
    dense.grad = torch.tensor([3.0, 0.0, 0.0])
    rows = torch.tensor([[4.0, 0.0], [0.0, 12.0]])
    emb.grad = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), rows, (5, 2), check_invariants=True).coalesce()
    assert clip_grad_norm([dense, emb], 1.3) == pytest.approx(13.0)
    assert torch.allclose(dense.grad, torch.tensor([0.3, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(emb.grad.to_dense()[4], torch.tensor([0.0, 1.2]), atol=1e-6)
    assert grad_nbytes(emb.grad) == 2 * 2 * 4 + 2 * 8


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimators_chunk_buffer_rule_is_what_the_step_does(monkeypatch, name, dtype):
    """memory/optimizer_state.py counts float32 chunk buffers exactly when holds_chunk_buffers says
    so; here the step itself shows whether it updates a copy or the weight in place."""
    model = tiny(dtype=dtype)
    opt = make(model, name, rounding="nearest")
    copies = []
    for kernel in ("_fused_chunk", "_bnb_update"):
        real = getattr(optim, kernel)

        def spy(w, g, st, lo, hi, step, group, real=real):
            copies.append(w.dtype == torch.float32 and w.untyped_storage().data_ptr() not in storages)
            return real(w, g, st, lo, hi, step, group)

        monkeypatch.setattr(optim, kernel, spy)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    train(model, opt, 1)
    assert any(copies) == optim.holds_chunk_buffers(torch.finfo(dtype).bits // 8)


def test_the_fused_kernels_step_count_is_made_once_per_step(monkeypatch):
    """A CUDA step tensor made from a Python number is a blocking host copy: made per chunk it
    synced the host with the device once per chunk. One per (step, device), reused."""
    from lisaft import internals

    made = []
    real = torch.tensor
    monkeypatch.setattr(internals, "_STEP_TENSORS", {})
    monkeypatch.setattr(internals.torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    cpu = torch.device("cpu")
    first = [internals.step_tensor(3, cpu) for _ in range(50)]
    assert len(made) == 1 and all(t is first[0] for t in first) and float(first[0]) == 3.0
    for step in range(4, 40):
        assert float(internals.step_tensor(step, cpu)) == step
    assert len(internals._STEP_TENSORS) <= 16  # the last few steps only


def test_paged_updates_in_backward_wait_on_an_event_not_the_device(tmp_path, monkeypatch):
    """optimizer.in_backward with paged state: bitsandbytes' kernels run asynchronously on unified
    memory. A device sync after every parameter would stall backward; each update records an event
    on its stream instead, and a unit's release (its buffers go to the next unit) waits for it."""
    from collections import Counter

    from lisaft.model.parts import model_parts
    from lisaft.model.units import model_units
    from lisaft.optim.in_backward import StepInBackward
    from lisaft.optim.unit_optimizers import UnitOptimizers

    calls: Counter = Counter()

    class Event:  # torch.cuda.Event's two calls used here
        def record(self) -> None:
            calls["event recorded"] += 1

        def synchronize(self) -> None:
            calls["event waited"] += 1

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: calls.update(["device sync"]))
    model = tiny()
    units = model_units(model_parts(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opts = UnitOptimizers(units, section("paged_adamw_8bit", in_backward=True), CPU, tmp_path, seed=1)
        for unit in units:
            opts.optimizer(unit)._paged_cuda = True  # as on CUDA, where the state is paged
    hooks = StepInBackward(units, opts)
    x = batch(0)
    with hooks.step(measure_norm=False):
        model(input_ids=x, labels=x).loss.backward()
    params = sum(len(u.params) for u in units)
    assert calls == {"event recorded": params}
    assert all(p.grad is None for p in model.parameters())  # every parameter was updated in backward
    for unit in units:
        opts.deactivate(unit, "discard")
    assert calls == {"event recorded": params, "event waited": len(units)}


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "step-param"])
def test_paged_moments_are_prefetched_before_their_update(monkeypatch, in_backward):
    """Paged moments (logic on CPU: the state marked paged by hand): every moment of the unit is
    prefetched, through internals, before the first update of `step`; `step_param` prefetches
    its parameter's before its update. Unpaged state is never prefetched."""
    from lisaft import internals

    model = tiny()
    # A paged optimizer: an unpaged one makes no pass over its parameters for prefetching at all.
    opt = make(model, "paged_adamw_8bit")
    params = [p for p in model.parameters()]
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()  # the state exists from here on
    calls = []
    monkeypatch.setattr(internals, "prefetch_paged", lambda t: calls.append(("prefetch", t.data_ptr())))
    for path in ("_host_update", "_update"):  # the kernel's path or torch's, whichever runs here
        update = getattr(optim.AdamW, path)
        monkeypatch.setattr(optim.AdamW, path, lambda self, p, group, update=update: (calls.append(("update", p)),
                                                                                      update(self, p, group)))
    paged = params[::2]  # half of them, as small tensors stay unpaged
    for p in paged:
        for k in optim.MOMENT_KEYS:
            internals.mark_paged(opt.state[p][k], 0)
    if in_backward:
        for p in params:
            opt.step_param(p)
    else:
        opt.step()
    prefetched = [ptr for kind, ptr in calls if kind == "prefetch"]
    assert sorted(prefetched) == sorted(opt.state[p][k].data_ptr() for p in paged for k in optim.MOMENT_KEYS)
    updates = [i for i, (kind, _) in enumerate(calls) if kind == "update"]
    for p in paged:
        first_update = next(i for i in updates if calls[i][1] is p)
        mine = [i for i, (kind, ptr) in enumerate(calls) if kind == "prefetch"
                and ptr in {opt.state[p][k].data_ptr() for k in optim.MOMENT_KEYS}]
        assert len(mine) == 2 and max(mine) < first_update
    if not in_backward:
        assert max(i for i, (kind, _) in enumerate(calls) if kind == "prefetch") < min(updates)
