"""optimizer.cpu_offload stepping each unit as its gradients arrive (`step_as_ready`, where
training.max_grad_norm is null): on CPU the run is the one that steps after backward, bit for bit
(weights, moments, gradient norms), for every moment type, and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from test_cpu_offload import ACCUM, CPU, assert_same, setup

from lisaft.checkpoint.optimizer_files import OptimizerFiles
from lisaft.config.schema import ModelSection
from lisaft.model.load import apply_model_settings


def train_step(h, step: int, early_seen: list) -> float | None:
    h.ctrl.activate_for_step(step)
    h.opts.set_lr(1e-3 * (1 + step % 3), step)
    measure = step % 2 == 0  # the loop measures the norm on logging steps only
    for m in range(ACCUM):
        if m == ACCUM - 1:
            h.opts.arm(h.ctrl.trainable_units(), measure)  # as the loop does (before_last_backward)
        x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(100 * step + m))
        (h.model(input_ids=x, labels=x).loss / ACCUM).backward()
    early_seen.append(len(h.opts._early))
    return h.opts.clip_and_step(h.ctrl.trainable_units(), None, measure_norm=measure)


def pair(tmp_path, name, dtype, moments="float32", lisa=False, sparse=False):
    runs = []
    for eager in (False, True):
        h = setup(tmp_path / str(eager), True, name, dtype, lisa=lisa, sparse=sparse, moments=moments)
        h.opts.step_as_ready = eager
        h.early = []
        runs.append(h)
    return runs


def run(h, start: int, stop: int) -> list:
    return [train_step(h, s, h.early) for s in range(start, stop)]


@pytest.mark.parametrize("name,moments,dtype", [
    ("adamw_32bit", "float32", torch.float32), ("adamw_32bit", "float32", torch.bfloat16),
    ("adamw_32bit", "bfloat16", torch.bfloat16), ("adamw_8bit", "float32", torch.bfloat16)],
    ids=["m32-fp32", "m32-bf16", "m16-bf16", "m8-bf16"])
@pytest.mark.parametrize("lisa", [False, True], ids=["full", "lisa"])
def test_stepping_as_gradients_arrive_is_the_same_run(tmp_path, name, moments, dtype, lisa):
    after, early = pair(tmp_path, name, dtype, moments, lisa)
    norms = run(after, 0, 4)
    assert run(early, 0, 4) == norms and norms[0] is not None and norms[1] is None
    assert_same(after, early)
    assert not any(after.early) and all(n > 0 for n in early.early)  # units did start in backward
    assert not any(p.grad is not None for u in early.opts.units.values() for p in u.params)


def test_recomputed_layers_read_the_weights_before_the_step(tmp_path):
    """Gradient checkpointing: backward recomputes each layer's forward (its pre-hook runs again)
    while the layers above it are already stepping; the run stays the one that steps after."""
    after, early = pair(tmp_path, "adamw_8bit", torch.bfloat16)
    for h in (after, early):
        apply_model_settings(h.model, ModelSection(name_or_path="x", gradient_checkpointing=True), CPU)
    assert run(after, 0, 3) == run(early, 0, 3)
    assert_same(after, early)
    assert all(n > 0 for n in early.early)


def test_sparse_embedding_gradients_step_as_they_arrive(tmp_path):
    after, early = pair(tmp_path, "adamw_32bit", torch.bfloat16, sparse=True)
    assert run(after, 0, 3) == run(early, 0, 3)
    assert_same(after, early)


@pytest.mark.parametrize("name,moments", [("adamw_8bit", "float32"), ("adamw_32bit", "bfloat16")], ids=["m8", "m16"])
def test_checkpoint_between_early_steps_resumes_exactly(tmp_path, name, moments):
    """A checkpoint is written after clip_and_step returned, with units still stepping: each
    unit's state is read once its step is done (host_state waits), so the files are the step's."""
    _, early = pair(tmp_path, name, torch.bfloat16, moments, lisa=True)
    run(early, 0, 3)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    OptimizerFiles(early.opts, early.ctrl).write(folder, base=None)
    early.opts.wait()
    weights = {k: v.clone() for k, v in early.model.state_dict().items()}
    resumed = setup(tmp_path / "r", True, name, torch.bfloat16, lisa=True, moments=moments)
    resumed.opts.step_as_ready, resumed.early = True, []
    resumed.model.load_state_dict(weights)
    resumed.ctrl.load_state_dict(early.ctrl.state_dict())
    OptimizerFiles(resumed.opts, resumed.ctrl).read(folder)
    assert run(early, 3, 6) == run(resumed, 3, 6)
    assert_same(early, resumed)
