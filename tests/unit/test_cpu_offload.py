"""optimizer.cpu_offload on CPU (host = device): the offloaded unit optimizers train bit for bit
like the device-resident ones, for every optimizer, in float32 and bfloat16, with gradient
accumulation, clipping, LISA, sparse embedding gradients and a checkpoint round trip.

The loop here mirrors the trainer's step (forward, backward per micro-batch, clip by the global
norm, step the trainable units); the trainer's own loop is tested in tests/integration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _tiny import tiny as _tiny

from lisaft.checkpoint.optimizer_files import OptimizerFiles
from lisaft.config.schema import LisaSection, OptimizerSection
from lisaft.lisa import LisaController
from lisaft.model.parts import model_parts
from lisaft.model.units import model_units
from lisaft.optim.cpu_offload import OffloadedOptimizers
from lisaft.optim.gradients import clip_grad_norm
from lisaft.optim.unit_optimizers import UnitOptimizers

CPU = torch.device("cpu")
NAMES = ["adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit"]
ACCUM = 2
MAX_NORM = 0.5  # small enough that the tiny model's gradients are clipped


def setup(tmp_path, offload: bool, name="adamw_32bit", dtype=torch.float32, lisa=False, sparse=False,
          moments="float32", compiled=False):
    model = _tiny(0, 4).to(dtype)
    model.get_input_embeddings().sparse = sparse
    layers = model_parts(model).layers
    if compiled:  # as training.compile does (lisaft.model.load.compile_layers), with no C++ compiler
        for layer in layers:
            layer.compile(backend="eager")
    units = model_units(model_parts(model))
    section = OptimizerSection(name=name, lr=1e-3, weight_decay=0.1, cpu_offload=offload, moments_dtype=moments)
    cls = OffloadedOptimizers if offload else UnitOptimizers
    opts = cls(units, section, CPU, tmp_path / ("off" if offload else "dev"), seed=3)
    if offload:
        opts.wait_in_forward(model, layers)  # as the session does, before the first forward
    ctrl = LisaController(units, opts, LisaSection(enabled=lisa, active_layers=2, interval_steps=2), seed=3)
    return SimpleNamespace(model=model, opts=opts, ctrl=ctrl, offload=offload)


def train_step(h, step: int) -> float | None:
    h.ctrl.activate_for_step(step)
    h.opts.set_lr(1e-3 * (1 + step % 3), step)
    for m in range(ACCUM):
        x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(100 * step + m))
        (h.model(input_ids=x, labels=x).loss / ACCUM).backward()
    if h.offload:
        return h.opts.clip_and_step(h.ctrl.trainable_units(), MAX_NORM, measure_norm=True)
    trainable = h.ctrl.trainable_parameters()
    for p in trainable:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = p.grad.coalesce()
    norm = clip_grad_norm(trainable, MAX_NORM)
    h.opts.step(h.ctrl.trainable_units())
    return norm


def run(h, start: int, stop: int) -> list:
    return [train_step(h, s) for s in range(start, stop)]


def assert_same(a, b) -> None:
    for h in (a, b):
        if h.offload:
            h.opts.wait()  # as the loop does before it reads weights outside a forward
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    for name in a.opts.units:
        sa, sb = a.opts.host_state(name), b.opts.host_state(name)
        assert (sa is None) == (sb is None), name
        if sa is None:
            continue
        for i, st in sa["state"].items():
            for k, v in st.items():
                w = sb["state"][i][k]
                assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (name, i, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_offloaded_full_fine_tuning_is_the_device_run_bit_for_bit(tmp_path, name, dtype):
    dev, off = setup(tmp_path, False, name, dtype), setup(tmp_path, True, name, dtype)
    assert run(dev, 0, 3) == run(off, 0, 3)
    assert_same(dev, off)
    # Nothing of the optimizer, and no gradient, is left on the training device.
    assert off.opts.state_bytes()[0] == 0 and off.opts.state_bytes()[1] > 0
    assert all(p.grad is None for p in off.model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
def test_offloaded_lisa_is_the_device_run_bit_for_bit(tmp_path, name, dtype):
    dev, off = setup(tmp_path, False, name, dtype, lisa=True), setup(tmp_path, True, name, dtype, lisa=True)
    # Five steps cross two interval boundaries: units leave and rejoin the trainable set.
    assert run(dev, 0, 5) == run(off, 0, 5)
    assert_same(dev, off)
    frozen = [u for u in off.ctrl.units if u not in off.ctrl.trainable_units()]
    assert frozen and not any(h in off.opts._acc for u in frozen for h in off.opts.units[u.name].params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_bf16_moments_offloaded_are_the_resident_run_bit_for_bit(tmp_path, dtype, sparse):
    dev = setup(tmp_path, False, "adamw_32bit", dtype, lisa=True, sparse=sparse, moments="bfloat16")
    off = setup(tmp_path, True, "adamw_32bit", dtype, lisa=True, sparse=sparse, moments="bfloat16")
    assert run(dev, 0, 3) == run(off, 0, 3)
    assert_same(dev, off)
    states = [st for name in off.opts.units if (sd := off.opts.host_state(name)) for st in sd["state"].values()]
    assert states and all(st["exp_avg_sq"].dtype == torch.bfloat16 for st in states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_embedding_gradients_stay_exact(tmp_path, dtype):
    dev = setup(tmp_path, False, "adamw_32bit", dtype, sparse=True)
    off = setup(tmp_path, True, "adamw_32bit", dtype, sparse=True)
    assert run(dev, 0, 2) == run(off, 0, 2)
    assert_same(dev, off)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,moments", [("adamw_8bit", "float32"), ("adamw_32bit", "bfloat16"),
                                          ("adamw_32bit", "float32")], ids=["8bit", "bf16-moments", "fp32-moments"])
def test_checkpoint_round_trip_resumes_exactly(tmp_path, dtype, name, moments):
    """The same optimizer/<unit>.pt files as the device path, and a run restored from them
    continues as the uninterrupted one."""
    dev = setup(tmp_path, False, name, dtype, lisa=True, moments=moments)
    off = setup(tmp_path, True, name, dtype, lisa=True, moments=moments)
    run(dev, 0, 3)
    run(off, 0, 3)
    folders = {}
    for h, tag in ((dev, "dev"), (off, "off")):
        folders[tag] = tmp_path / f"ckpt-{tag}"
        folders[tag].mkdir()
        OptimizerFiles(h.opts, h.ctrl).write(folders[tag], base=None)
    assert sorted(f.name for f in folders["dev"].iterdir()) == sorted(f.name for f in folders["off"].iterdir())
    off.opts.wait()
    weights = {k: v.clone() for k, v in off.model.state_dict().items()}
    ctrl_state = off.ctrl.state_dict()

    resumed = setup(tmp_path / "r", True, name, dtype, lisa=True, moments=moments)
    resumed.model.load_state_dict(weights)  # what the loop does before loading optimizer state
    resumed.ctrl.load_state_dict(ctrl_state)
    OptimizerFiles(resumed.opts, resumed.ctrl).read(folders["off"])
    assert run(off, 3, 6) == run(resumed, 3, 6)
    assert_same(off, resumed)


def test_host_memory_is_accounted(tmp_path):
    """Weight copies and accumulators are carved from slabs (lisaft/optim/host_arena.py): what they hold is
    the slabs' size, which arena_bytes predicts from the tensor sizes alone."""
    from lisaft.optim.host_arena import arena_bytes, slab_size

    off = setup(tmp_path, True, "adamw_32bit", torch.bfloat16)
    run(off, 0, 1)
    sizes = [2 * h.numel() for u in off.opts.units.values() for h in u.params]
    slab = slab_size(max(sizes), sum(sizes))
    held = off.opts.host_bytes()
    assert held["host_weights"] == arena_bytes(sizes, slab) >= sum(sizes)
    assert held["grad_accumulators"] == arena_bytes(sizes[::-1], slab)
    assert off.opts.state_bytes() == (0, 8 * sum(sizes) // 2)


@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
def test_units_stepped_side_by_side_give_the_same_run(tmp_path, name):
    """Several units step at once on worker threads: each re-seeds its own rounding generator,
    so the bf16 run is still the device run bit for bit."""
    dev, off = setup(tmp_path, False, name, torch.bfloat16), setup(tmp_path, True, name, torch.bfloat16)
    off.opts.step_threads = 3
    assert run(dev, 0, 3) == run(off, 0, 3)
    assert_same(dev, off)
    assert off.opts._step_pool is not None


def test_rounding_noise_is_per_thread(monkeypatch):
    """Two threads writing bf16 weights at once get each their own key's noise, even when both
    have seeded before either draws (a generator shared between them would not)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from lisaft.optim.rounding import Rounding

    rounding = Rounding("stochastic", seed=5)
    src = torch.rand(4096) * 1e-3 + 1.0

    def write(key: int) -> torch.Tensor:
        out = torch.empty(src.shape, dtype=torch.bfloat16)
        rounding.write(out, src.clone(), key)
        return out

    alone = [write(0), write(1)]
    barrier, draw = threading.Barrier(2, timeout=30), torch.randint

    def draw_together(*args, **kwargs):
        barrier.wait()
        return draw(*args, **kwargs)

    monkeypatch.setattr(torch, "randint", draw_together)
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(write, [0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


@pytest.mark.parametrize("lisa", [False, True], ids=["full", "lisa"])
@pytest.mark.parametrize("name", ["adamw_32bit", "adamw_8bit"])
def test_overlapped_steps_give_the_same_run(tmp_path, monkeypatch, name, lisa):
    """With `overlap` the step returns at once and the next forward waits, module by module, for
    the units whose weights it reads: a wait missing anywhere would read stale weights. Each
    unit's step is slowed so that the forward always catches up with it."""
    import time

    from lisaft.optim import adamw as optim

    step = optim.AdamW.step

    def slow_step(self, *args, **kwargs):
        time.sleep(0.005)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(optim.AdamW, "step", slow_step)
    dev = setup(tmp_path, False, name, torch.bfloat16, lisa=lisa)
    off = setup(tmp_path, True, name, torch.bfloat16, lisa=lisa)
    off.opts.step_threads = 2
    assert off.opts.overlap  # the default
    assert run(dev, 0, 5) == run(off, 0, 5)
    assert off.opts._in_flight  # the last step is still running or unclaimed
    assert_same(dev, off)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_next_forward_waits_for_every_unit_in_flight(tmp_path, compiled):
    """training.compile with cpu_offload: a wait that dynamo never calls inside a compiled layer
    lets a forward read weights the copy back is still writing. The forward after an overlapped
    step must claim every unit's step, compiled layers or not, and give the eager run's losses."""
    torch._dynamo.reset()
    dev = setup(tmp_path, False)
    off = setup(tmp_path, True, compiled=compiled)
    off.opts.step_threads = 2
    waited: list[str] = []
    wait_unit = off.opts._wait_unit

    def counted(name):
        if name in off.opts._in_flight:
            waited.append(name)
        wait_unit(name)

    off.opts._wait_unit = counted
    for step in range(3):
        assert train_step(dev, step) == pytest.approx(train_step(off, step), rel=1e-5)
        assert set(off.opts._in_flight) == set(off.opts.units)
        waited.clear()
        with torch.no_grad():
            x = torch.arange(12).view(1, 12)
            assert torch.allclose(off.model(input_ids=x).logits, dev.model(input_ids=x).logits, atol=1e-5)
        assert sorted(waited) == sorted(off.opts.units) and not off.opts._in_flight
    torch._dynamo.reset()


class _Copy:
    """A stand-in CUDA event for a copy the link has not finished until someone waits for it:
    the worst case, a backward that outruns the link."""

    queued: list[_Copy] = []

    def __init__(self, blocking=False):
        assert blocking, "a spinning event would hold a core while the host waits"
        self.done, self.nbytes = False, 0
        _Copy.queued.append(self)

    def record(self, stream):
        pass

    def synchronize(self):
        self.done = True


@pytest.mark.parametrize("accum", [1, 3])
def test_gradient_bytes_in_flight_are_bounded_in_every_micro_batch(monkeypatch, accum):
    """The copies of a CUDA backward (logic run on CPU with stand-in streams and events): at no
    time, in the first micro-batch or a later one, do more than `limit` bytes wait for the link,
    and each accumulator ends as the sum of its gradients."""
    import contextlib
    from concurrent.futures import Future

    from lisaft.optim import transfers

    class Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            for c in _Copy.queued:
                c.synchronize()

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Copy)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(transfers.Transfers, "_hold", lambda self, g: None)
    monkeypatch.setattr(transfers, "STAGING_SLOTS", 2)
    _Copy.queued = []
    t = transfers.Transfers(torch.device("cuda"), slot_bytes=256)
    copy, peak = t._copy, [0]

    def counted(dst, src):
        event = copy(dst, src)
        event.nbytes = src.numel() * src.element_size()
        peak[0] = max(peak[0], sum(c.nbytes for c in _Copy.queued if not c.done))
        return event

    monkeypatch.setattr(t, "_copy", counted)
    grads = [[torch.randn(n) for n in (300, 40, 1000, 64)] for _ in range(accum)]
    accs = [torch.zeros(n) for n in (300, 40, 1000, 64)]
    for m, micro in enumerate(grads):
        marks = [t.gradient(g, acc, add=m > 0) for g, acc in zip(micro, accs)]
    for i, acc in enumerate(accs):
        expect = grads[0][i].clone()
        for micro in grads[1:]:
            expect += micro[i]
        # What a unit stepped as its gradients arrive waits for: its own accumulators complete.
        transfers.Transfers.complete(marks[i])
        assert marks[i] and all(k.done() if isinstance(k, Future) else k.done for k in marks[i])
        assert torch.equal(acc, expect)
    t.drain()
    assert 0 < peak[0] <= t.limit == 512  # 16 KiB of gradients queued, never more than 512 B


