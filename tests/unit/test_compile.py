"""training.compile: decoder layers compiled in place, names and weights unchanged; a one-line
error where torch.compile cannot run."""

import shutil

import pytest
import torch

from _tiny import tiny

from lisaft.errors import LisaftError
from lisaft.models import compile_layers, model_parts


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
