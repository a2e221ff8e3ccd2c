"""optimizer.cpu_offload's copies over the link: gradients out to host accumulators in backward,
with a bounded number of bytes in flight, and the stepped weights back in before the next forward."""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch

from lisaft.optim import host_step

# Gradients of later micro-batches go through STAGING_SLOTS pinned buffers of at most
# STAGING_SLOT_BYTES, a large gradient in several pieces: the copy of one piece overlaps the
# worker's addition of the previous one, and staging costs 1 GiB whatever the model.
STAGING_SLOTS = 4
STAGING_SLOT_BYTES = 1 << 28


def staging_slot_bytes(largest_bytes: int) -> int:
    return min(STAGING_SLOT_BYTES, -(-largest_bytes // 64) * 64)


def _event() -> torch.cuda.Event:
    # Blocking: a host thread that waits on it sleeps until the copy is done instead of spinning
    # a core that the host step and the accumulation need.
    return torch.cuda.Event(blocking=True)


class Transfers:
    """The CUDA side of the transfers: one side stream for device->host gradients and another for
    host->device weights (so neither direction queues behind the other when units step while
    backward runs), the staging ring, and the worker thread that adds staged gradients."""

    def __init__(self, device: torch.device, slot_bytes: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # gradients out
        self.weights_stream = torch.cuda.Stream(device)  # weights in
        self.slot_bytes = slot_bytes
        staging = torch.empty(STAGING_SLOTS * slot_bytes, dtype=torch.uint8, pin_memory=True)
        self.slots: queue.Queue[torch.Tensor] = queue.Queue()
        for buf in staging.split(slot_bytes):
            self.slots.put(buf)
        self.staging_bytes = staging.numel()
        # Device->host copies queued and not yet known done, oldest first, with their bytes.
        self.limit = STAGING_SLOTS * slot_bytes
        self.copies: deque[tuple[torch.cuda.Event, int]] = deque()
        self.in_flight = 0
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="lisaft-grad-add")
        self.pending: list[Future] = []

    def gradient(self, g: torch.Tensor, acc: torch.Tensor, add: bool) -> list[torch.cuda.Event | Future]:
        """Queue acc <- g (first micro-batch) or acc += g (later ones), piece by piece, with at
        most `limit` bytes of copies in flight in either case: a freed gradient's memory is
        reused only once the side stream has read it, so when backward outruns the link, copies
        queued without a bound pile freed blocks up as reserved memory toward the cap. Returns
        what marks acc complete (`complete` waits for it): a unit stepped as its gradients arrive
        waits for its own copies only."""
        marks: list[torch.cuda.Event | Future] = []
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        # Elementwise: piece by piece gives the whole tensor's copy or sum, bit for bit.
        flat_g, flat_acc = g.reshape(-1), acc.view(-1)
        piece = self.slot_bytes // g.element_size()
        for lo in range(0, flat_g.numel(), piece):
            part = flat_g[lo:lo + piece]
            if not add:
                marks.append(self._copy(flat_acc[lo:lo + piece], part))
                continue
            buf = self.slots.get()  # blocks only while every slot still waits for its addition
            staged = buf[: part.numel() * part.element_size()].view(g.dtype)
            copied = self._copy(staged, part)
            self.pending.append(self.worker.submit(self._add, copied, flat_acc[lo:lo + piece], staged, buf))
            marks.append(self.pending[-1])
        # The caller drops g now; its memory is reused only after the side stream has read it.
        self._hold(g)
        return marks

    @staticmethod
    def complete(marks: list) -> None:
        for mark in marks:
            if isinstance(mark, Future):
                mark.result()
            else:
                mark.synchronize()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """dst <- src on the side stream, once the oldest copies leave room under `limit`."""
        nbytes = src.numel() * src.element_size()
        while self.copies and self.in_flight + nbytes > self.limit:
            event, n = self.copies.popleft()
            event.synchronize()
            self.in_flight -= n
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            copied = _event()
            copied.record(self.stream)
        self.copies.append((copied, nbytes))
        self.in_flight += nbytes
        return copied

    def _hold(self, g: torch.Tensor) -> None:
        g.record_stream(self.stream)

    def _add(self, copied: torch.cuda.Event, acc: torch.Tensor, staged: torch.Tensor, buf: torch.Tensor) -> None:
        copied.synchronize()
        host_step.accumulate(acc, staged)
        self.slots.put(buf)

    def drain(self) -> None:
        """Every queued gradient is in its accumulator."""
        for f in self.pending:
            f.result()
        self.pending.clear()
        self.stream.synchronize()
        self.copies.clear()
        self.in_flight = 0

    def send(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        """Queue the weights' copies; returns the event that marks them done."""
        # Weights are overwritten only after every kernel queued so far (the backward) is done.
        self.weights_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.weights_stream):
            for dev, host in pairs:
                dev.copy_(host, non_blocking=True)
            copied = _event()
            copied.record(self.weights_stream)
        return copied

    def weights_ready(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.weights_stream)


@dataclass
class TransferCounts:
    """What a step moved over the link and added on the host, counted from the copies made."""

    d2h_bytes: int = 0           # device -> host: gradients, and the layer-major backward's saved inputs
    h2d_bytes: int = 0           # host -> device: stepped weights, and saved inputs fetched back
    host_grad_additions: int = 0  # gradient elements added into a host accumulator

    def take(self) -> dict[str, int]:
        """The train record's fields, and a fresh count for the next step."""
        out = {"offload_d2h_bytes": self.d2h_bytes, "offload_h2d_bytes": self.h2d_bytes,
               "host_grad_additions": self.host_grad_additions}
        for f in fields(self):
            setattr(self, f.name, 0)
        return out
