"""The suite's markers: `slow` and `gpu` are registered (an unknown marker is an error), and every
`gpu` test is skipped where torch sees no GPU, so CI on CPU runs the rest."""

import torch


def test_slow_and_gpu_are_registered_and_strict(request):
    names = {line.split(":")[0].strip() for line in request.config.getini("markers")}
    assert {"slow", "gpu"} <= names
    assert "--strict-markers" in request.config.getini("addopts")


def test_every_gpu_test_skips_without_cuda(request):
    gpu = [item for item in request.session.items if item.get_closest_marker("gpu")]
    # The paged-state test of tests/unit/test_lisa.py is CUDA-only; collected with this test in the
    # full suite (alone, this module collects only itself).
    if any(item.module.__name__.endswith("test_lisa") for item in request.session.items):
        assert any("paged_state" in item.name for item in gpu)
    for item in gpu:
        skipped = any(m.name == "skip" for m in item.iter_markers())
        assert skipped == (not torch.cuda.is_available()), item.nodeid
