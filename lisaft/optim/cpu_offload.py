"""The optimizer on the CPU (`optimizer.cpu_offload`): ZeRO-Offload's design on lisaft's unit
optimizers.

The training device holds the weights and the activations, nothing else that scales with the
model. Each unit's optimizer is lisaft's own AdamW (lisaft/optim/adamw.py), built over host copies of
the unit's weights, so its moments are created, stepped, offloaded by LISA's state policy and
checkpointed (optimizer/<unit>.pt) exactly as the device-resident ones are: this class is a
UnitOptimizers whose units are the host copies.

A step, for each parameter:
1. backward: as soon as the parameter's gradient is complete (a post-accumulate-grad hook), it
   is copied to host memory and the device gradient is freed; over grad_accum_steps the copies
   are added into one host accumulator. On CUDA the copy runs on a side stream into pinned
   memory: the first micro-batch's lands in the accumulator itself, later ones in a small ring of
   pinned staging buffers that a worker thread adds into the accumulator once the copy is done,
   so the autograd thread never waits for the CPU. The addition is the host kernel's one pass
   over every core (host_step.accumulate; torch's add_ without numba, the same bits). In every
   micro-batch at most 1 GiB of copies is in flight: past it, backward waits for the link rather
   than pile up freed gradients.
2. the step: clipping by the true global norm over the host gradients (the same clip_grad_norm
   as the device path), then the unit optimizers' step on the CPU: torch's fused AdamW kernel
   (or bitsandbytes' CPU kernels for 8-bit moments) over whole tensors or chunks, never a Python
   loop over elements. Units step concurrently on `step_threads` threads (torch's thread count):
   bitsandbytes' CPU quantization and the rounding noise's generator run on one core each, so
   units side by side are what fills the cores. Each unit's update depends only on its own
   tensors and its own noise key, so the result does not depend on the order. Where nothing
   waits for the global norm (training.max_grad_norm null), `step_as_ready` starts each unit's
   step in the last micro-batch's backward, as soon as its gradients are complete: the same
   update, started while backward goes on below it (docs/memory.md, "Hiding the step").
3. the new weights go back to the device unit by unit on a second side stream while the CPU steps the
   next unit. With `overlap` (the default) the training loop does not wait: the next
   step's forward starts at once, and a forward pre-hook on each decoder layer (and on each other
   module with weights) waits for the unit that owns them (its CPU step, then its copy's event on
   the compute stream), so the CPU step of the upper layers runs while the GPU computes the lower
   ones and no forward reads a half-copied weight. The loop calls `wait()` before it reads weights any other way
   (checkpoints, the final model).

Accumulators and host weights keep the weight dtype: a bfloat16 gradient accumulates in bf16 on
the host exactly as autograd accumulates it in p.grad on the device, and a bf16 weight takes the
stochastically rounded update of the device path (noise keyed by the run's position), so on CPU
an offloaded run is bit for bit the run without offload. No float32 master copy: docs/memory.md
says why. Sparse embedding gradients are kept sparse on the host (added, then coalesced at the
step, as the device path does); their copy is synchronous, and small.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from lisaft import internals
from lisaft.config.schema import OptimizerSection
from lisaft.env.threads import team_pool
from lisaft.model.units import Unit
from lisaft.optim import host_step
from lisaft.optim.gradients import clip_grad_norm, grad_nbytes, tensor_norms, total_norm
from lisaft.optim.host_arena import HostArena, slab_size
from lisaft.optim.transfers import TransferCounts, Transfers, staging_slot_bytes
from lisaft.optim.unit_optimizers import UnitOptimizers


def _host_copy(p: nn.Parameter, arena: HostArena) -> nn.Parameter:
    host = arena.tensor(p.shape, p.dtype)
    host.copy_(p.detach())
    return nn.Parameter(host, requires_grad=False)


def _waiter(opts: OffloadedOptimizers, names: list[str]):
    """A forward pre-hook that waits for `names`' steps in flight. Outside any compiled graph:
    dynamo calls it, eagerly, even inside a layer compiled with training.compile; a hook that
    dynamo never saw (one added after the layer was traced) would be skipped silently."""
    ref = weakref.ref(opts)

    @torch.compiler.disable
    def hook(module: nn.Module, args) -> None:
        o = ref()
        if o is not None:
            o.wait_units(names)

    return hook


class OffloadedOptimizers(UnitOptimizers):
    """UnitOptimizers over host copies of the units, fed by gradients streamed out in backward.

    The training loop calls `clip_and_step` (or `step`) after the last micro-batch's backward,
    as it would for device optimizers; LISA's controller switches units by name as before."""

    def __init__(self, units: list[Unit], section: OptimizerSection, device: torch.device,
                 offload_dir: Path, seed: int) -> None:
        self.train_device = torch.device(device)
        cuda = self.train_device.type == "cuda"
        sizes = [p.numel() * p.element_size() for u in units for p in u.params]
        slab = slab_size(max(sizes, default=0), sum(sizes))
        # Pinned on CUDA, so the copies run asynchronously; slabs, so pinning rounds up nothing.
        weights_arena, self._acc_arena = HostArena(slab, cuda), HostArena(slab, cuda)
        host_units = [Unit(u.name, u.index, [_host_copy(p, weights_arena) for p in u.params], u.layer)
                      for u in units]
        super().__init__(host_units, section, torch.device("cpu"), offload_dir, seed)
        self._weights_arena = weights_arena
        self._device_units = {u.name: u for u in units}
        self._host_of: dict[torch.Tensor, nn.Parameter] = {
            p: h for u, hu in zip(units, host_units) for p, h in zip(u.params, hu.params)}
        self._acc: dict[nn.Parameter, torch.Tensor] = {}
        # Accumulators of units LISA froze, by (shape, dtype), for the next unit that trains.
        self._spare: dict[tuple, list[torch.Tensor]] = {}
        self.transfers = Transfers(self.train_device, staging_slot_bytes(max(sizes, default=64))) if cuda else None
        # The host kernel spreads each unit over every core itself: units then go one at a time,
        # lowest first, which is the order the next forward needs them in.
        self.step_threads = 1 if host_step.available() else torch.get_num_threads()
        self.overlap = True
        self._unit_name: dict[torch.Tensor, str] = {p: u.name for u in units for p in u.params}
        self._in_flight: dict[str, Future] = {}
        self._first_steps: set[str] = set()  # units whose moments the steps in flight create
        self._step_index = 0
        self._step_pool: ThreadPoolExecutor | None = None
        self._step_pool_size = 0
        # Set by the session where nothing waits for the global norm (training.max_grad_norm null,
        # on_nonfinite stop): `arm` then has each unit step as soon as its gradients are complete.
        self.step_as_ready = False
        self._armed: dict[str, set[torch.Tensor]] = {}  # unit -> parameters whose gradient is still due
        self._early: dict[str, list] = {}  # units started in backward -> their gradient norms (measured)
        self._measure = False
        self._marks: dict[torch.Tensor, list] = {}  # CUDA: what marks a host accumulator complete
        self._grad_hooks = []
        self._forward_hooks: list = []  # wait_in_forward's; without them a step waits for itself
        self.counts = TransferCounts()
        # The layer-major backward (lisaft/train/layer_major.py) sums gradients on the device and
        # ships each one itself (`ship`): the hook leaves them in .grad meanwhile.
        self._hold = False
        for p in self._host_of:
            trains = p.requires_grad  # torch hooks only tensors that require grad; frozen units too
            p.requires_grad_(True)
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._gradient_ready))
            p.requires_grad_(trains)

    # -- backward -------------------------------------------------------------------------------

    def _gradient_ready(self, p: torch.Tensor) -> None:
        if not self._hold:
            self._ship(p)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Gradients stay in the device's .grad, summed there, until `ship` sends them."""
        self._hold = True
        try:
            yield
        finally:
            self._hold = False

    def ship(self, params: list[nn.Parameter]) -> None:
        """Send the gradients summed on the device to the host accumulators, as the hook does."""
        for p in params:
            self._ship(p)

    def _ship(self, p: torch.Tensor) -> None:
        self._wait_unit(self._unit_name[p])  # its accumulators are the step's gradients until then
        g, p.grad = p.grad, None
        assert g is not None, "called by the post-accumulate-grad hook"
        host = self._host_of[p]
        self.counts.d2h_bytes += grad_nbytes(g)
        if g.is_sparse:
            g = g.cpu()
            if host.grad is not None:
                self.counts.host_grad_additions += internals.sparse_sizes(g)[0]
            host.grad = g if host.grad is None else host.grad + g
        else:
            self._accumulate(host, g)
        due = self._armed.get(self._unit_name[p])
        if due is not None:
            due.discard(p)
            if not due:
                self._start_early(self._device_units[self._unit_name[p]])

    def _accumulate(self, host: nn.Parameter, g: torch.Tensor) -> None:
        acc = self._acc.get(host)
        if acc is None:
            spare = self._spare.get((host.shape, g.dtype))
            acc = self._acc[host] = spare.pop() if spare else self._acc_arena.tensor(host.shape, g.dtype)
        first = host.grad is None
        if first:
            host.grad = acc  # filled below, complete after drain()
        else:
            self.counts.host_grad_additions += g.numel()
        if self.transfers is not None:
            self._marks[host] = self.transfers.gradient(g, acc, add=not first)
        elif first:
            acc.copy_(g)
        else:
            host_step.accumulate(acc, g)

    def drain(self) -> None:
        if self.transfers is not None:
            self.transfers.drain()

    # -- the step -------------------------------------------------------------------------------

    def optimizer(self, unit: Unit):
        return super().optimizer(self.units[unit.name])

    def set_lr(self, lr: float, step: int) -> None:
        # Units of the previous step may still be stepping with their own rate and noise key:
        # the new ones are applied when this step's update starts (clip_and_step).
        self.lr, self._step_index = lr, step

    def step(self, units: list[Unit]) -> None:
        self.clip_and_step(units, max_norm=None, measure_norm=False)

    def arm(self, units: list[Unit], measure_norm: bool) -> None:
        """Before the last micro-batch's backward, with `step_as_ready`: each of `units` steps on
        the CPU workers as soon as its last gradient is in, while backward goes on below it. The
        same update as after backward (nothing it reads changes later), so the run is the same."""
        if not self.step_as_ready:
            return
        self.wait()  # the previous step's units (the forward has claimed them already)
        self.rounding.step = self._step_index
        self._first_steps, self._early, self._measure = set(), {}, measure_norm
        self._armed = {u.name: {p for p in u.params if p.requires_grad} for u in units}

    def _start_early(self, unit: Unit) -> None:
        del self._armed[unit.name]
        (opt,) = self._begin([unit])
        self._early[unit.name] = []
        self._in_flight[unit.name] = self._pool().submit(self._step_early, unit, opt)

    def _step_early(self, unit: Unit, opt) -> torch.cuda.Event | None:
        hosts = [self._host_of[p] for p in unit.params]
        if self.transfers is not None:  # this unit's copies and additions only
            for h in hosts:
                self.transfers.complete(self._marks.pop(h, []))
        self._coalesce(hosts)
        if self._measure:
            self._early[unit.name] = tensor_norms(hosts)
        return self._step_unit(unit, opt)

    def _begin(self, units: list[Unit]) -> list:
        """Each unit's optimizer, readied in the calling thread (never in the workers)."""
        self.changes.bump(u.name for u in units)  # before a checkpoint could ask, step in flight or not
        # The weights each step sends back (_step_unit), counted here, in the step's own thread.
        self.counts.h2d_bytes += sum(grad_nbytes(h) for u in units for p in u.params
                                     if (h := self._host_of[p]).grad is not None)
        optimizers = [self.optimizer(u) for u in units]
        self._first_steps |= {u.name for u, opt in zip(units, optimizers) if not opt.state}
        for opt in optimizers:
            self._set_group_lr(opt)
        return optimizers

    @staticmethod
    def _coalesce(hosts: list[nn.Parameter]) -> None:
        for h in hosts:
            if h.grad is not None and h.grad.is_sparse:
                h.grad = h.grad.coalesce()  # sum repeated tokens' rows once, as the device path

    def clip_and_step(self, units: list[Unit], max_norm: float | None, measure_norm: bool,
                      skip_nonfinite: bool = False) -> float | None:
        """Clip by the global norm of the host gradients, step each unit on the CPU and send its
        weights back (without waiting for either with `overlap`). Returns the norm before
        clipping when measured. skip_nonfinite: a NaN or inf norm drops the gradients, no step.
        Units that `arm` started in backward are stepping already; the rest step here."""
        early, self._armed = self._early, {}
        for name in [n for n in self._in_flight if n not in early]:
            self._wait_unit(name)
        self.drain()
        rest = [u for u in units if u.name not in early]
        hosts = [self._host_of[p] for u in rest for p in u.params]
        self._coalesce(hosts)
        measure = max_norm is not None or measure_norm or skip_nonfinite
        if early:  # armed only where nothing clips or skips, told whether the norm is measured
            assert max_norm is None and not skip_nonfinite and (self._measure or not measure_norm)
            norm = self._early_norm(units) if measure else None
        else:
            norm = clip_grad_norm(hosts, max_norm) if measure else None
        if skip_nonfinite and norm is not None and not math.isfinite(norm):
            for h in hosts:
                h.grad = None
            return norm
        self.rounding.step = self._step_index
        if not early:
            self._first_steps = set()
        optimizers = self._begin(rest)  # created here, not in the workers
        self._early = {}
        if not early and not self.overlap and (self.step_threads <= 1 or len(units) <= 1):
            for unit, opt in zip(rest, optimizers):
                self._step_unit(unit, opt)
        else:
            pool = self._pool()
            self._in_flight.update({u.name: pool.submit(self._step_unit, u, opt) for u, opt in zip(rest, optimizers)})
            if self.overlap and self._forward_hooks:
                return norm
            self.wait()
        if self.transfers is not None:
            self.transfers.weights_ready()
        return norm

    def _early_norm(self, units: list[Unit]) -> float:
        """The global norm, with the started units' norms from their workers (waited for: a
        measured step exposes their updates), the others' from their gradients, in order."""
        norms = []
        for u in units:
            if u.name in self._early:
                job = self._in_flight.get(u.name)
                if job is not None:
                    job.result()
                norms += self._early[u.name]
            else:
                norms += tensor_norms([self._host_of[p] for p in u.params])
        return total_norm(norms)

    def _pool(self) -> ThreadPoolExecutor:
        size = max(1, self.step_threads)
        if self._step_pool is None or self._step_pool_size != size:
            if self._step_pool is not None:
                self._step_pool.shutdown()
            # Each worker gets its share of the CPUs: N workers with N-thread teams would spin N x N.
            self._step_pool = team_pool(size, "lisaft-cpu-step")
            self._step_pool_size = size
        return self._step_pool

    def _step_unit(self, unit: Unit, opt) -> torch.cuda.Event | None:
        """One unit's update and the copy of its weights back; the copy's event on CUDA."""
        opt.step()
        pairs = [(p.detach(), self._host_of[p]) for p in self._device_units[unit.name].params
                 if self._host_of[p].grad is not None]
        for _, host in pairs:
            host.grad = None
        if self.transfers is not None:
            return self.transfers.send(pairs)
        for dev, host in pairs:
            dev.copy_(host)
        return None

    # -- waiting for steps in flight ------------------------------------------------------------

    def _wait_unit(self, name: str) -> None:
        job = self._in_flight.pop(name, None)
        if job is None:
            return
        copied = job.result()
        if copied is not None:
            torch.cuda.current_stream(self.train_device).wait_event(copied)

    def wait_units(self, names: list[str]) -> None:
        """Claim the steps in flight of the units `names` (a forward is about to read them)."""
        if self._in_flight:
            for name in names:
                self._wait_unit(name)

    def wait_in_forward(self, model: nn.Module, layers: nn.ModuleList) -> None:
        """Let the next step's forward start before the CPU step ends (`overlap`): a pre-hook on
        each decoder layer waits for its unit, one on each other module with weights for theirs.
        Registered before the first forward, on the layer itself, so a layer compiled by
        training.compile calls it too (tests/unit/test_cpu_offload.py counts the waits)."""
        inside = {id(m) for layer in layers for m in layer.modules()}
        for layer in layers:
            names = sorted({self._unit_name[p] for p in layer.parameters() if p in self._unit_name})
            if names:
                self._forward_hooks.append(layer.register_forward_pre_hook(_waiter(self, names)))
        for module in model.modules():
            names = sorted({self._unit_name[p] for p in module.parameters(recurse=False) if p in self._unit_name})
            if names and id(module) not in inside:
                self._forward_hooks.append(module.register_forward_pre_hook(_waiter(self, names)))

    def wait(self) -> None:
        """Every step in flight is done and its weights are back on the device."""
        for name in list(self._in_flight):
            self._wait_unit(name)

    # -- residency ------------------------------------------------------------------------------

    def deactivate(self, unit: Unit, policy: str) -> None:
        self._wait_unit(unit.name)
        # A frozen unit needs no accumulator until LISA samples it again.
        for h in self.units[unit.name].params:
            acc = self._acc.pop(h, None)
            if acc is not None:
                self._spare.setdefault((acc.shape, acc.dtype), []).append(acc)
            h.grad = None
        super().deactivate(unit, policy)

    def refresh_host_weights(self) -> None:
        """The host copies take the device weights (after a checkpoint was loaded into the model)."""
        self.wait()
        with torch.no_grad():
            for p, host in self._host_of.items():
                host.copy_(p.detach())

    def clear(self) -> None:
        """Forget all state. A checkpoint's weights are in the model when its optimizer files
        are read (clear, then restore): the host copies take them."""
        self.refresh_host_weights()
        for h, acc in self._acc.items():
            self._spare.setdefault((acc.shape, acc.dtype), []).append(acc)
            h.grad = None
        self._acc.clear()
        super().clear()

    # -- statistics -----------------------------------------------------------------------------

    def state_bytes(self) -> tuple[int, int]:
        """Nothing of the optimizer stays on the training device: all of it is host memory."""
        for name in self._first_steps:  # their moments are being created
            self._wait_unit(name)
        resident, offloaded = super().state_bytes()
        return 0, resident + offloaded

    def host_bytes(self) -> dict[str, int]:
        """Host memory this class holds besides the moments: weight copies, accumulators, staging."""
        return {"host_weights": self._weights_arena.nbytes, "grad_accumulators": self._acc_arena.nbytes,
                "staging": self.transfers.staging_bytes if self.transfers is not None else 0}

    # -- checkpoints (lisaft/checkpoint/optimizer_files.py): a step in flight completes first ---------------

    def has_state(self, name: str) -> bool:
        self._wait_unit(name)
        return super().has_state(name)

    def host_state(self, name: str) -> dict | None:
        self._wait_unit(name)
        return super().host_state(name)
