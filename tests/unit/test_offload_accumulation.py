"""optimizer.offload_accumulation and offload_group_size: how null resolves, and the one-line
refusals where the layer-major backward does not apply (lisaft/config/compat.py)."""

from pathlib import Path

import pytest
import yaml

from lisaft.config.compat import offload_accumulation
from lisaft.config.schema import load_recipe
from lisaft.errors import LisaftError
from lisaft.memory.layer_major import group_size, groups

BASE = {
    "model": {"config": "cfg/config.json", "tokenizer": "tok"},
    "data": {"train": "data/train.jsonl", "format": "instruction"},
    "training": {"max_steps": 10, "output_dir": "runs/x", "grad_accum_steps": 8},
    "optimizer": {"cpu_offload": True},
}


def _load(tmp_path: Path, *overrides: str):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return load_recipe(path, list(overrides))


@pytest.mark.parametrize("overrides, resolved", [
    ((), "device"),
    (("training.grad_accum_steps=1",), "host"),
    (("lisa.enabled=true",), "host"),
    (("model.gradient_checkpointing=true", "model.offload_activations=true"), "host"),
    (("optimizer.offload_accumulation=host",), "host"),
    (("optimizer.offload_accumulation=device", "training.grad_accum_steps=1"), "device"),
    (("optimizer.cpu_offload=false",), None),
])
def test_null_resolves_to_device_for_full_fine_tuning_with_accumulation(tmp_path, overrides, resolved):
    assert offload_accumulation(_load(tmp_path, *overrides)) == resolved


@pytest.mark.parametrize("overrides, names", [
    (("optimizer.cpu_offload=false", "optimizer.offload_accumulation=device"), "cpu_offload true"),
    (("lisa.enabled=true", "optimizer.offload_accumulation=device"), "use host"),
    (("model.gradient_checkpointing=true", "model.offload_activations=true",
      "optimizer.offload_accumulation=device"), "model.offload_activations false"),
    (("optimizer.offload_accumulation=host", "optimizer.offload_group_size=2"), "set it null"),
    (("lisa.enabled=true", "optimizer.offload_group_size=2"), "set it null"),
])
def test_device_where_it_cannot_apply_is_one_line(tmp_path, overrides, names):
    with pytest.raises(LisaftError) as e:
        _load(tmp_path, *overrides)
    message = str(e.value)
    assert "\n" not in message and "optimizer.offload_" in message and names in message


def test_group_size_from_the_host_budget():
    assert group_size(32, 100, None) == 32  # the RAM not known: the whole step
    assert group_size(32, 100, 1050) == 10
    assert group_size(32, 100, 50) == 1  # never fewer than one
    assert group_size(32, 100, 10**9) == 32
    assert group_size(32, 100, 50, asked=4) == 4 and group_size(8, 100, None, asked=64) == 8
    assert groups(32, 10) == 4 and groups(8, 8) == 1