def test_gradients_and_weights_take_separate_streams(monkeypatch):
    """Gradients out and weights in run on two side streams (with units stepped as their
    gradients arrive, weights going in would otherwise queue behind gradients going out), and
    the next forward waits for the weights' stream."""
    import contextlib

    from lisaft.optim import transfers

    class Stream:
        def __init__(self):
            self.waited = []

        def wait_stream(self, other):
            self.waited.append(other)

    compute, used = Stream(), []

    @contextlib.contextmanager
    def on(stream):
        used.append(stream)
        yield

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", _Copy)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(transfers.Transfers, "_hold", lambda self, g: None)
    t = transfers.Transfers(torch.device("cuda"), slot_bytes=256)
    acc, dev = torch.zeros(10), torch.zeros(10)
    t.gradient(torch.ones(10), acc, add=False)
    t.send([(dev, torch.full((10,), 2.0))])
    t.weights_ready()
    assert t.stream is not t.weights_stream and used == [t.stream, t.weights_stream]
    assert compute.waited == [t.weights_stream] and torch.equal(acc, torch.ones(10)) and torch.equal(dev, acc * 2)


def test_step_workers_share_the_cpus(tmp_path, monkeypatch):
    """Units stepped side by side open one OpenMP and numba team between them, sized to the CPUs
    the process may use, not a team of the process's size each (threads x threads)."""
    import threading

    from lisaft.env import threads
    from lisaft.optim import adamw as optim
    from lisaft.optim import host_step

    teams: dict[str, set] = {}
    step, step_chunk = optim.AdamW.step, host_step.step_chunk

    def counted_step(self, *args, **kwargs):
        teams.setdefault(threading.current_thread().name, set()).add(("torch", torch.get_num_threads()))
        return step(self, *args, **kwargs)

    def counted_chunk(*args, **kwargs):
        step_chunk(*args, **kwargs)
        if host_step.available():
            numba = host_step._kernel.numba
            teams[threading.current_thread().name].add(("numba", numba.get_num_threads()))

    monkeypatch.setattr(optim.AdamW, "step", counted_step)
    monkeypatch.setattr(host_step, "step_chunk", counted_chunk)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    monkeypatch.setattr(host_step, "SERIAL_BELOW", 0)  # the tiny model's tensors would step on one thread
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        off = setup(tmp_path, True, "adamw_32bit", torch.bfloat16)
        off.opts.step_threads = 2
        run(off, 0, 2)
        off.opts.wait()
    finally:
        torch.set_num_threads(before)
    assert len(teams) == 2 and all(name.startswith("lisaft-cpu-step") for name in teams)
    expected = {("torch", 2), ("numba", 2)} if host_step.available() else {("torch", 2)}
    assert all(seen == expected for seen in teams.values()), teams
