"""training.compile: decoder layers compiled in place, names and weights unchanged; a one-line
error where torch.compile cannot run."""

import shutil

import pytest
import torch
from _tiny import tiny

from lisaft.errors import LisaftError
from lisaft.model.load import compile_layers
from lisaft.model.parts import model_parts


def test_layers_compile_in_place_with_the_same_names_and_weights():
    model = tiny(layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = model_parts(model).layers
    compile_layers(layers, torch.device("cpu"))
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # Regional: each layer carries its own compiled call; the model itself stays eager.
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert model._compiled_call_impl is None


def test_no_cpu_compiler_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(LisaftError) as e:
        compile_layers(model_parts(tiny(layers=1)).layers, torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("training.compile:") and "training.compile false" in msg


@pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="no C++ compiler")
def test_compiled_layers_match_eager_and_lisa_switches_reuse_two_graphs():
    # Every layer runs the same compiled code; a LISA switch only flips requires_grad, which
    # costs one more graph (frozen and trainable), not one per layer or per interval: past
    # dynamo's recompile limit a layer would silently fall back to eager.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = tiny(layers=6), tiny(layers=6)
    for m in (eager, compiled):
        m.config.use_cache = False
    compile_layers(model_parts(compiled).layers, torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for active in ([1, 4], [0, 2], [3, 5], [2, 4]):
        grads = []
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
            for i, layer in enumerate(model_parts(m).layers):
                layer.requires_grad_(i in active)
            m(input_ids=ids, labels=ids).loss.backward()
            grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys()
        for n, g in grads[0].items():
            assert torch.allclose(g, grads[1][n], rtol=1e-4, atol=1e-6), n
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_torchs_own_jit_deprecation_stays_out_of_the_test_output():
    """torch warns when torch.utils.mkldnn is imported (by inductor and torch.fx passes, which
    torch.compile and bitsandbytes reach): nothing lisaft can change, so the tests filter it."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("`torch.jit.script_method` is deprecated. Please switch to `torch.compile` or "
                      "`torch.export`.", DeprecationWarning, stacklevel=1)
    assert caught == []
