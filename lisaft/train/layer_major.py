"""optimizer.offload_accumulation: device — the layer-major backward of optimizer.cpu_offload.

The micro-batch-major step ships every micro-batch's whole gradient to the host and adds it
there: for an 8B model 16 GB over the link and one host addition per micro-batch. Here a group
of micro-batches is taken layer by layer instead, so each layer's gradient is summed on the
training device over the group and shipped once:

1. forward every micro-batch of the group. Each decoder layer runs without a graph (a stand-in,
   `_Tape`, takes its place in the model's layer list for the step) and its input, the
   checkpoint boundary, is copied to host memory (pinned on CUDA) with the arguments the model
   handed it (position embeddings, mask, position ids: the recompute needs the same ones). The
   last layer's output becomes a leaf, so the final norm, the head and the loss run as in any
   step and their backward gives the micro-batch's gradient at the top of the layers (kept on
   the device) and adds the head's weight gradient into its .grad;
2. from the top layer down: for each micro-batch in order, the layer's saved input comes back,
   the layer is recomputed from it (from the random state its forward started with: the same
   dropout masks) and back-propagated; its weight gradients add up in .grad on
   the device in the order the resident run adds them, and the boundary gradient moves one layer
   down. The layer's summed gradient is then shipped to the host once (where, in the step's last
   group, its CPU step starts while the layers below run: OffloadedOptimizers.ship);
3. the embeddings: the model's forward is run again up to the first layer's input, which is
   back-propagated with the bottom boundary gradient.

On a CPU device the host is the device: the same code runs with plain copies, and the step is
the resident one bit for bit with one group (tests/integration/test_layer_major.py). A further
group adds each gradient once on the host, in the weight dtype, so with groups the sum is
exact but its order is not the resident's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from lisaft.data.collate import to_device
from lisaft.memory.layer_major import groups
from lisaft.model.attention import model_inputs
from lisaft.model.parts import ModelParts
from lisaft.optim.cpu_offload import OffloadedOptimizers
from lisaft.optim.transfers import TransferCounts


class _Stop(Exception):
    """Raised at the first layer's input when only the embeddings' part of the forward is wanted."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


def _with_hidden(out, hidden: torch.Tensor):
    return (hidden, *out[1:]) if isinstance(out, tuple) else hidden


class _Tape(nn.Module):
    """Stands in for decoder layer `index` during the step's forward: keeps its input and
    arguments, runs it without a graph, and makes the top layer's output the graph's leaf."""

    def __init__(self, layer: nn.Module, index: int, runner: LayerMajor) -> None:
        super().__init__()
        self.layer, self.index = layer, index
        self.runner = [runner]  # a list: not a submodule

    def forward(self, *args, **kwargs):
        runner = self.runner[0]
        # Models hand a layer its hidden states first, or (some) by name.
        hidden, args = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        if runner.stop_at_input:
            raise _Stop(hidden)
        runner.keep(self.index, hidden, args, kwargs)
        with torch.no_grad():
            out = self.layer(hidden, *args, **kwargs)
        if self.index < len(runner.layers) - 1:
            return out
        top = _hidden(out).detach().requires_grad_()
        runner.tops.append(top)
        return _with_hidden(out, top)


