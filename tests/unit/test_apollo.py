"""APOLLO and APOLLO-Mini (lisaft/optim/apollo.py): the update against a float64 reference written
here from the paper's equations, resume, the step in backward, and LISA's state policies."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from _tiny import tiny
from test_lisa import _load, _save, assert_same_weights, run, trainable_names

from lisaft.checkpoint.optimizer_files import OptimizerFiles
from lisaft.config.schema import LisaSection, OptimizerSection
from lisaft.lisa import LisaController
from lisaft.model.parts import model_parts
from lisaft.model.units import model_units
from lisaft.optim.apollo import Apollo, ApolloSettings, projection
from lisaft.optim.in_backward import StepInBackward
from lisaft.optim.rounding import Rounding
from lisaft.optim.unit_optimizers import UnitOptimizers

CPU = torch.device("cpu")
POLICIES = ["discard", "offload_cpu", "offload_disk", "keep"]
LR, WD, BETAS, EPS, GAP, UNIT = 1e-2, 0.1, (0.9, 0.999), 1e-8, 2, 3


# -- the update, against the paper's equations in float64 --------------------------------------------


def reference_step(w, g, st, t, settings, refresh):
    """One APOLLO step in float64: W (1 − ηλ) − η · limiter(α · G · diag(s))."""
    wide = g.shape[0] <= g.shape[1]
    a = g if wide else g.T                      # project the smaller side
    rank = min(settings.rank, a.shape[0])
    p = projection(0, UNIT, 0, refresh, rank, a.shape[0], CPU).double()
    r = p @ a
    st["m"] = BETAS[0] * st["m"] + (1 - BETAS[0]) * r
    st["v"] = BETAS[1] * st["v"] + (1 - BETAS[1]) * r * r
    r_tilde = (st["m"] / (1 - BETAS[0] ** t)) / ((st["v"] / (1 - BETAS[1] ** t)).sqrt() + EPS)
    if settings.scale_type == "channel":
        s = r_tilde.norm(dim=0) / r.norm(dim=0)
    else:
        s = r_tilde.norm() / r.norm()
    u = settings.scale * a * s
    norm = u.norm()
    if st["prev"] > 0 and norm > 1.01 * st["prev"]:
        u = u * (1.01 * st["prev"] / norm)
        st["limited"] += 1
    st["prev"] = u.norm()
    return w * (1 - LR * WD) - LR * (u if wide else u.T)


def grads(shape, dtype):
    gen = torch.Generator().manual_seed(7)
    g0, g1 = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    # A reversal cancels the first moment; a steady direction after it makes the update grow
    # again, which the limiter caps.
    return [g.to(dtype) for g in (g0, -g0, g1, 2 * g1, g1, 3 * g1)]


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 24), (24, 8)], ids=["wide", "tall"])
@pytest.mark.parametrize("settings", [ApolloSettings(4, 1.0, GAP, "channel"),
                                      ApolloSettings(1, math.sqrt(128), GAP, "tensor")], ids=["apollo", "mini"])
def test_update_is_the_papers(dtype, shape, settings):
    w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    opt = Apollo([{"params": [w]}], settings=settings, projected=[w], lr=LR, betas=BETAS, eps=EPS,
                 weight_decay=WD, rounding=Rounding("stochastic", seed=0), unit_index=UNIT)
    rank = min(settings.rank, min(shape))
    st = {"m": torch.zeros(rank, max(shape), dtype=torch.float64), "prev": 0.0, "limited": 0}
    st["v"] = st["m"].clone()
    ref = w.detach().double()
    for t, g in enumerate(grads(shape, dtype)):
        opt.rounding.step = t
        w.grad = g
        if dtype == torch.bfloat16:  # each step from our weights: rounding errors do not compound
            ref = w.detach().double()
        ref = reference_step(ref, g.double(), st, t + 1, settings, refresh=t // GAP)
        opt.step()
        if dtype == torch.float32:
            torch.testing.assert_close(w.detach().double(), ref, rtol=1e-5, atol=1e-6)
        else:  # stochastic rounding: one of the two bf16 neighbours of the exact result
            assert ((w.detach().double() - ref).abs() <= bf16_ulp(ref) * 1.001).all()
    assert st["limited"] > 0  # the limiter was exercised
    moments = opt.state[w]
    assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.float32
    assert moments["exp_avg"].shape == (rank, max(shape))


def test_projection_is_a_function_of_its_key():
    a = projection(5, 2, 1, 0, 4, 16, CPU)
    assert torch.equal(a, projection(5, 2, 1, 0, 4, 16, CPU))
    for other in [(6, 2, 1, 0), (5, 3, 1, 0), (5, 2, 2, 0), (5, 2, 1, 1)]:
        assert not torch.equal(a, projection(*other, 4, 16, CPU))
    assert abs(a.var().item() - 1 / 4) < 0.1  # entries N(0, 1/r)


# -- the optimizer in lisaft's units -------------------------------------------------------------------


def setup(tmp_path, name="apollo", in_backward=False, model=None, model_seed=0, lisa=True, **kw):
    model = model if model is not None else tiny(model_seed, 6)
    units = model_units(model_parts(model))
    section = OptimizerSection(name=name, lr=1e-3, weight_decay=0.1, in_backward=in_backward,
                               rank=4 if name == "apollo" else None, update_proj_gap=3)
    opts = UnitOptimizers(units, section, CPU, tmp_path / "offload", 1)
    sec = LisaSection(**{"enabled": lisa, "active_layers": 2, "interval_steps": 2, **kw})
    ctrl = LisaController(units, opts, sec, 1)
    hooks = StepInBackward(units, opts) if in_backward else None
    return SimpleNamespace(model=model, opts=opts, ctrl=ctrl, files=OptimizerFiles(opts, ctrl), hooks=hooks)


def test_decoder_matrices_are_projected_and_the_rest_is_8bit(tmp_path):
    h = setup(tmp_path, lisa=False)
    run(h, 0, 2)
    layer = h.opts.resident["layer-00000"]
    assert isinstance(layer, Apollo)
    for p in h.model.model.layers[0].parameters():
        st = layer.state[p]
        if p.ndim == 2:
            assert p in layer.projected and st["exp_avg"].shape == (4, max(p.shape))
        else:  # norms: under 4096 elements, float32 moments as adamw_8bit keeps them
            assert p not in layer.projected and st["exp_avg"].shape == (p.numel(),)
    head = h.opts.resident["head"]
    assert not head.projected and head.state[h.model.lm_head.weight]["exp_avg"].dtype == torch.uint8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stop", [4, 6], ids=["mid-period", "at-a-refresh"])
@pytest.mark.parametrize("name", ["apollo", "apollo_mini"])
def test_resume_is_bit_exact(tmp_path, dtype, stop, name):
    """Refreshes at steps 3 and 6 (update_proj_gap 3): a resume at 4 continues mid-period and
    crosses the refresh at 6; one at 6 starts a new period."""
    ref_h = setup(tmp_path / "ref", name, model=tiny(0, 6).to(dtype), lisa=False)
    ref = run(ref_h, 0, 8)
    a = setup(tmp_path / "a", name, model=tiny(0, 6).to(dtype), lisa=False)
    before = run(a, 0, stop)
    folder = tmp_path / "ckpt" / "optimizer"
    ckpt = _save(a, folder)
    b = setup(tmp_path / "b", name, model=tiny(99, 6).to(dtype), lisa=False)
    _load(b, ckpt, folder)
    assert b.opts.state_bytes() == a.opts.state_bytes()
    assert before + run(b, stop, 8) == ref
    assert_same_weights(b.model, ref_h.model)


@pytest.mark.parametrize("policy", POLICIES)
def test_in_backward_with_lisa_matches_the_ordinary_step(tmp_path, policy):
    h = setup(tmp_path / "a", state_policy=policy)
    ref = run(h, 0, 8)
    ib = setup(tmp_path / "b", in_backward=True, state_policy=policy)
    assert run(ib, 0, 8) == ref
    assert_same_weights(ib.model, h.model)


def test_in_backward_without_lisa_matches_the_ordinary_step(tmp_path):
    h = setup(tmp_path / "a", "apollo_mini", model=tiny(0, 6).to(torch.bfloat16), lisa=False)
    ref = run(h, 0, 4)
    ib = setup(tmp_path / "b", "apollo_mini", in_backward=True, model=tiny(0, 6).to(torch.bfloat16), lisa=False)
    assert run(ib, 0, 4) == ref
    assert_same_weights(ib.model, h.model)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_deactivated_layer_gets_its_state_back(tmp_path, policy):
    h = setup(tmp_path, state_policy=policy)
    run(h, 0, 2)
    unit = next(u for u in h.ctrl.trainable_units() if u.layer is not None)
    held = {k: v.clone() for p, st in h.opts.resident[unit.name].state.items() for k, v in st.items()
            if torch.is_tensor(v) and p.ndim == 2}
    assert held
    h.opts.deactivate(unit, policy)
    h.opts.activate(unit)
    back = h.opts.resident[unit.name].state
    if policy == "discard":
        assert not back  # the paper's policy: the layer starts afresh
        return
    got = {k: v for p, st in back.items() for k, v in st.items() if torch.is_tensor(v) and p.ndim == 2}
    assert got.keys() == held.keys() and all(torch.equal(got[k], held[k]) for k in held)


@pytest.mark.parametrize("policy", ["offload_cpu", "offload_disk"])
def test_lisa_resume_with_offloaded_layers_is_bit_exact(tmp_path, policy):
    ref_h = setup(tmp_path / "ref", state_policy=policy, interval_steps=3)
    ref = run(ref_h, 0, 11)
    a = setup(tmp_path / "a", state_policy=policy, interval_steps=3)
    before = run(a, 0, 7)
    folder = tmp_path / "ckpt" / "optimizer"
    ckpt = _save(a, folder)
    b = setup(tmp_path / "b", model_seed=99, state_policy=policy, interval_steps=3)
    _load(b, ckpt, folder)
    assert trainable_names(b.model) == trainable_names(a.model)
    assert before + run(b, 7, 11) == ref
    assert_same_weights(b.model, ref_h.model)


# -- the recipe --------------------------------------------------------------------------------------


def test_defaults_are_the_papers():
    assert ApolloSettings.of(OptimizerSection(name="apollo")) == ApolloSettings(256, 1.0, 200, "channel")
    assert ApolloSettings.of(OptimizerSection(name="apollo_mini")) == ApolloSettings(1, math.sqrt(128), 200, "tensor")
    assert ApolloSettings.of(OptimizerSection(name="apollo", rank=8, scale_type="tensor", scale=2.0)) == \
        ApolloSettings(8, 2.0, 200, "tensor")


@pytest.mark.parametrize("override,says", [
    (["optimizer.name=apollo_mini", "optimizer.rank=4"], "optimizer.rank: apollo_mini is rank 1"),
    (["optimizer.name=apollo_mini", "optimizer.scale_type=channel"], "optimizer.scale_type"),
    (["optimizer.name=apollo", "optimizer.cpu_offload=true"], "cannot be combined with optimizer.cpu_offload"),
    (["optimizer.name=apollo_mini", "training.fsdp=true"], "cannot be combined with training.fsdp"),
])
def test_impossible_combinations_are_one_line(tmp_path, override, says):
    from test_recipe import BASE, write

    from lisaft.config.schema import load_recipe
    from lisaft.errors import LisaftError

    with pytest.raises(LisaftError) as e:
        load_recipe(write(tmp_path, BASE), override)
    assert says in str(e.value) and "\n" not in str(e.value)
