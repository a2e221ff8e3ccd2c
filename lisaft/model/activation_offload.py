"""Long-context memory: checkpointed decoder layers whose inputs wait in pinned host memory
(model.offload_activations), and MLPs run in checkpointed chunks (model.mlp_chunk_tokens).

Gradient checkpointing keeps one tensor per layer, its input hidden state: `T x hidden x dtype`
bytes, 4 GiB for Llama-3.1-8B at 16,384 tokens. Here that input is copied to pinned host memory
on a side stream as soon as the layer has read it, and the device copy is freed. In backward,
the layer's input is brought back and the layer recomputed, as plain checkpointing does; while
one layer recomputes, the input of the layer below is already being copied up, so the copies
overlap compute in both directions. The device holds at most two layer inputs at a time.

The recompute runs the same operations on the same values as non-reentrant checkpointing, with
the random-number state of the forward restored, so losses and gradients are bit for bit the
same (tests/unit/test_offload.py). On CPU the "host copy" is a copy in the same memory: the
path runs, for tests, but saves nothing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lisaft import internals


@dataclass
class _Slot:
    """One layer input: its host copy, and the device copy while it is being brought back."""

    host: torch.Tensor | None
    # The layer below's slot, held weakly: each slot lives exactly as long as the autograd graph
    # that owns it (a strong chain kept every slot, pinned copy and event of the run alive, and
    # a forward that never ran backward kept its copies).
    below: weakref.ref[_Slot] | None
    device_copy: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


class HostActivationStore:
    """Moves layer inputs to pinned host memory and back, on one side stream per device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._last: weakref.ref[_Slot] | None = None

    def put(self, t: torch.Tensor) -> _Slot:
        if not self.cuda:
            slot = _Slot(host=t.detach().clone(), below=self._last)
        else:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t.detach(), non_blocking=True)
            # The device tensor may be freed by its owner now; its memory is not handed out
            # again until the copy queued on the side stream has read it.
            t.record_stream(self.stream)
            slot = _Slot(host=host, below=self._last)
        self._last = weakref.ref(slot)
        return slot

    def prefetch(self, slot: _Slot | None) -> None:
        if slot is None or slot.host is None or slot.device_copy is not None or not self.cuda:
            return
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            slot.device_copy = slot.host.to(self.device, non_blocking=True)
            slot.ready = torch.cuda.Event()
            slot.ready.record(self.stream)

    def take(self, slot: _Slot) -> torch.Tensor:
        """The layer input back on the device; the host copy is released."""
        if not self.cuda:
            host, slot.host = slot.host, None
            assert host is not None, "each layer input is taken back once"
            return host
        self.prefetch(slot)
        compute = torch.cuda.current_stream(self.device)
        assert slot.ready is not None and slot.device_copy is not None  # prefetch queued both
        compute.wait_event(slot.ready)
        copy = slot.device_copy
        copy.record_stream(compute)  # allocated on the side stream, used on the compute stream
        slot.host = slot.device_copy = None
        return copy


class _OffloadedLayer(torch.autograd.Function):
    """A decoder layer run without keeping its graph: in backward it is recomputed from the
    input held in host memory. The layer's trainable parameters are inputs, so their gradients
    flow (and in-backward hooks fire) even when the hidden state needs none."""

    @staticmethod
    def forward(ctx, store, run, hidden, *params):
        ctx.store, ctx.run = store, run
        ctx.slot = store.put(hidden)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        ctx.params = params
        return run(hidden)

    @staticmethod
    def backward(ctx, grad_out):
        store, slot = ctx.store, ctx.slot
        hidden = store.take(slot)
        store.prefetch(slot.below() if slot.below is not None else None)  # recomputed next
        devices = [hidden.device] if hidden.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            with torch.enable_grad():
                x = hidden.detach().requires_grad_(ctx.needs_input_grad[2])
                out = ctx.run(x)
        wanted = [x] if x.requires_grad else []
        wanted += [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        grad_hidden = next(grads) if x.requires_grad else None
        grad_params = [next(grads) if need else None for need in ctx.needs_input_grad[3:]]
        ctx.run = ctx.store = ctx.slot = None
        return (None, None, grad_hidden, *grad_params)


def offloaded_checkpoint(store: HostActivationStore, layer: nn.Module, run, hidden, *args):
    """Drop-in for a transformers layer's `_gradient_checkpointing_func(run, hidden, ...)`."""
    if args:
        raise NotImplementedError("offloaded checkpoints take the hidden state as the only positional input")
    extras: list = []

    def first(h):
        out = run(h)
        if isinstance(out, tuple):  # older layers return (hidden, attention weights or cache...)
            extras[:] = out[1:]
            return out[0]
        return out

    params = [p for p in layer.parameters() if p.requires_grad]
    if not hidden.requires_grad and not params:
        # Below every trainable part (LISA with frozen embeddings): backward never comes here.
        with torch.no_grad():
            out = first(hidden)
        return (out, *extras) if extras else out
    out = _OffloadedLayer.apply(store, first, hidden, *params)
    return (out, *extras) if extras else out


def enable_offloaded_checkpoints(layers: nn.ModuleList, device: torch.device) -> HostActivationStore:
    """Route every checkpointed decoder layer through one host store."""
    store = HostActivationStore(device)
    for layer in layers:
        if not getattr(layer, "gradient_checkpointing", False):
            raise RuntimeError(f"{type(layer).__name__} does not checkpoint: offloading needs gradient checkpointing")
        internals.set_checkpointing_func(layer, lambda run, *a, _l=layer: offloaded_checkpoint(store, _l, run, *a))
    return store


def _chunked_mlp(forward, chunk_tokens: int, x: torch.Tensor) -> torch.Tensor:
    # Position-wise, so chunks along the sequence give the same function; each chunk is
    # checkpointed, so in backward only one chunk's intermediates exist. The matmuls run on
    # smaller shapes, so results may differ from the unchunked MLP in the last bits.
    if x.dim() < 2 or x.shape[-2] <= chunk_tokens:
        return forward(x)
    parts = x.split(chunk_tokens, dim=-2)
    if torch.is_grad_enabled():
        outs = [checkpoint(forward, part, use_reentrant=False) for part in parts]
    else:
        outs = [forward(part) for part in parts]
    return torch.cat(outs, dim=-2)


def chunk_mlps(layers: nn.ModuleList, chunk_tokens: int) -> None:
    """Run every decoder layer's `mlp` over `chunk_tokens` positions at a time."""
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise RuntimeError(f"{type(layer).__name__} has no `mlp` module to run in chunks")
        mlp.forward = partial(_chunked_mlp, mlp.forward, chunk_tokens)