class _Link:
    """The saved inputs' copies. On CUDA they run on a stream of their own beside the compute: an
    input goes out as the forward produces it, the next one comes back while a layer is
    recomputed. On a CPU they are plain copies (counted the same)."""

    def __init__(self, device: torch.device, counts: TransferCounts) -> None:
        self.device, self.counts = device, counts
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def out(self, hidden: torch.Tensor) -> torch.Tensor:
        host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=self.stream is not None)
        self.counts.d2h_bytes += host.numel() * host.element_size()
        if self.stream is None:
            host.copy_(hidden.detach())
            return host
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # `hidden` is computed
        with torch.cuda.stream(self.stream):
            host.copy_(hidden.detach(), non_blocking=True)
        hidden.record_stream(self.stream)  # its memory is reused only once the copy has read it
        return host

    def back(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """`host` queued to the device: the tensor, and the event that marks it there (None: it is)."""
        self.counts.h2d_bytes += host.numel() * host.element_size()
        if self.stream is None:
            x = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            x.copy_(host)
            return x, None
        # Behind the copy out on the same stream; the pinned block is kept until the copy is done.
        with torch.cuda.stream(self.stream):
            x = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            x.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        x.record_stream(torch.cuda.current_stream(self.device))  # used, and freed, there
        return x, done

    @staticmethod
    def ready(x: torch.Tensor, done: torch.cuda.Event | None) -> torch.Tensor:
        if done is not None:
            torch.cuda.current_stream(x.device).wait_event(done)
        return x


class LayerMajor:
    """The step's forward and backward, layer-major, for a model whose optimizer is on the host."""

    def __init__(self, model: nn.Module, parts: ModelParts, optimizers: OffloadedOptimizers,
                 group_size: int) -> None:
        self.model, self.layers, self.parts = model, parts.layers, parts
        self.originals: list[nn.Module] = list(parts.layers)
        self.optimizers = optimizers
        self.group_size = group_size
        self.stop_at_input = False
        self.tops: list[torch.Tensor] = []
        # (layer, micro-batch in the group) -> the saved input on the host, and the layer's arguments.
        self.saved: dict[tuple[int, int], torch.Tensor] = {}
        self.arguments: dict[tuple[int, int], tuple[tuple, dict]] = {}
        # The random state each layer (key: its index) and each micro-batch's forward (key: -1)
        # started from: a recompute draws the forward's dropout masks again, as checkpointing does.
        self.rng: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.link = _Link(optimizers.train_device, optimizers.counts)
        self._prefetched: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._micro = 0

    def summary(self, grad_accum_steps: int) -> str:
        n = groups(grad_accum_steps, self.group_size)
        return (f"optimizer.offload_accumulation device: layer-major backward, {self.group_size} micro-batches "
                f"per group, {n} group{'s' if n > 1 else ''} per step ({n - 1} host addition"
                f"{'' if n == 2 else 's'} of each gradient)")

    # -- the step -------------------------------------------------------------------------------

    def run(self, micro: list[dict], device: torch.device, loss_tokens: torch.Tensor,
            forward: Callable[[nn.Module, dict], torch.Tensor], before_last: Callable[[], None]) -> list[torch.Tensor]:
        """Forward and backward of the step's micro-batches, each gradient shipped to the host;
        returns each micro-batch's summed token loss. `before_last` runs before the last group
        ships its first gradient (cpu_offload arms the units that step as they are shipped)."""
        losses: list[torch.Tensor] = []
        groups = [micro[i:i + self.group_size] for i in range(0, len(micro), self.group_size)]
        with self._taped(), self.optimizers.holding():
            for g, group in enumerate(groups):
                batches = [to_device(b, device) for b in group]
                if g == len(groups) - 1:
                    before_last()
                grads = []
                for i, batch in enumerate(batches):
                    self._micro = i
                    self.rng[-1, i] = _rng_state(device)
                    loss = forward(self.model, batch)
                    (loss / loss_tokens.to(loss.dtype)).backward()
                    grads.append(self.tops.pop().grad)
                    losses.append(loss.detach())
                self._ship(self.parts.head)
                for index in reversed(range(len(self.layers))):
                    self._layer_backward(index, grads)
                self._embeddings_backward(batches, grads)
                self.saved.clear()
                self.arguments.clear()
                self.rng.clear()
                self._prefetched.clear()
        return losses

    def _layer_backward(self, index: int, grads: list[torch.Tensor | None]) -> None:
        layer = self.originals[index]
        wants_input_grad = index > 0 or any(p.requires_grad for p in self.parts.embeddings)
        with _no_checkpointing(layer):
            for i, grad in enumerate(grads):
                x = self._fetch(index, i).requires_grad_(wants_input_grad)
                args, kwargs = self.arguments.pop((index, i))
                with _replayed(self.rng.pop((index, i))):
                    out = _hidden(layer(x, *args, **kwargs))
                torch.autograd.backward(out, grad)
                grads[i] = x.grad
        self._ship(list(layer.parameters()))

    def _embeddings_backward(self, batches: list[dict], grads: list[torch.Tensor | None]) -> None:
        if not any(p.requires_grad for p in self.parts.embeddings):
            return
        self.stop_at_input = True
        try:
            for i, (batch, grad) in enumerate(zip(batches, grads)):
                try:
                    with _replayed(self.rng[-1, i]):
                        self.model(**model_inputs(batch))
                except _Stop as stop:
                    torch.autograd.backward(stop.hidden, grad)
                else:
                    raise AssertionError("the forward never reached the first decoder layer")
        finally:
            self.stop_at_input = False
        self._ship(self.parts.embeddings)

    def _ship(self, params: list[nn.Parameter]) -> None:
        self.optimizers.ship([p for p in params if p.grad is not None])

    # -- the saved inputs -----------------------------------------------------------------------

    def keep(self, index: int, hidden: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """Layer `index`'s input to host memory, and the arguments it was called with."""
        self.saved[index, self._micro] = self.link.out(hidden)
        self.arguments[index, self._micro] = (args, kwargs)
        self.rng[index, self._micro] = _rng_state(hidden.device)

    def _fetch(self, index: int, micro: int) -> torch.Tensor:
        """Layer `index`'s input for `micro` back on the device, and the next one queued behind it
        (the next micro-batch's, or the layer below's first) while this one is recomputed."""
        key = (index, micro)
        x, done = self._prefetched.pop(key) if key in self._prefetched else self.link.back(self.saved.pop(key))
        following = (index, micro + 1) if (index, micro + 1) in self.saved else (index - 1, 0)
        if following in self.saved:
            self._prefetched[following] = self.link.back(self.saved.pop(following))
        return _Link.ready(x, done)

    @contextlib.contextmanager
    def _taped(self) -> Iterator[None]:
        """The model's layer list holds the stand-ins for the step, the layers again after it."""
        for i, layer in enumerate(self.originals):
            self.layers[i] = _Tape(layer, i, self)
        try:
            yield
        finally:
            for i, layer in enumerate(self.originals):
                self.layers[i] = layer
            self.tops.clear()


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


@contextlib.contextmanager
def _replayed(states: list[torch.Tensor]) -> Iterator[None]:
    """Run with the random state of `states` (_rng_state's), the caller's restored after it."""
    devices = [torch.cuda.current_device()] if len(states) > 1 else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(states[0])
        if devices:
            torch.cuda.set_rng_state(states[1])
        yield


@contextlib.contextmanager
def _no_checkpointing(layer: nn.Module) -> Iterator[None]:
    """The recompute from the saved input is the layer's one forward with a graph: checkpointing
    it again would run it a third time."""
    was = getattr(layer, "gradient_checkpointing", False)
    setattr(layer, "gradient_checkpointing", False)  # noqa: B010 (not every layer declares it)
    try:
        yield
    finally:
        setattr(layer, "gradient_checkpointing", was)  # noqa: B010
