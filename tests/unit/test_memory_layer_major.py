"""The estimator's layer-major terms (lisaft/memory/layer_major.py) on the shipped 8B full recipe:
the GPU within 21.5 GiB, the group chosen from the RAM, `host` as it was, the step from bandwidth."""

from pathlib import Path

import pytest

from lisaft.config.schema import load_recipe
from lisaft.memory.command import settings_from_recipe
from lisaft.memory.estimate import compute
from lisaft.memory.layer_major import RTX_4090_PCIE4_DDR5, layer_major_lines, step_seconds
from lisaft.memory.settings import GiB

FULL = Path(__file__).parents[2] / "recipes" / "llama3.1-8b-full-24gb.yaml"


def _estimate(ram_gib: float, *overrides: str):
    return compute(settings_from_recipe(load_recipe(FULL, list(overrides))).with_(host_budget_bytes=int(ram_gib * GiB)))


def test_the_8b_full_recipe_runs_layer_major_within_21_5_gib():
    e = _estimate(64)
    t = e.layer_major
    assert t is not None and e.total_bytes <= 21.5 * GiB and e.fits
    assert t.saved_inputs == 32 * 2048 * 4096 * 2  # 16 MiB a layer for a 2,048-token micro-batch
    assert e.host_components["layer_inputs"] == t.group * t.saved_inputs
    # The group is the most micro-batches 90% of the RAM holds beside the rest of the host memory.
    rest = e.host_bytes - e.host_components["layer_inputs"]
    assert rest + t.group * t.saved_inputs <= 0.9 * 64 * GiB < rest + (t.group + 1) * t.saved_inputs
    assert (t.group, t.groups) == (17, 2)
    assert _estimate(256).layer_major.groups == 1  # the whole step in one group: no host addition
    assert _estimate(256, "optimizer.offload_group_size=8").layer_major.groups == 4


def test_host_is_the_micro_batch_major_estimate_as_before():
    e = _estimate(64, "optimizer.offload_accumulation=host")
    assert e.layer_major is None and "embedding_backward" not in e.phases
    assert f"{e.total_bytes / GiB:.2f}" == "19.85" and f"{e.host_bytes / GiB:.2f}" == "48.68"


@pytest.mark.parametrize("groups", [0, 1, 2])
def test_step_time_from_bandwidth(groups):
    n, g, s = 8 * 10**9, 16 * 10**9, 512 * 2**20
    p = step_seconds(n, g, 65536, 32, RTX_4090_PCIE4_DDR5, s, groups, clipping=False)
    assert p["gpu_s"] == pytest.approx(8 * n * 65536 / RTX_4090_PCIE4_DDR5.matmul_flops_per_s)
    out = 32 * g if groups == 0 else groups * g + 32 * s
    assert p["link_s"] == pytest.approx(max(out, (32 * s if groups else 0) + g) / 25e9)
    assert p["host_additions"] == (31 if groups == 0 else groups - 1)
    assert p["step_s"] == max(p["gpu_s"], p["link_s"], p["host_memory_s"]) and p["cpu_step_exposed_s"] == 0
    assert p["serial_s"] == pytest.approx(p["gpu_s"] + p["link_s"] + p["host_memory_s"])


def test_explain_shows_both_paths():
    text = layer_major_lines(_estimate(64), explain=True)
    assert "17 of 32 micro-batches per group, 2 groups a step (1 host addition of each gradient)" in text
    assert "  device: GPU 36.5 s" in text and "  host: GPU 36.5 s" in text and "(31 additions)" in text
