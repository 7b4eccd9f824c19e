"""Parking a side loss's stored gradients in pinned host memory until the main backward.

An eager side loss computes its gradients during forward and holds them until the main
backward reaches it (see ``eager.py``). With ``offload=True`` they leave the GPU meanwhile:

* When a side loss starts, the gradients of the one before it (in forward order) move to pinned
  host memory on a copy stream, overlapping the new side loss's computation. The newest stays
  on the device: the main backward reaches it first, so it never makes the trip.
* When the main backward takes a side loss's gradients, it starts fetching the next one it will
  reach (the newest still parked) on another copy stream, so the copy overlaps the backward
  between the two.

Ordering is by CUDA events, and every tensor used on a stream other than the one that allocated
it is recorded on that stream (``record_stream``), so the allocator does not reuse its memory
early. Taking gradients in another order than expected is still correct: a record that was not
fetched ahead is fetched when taken (the backward then waits for the copy). Tensors on other
devices (CPU) are never moved.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MOVED_DEVICES = frozenset({"cuda"})  # device types whose gradients are moved to host memory

# Records still to be taken, oldest first. Shared by all threads: forward runs in the user's
# thread, a CUDA backward in autograd's device thread.
_parked: list[weakref.ref[Parked]] = []
_lock = threading.Lock()


def _register(record: Parked) -> None:
    with _lock:
        _parked.append(weakref.ref(record))


def _live(device: torch.device) -> list[Parked]:
    """Records on ``device`` whose graph is still alive and that were not taken, oldest first
    (the others are forgotten)."""
    with _lock:
        records = [p for p in (r() for r in _parked) if p is not None and p.state != "taken"]
        _parked[:] = [weakref.ref(p) for p in records]
        return [p for p in records if p.device == device]


@dataclass
class _Streams:
    """One copy stream per direction."""

    to_host: Any
    to_device: Any


_streams: dict[torch.device, _Streams] = {}


def _streams_of(device: torch.device) -> _Streams:
    if device not in _streams:
        _streams[device] = _Streams(torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _streams[device]


def mark(device: torch.device) -> Any:
    """An event marking the work queued so far on the current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def copy_to_host(grads: list[Tensor | None], device: torch.device, after: Any) -> tuple[list, Any]:
    """Start copying ``grads`` into pinned host memory once the event ``after`` (which marks
    them complete) has passed; returns the host tensors and the event that marks the copy
    done."""
    streams = _streams_of(device)
    streams.to_host.wait_event(after)
    host: list[Tensor | None] = []
    with torch.cuda.stream(streams.to_host):
        for g in grads:
            if g is None:
                host.append(None)
                continue
            h = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
            h.copy_(g, non_blocking=True)
            g.record_stream(streams.to_host)  # its memory is reused only after the copy
            host.append(h)
        done = torch.cuda.Event()
        done.record(streams.to_host)
    return host, done


def copy_to_device(host: list[Tensor | None], device: torch.device, after: Any) -> tuple[list, Any]:
    """Start copying ``host`` back to ``device`` once the event ``after`` has passed; returns
    the device tensors and the event that marks the copy done."""
    streams = _streams_of(device)
    streams.to_device.wait_event(after)
    with torch.cuda.stream(streams.to_device):
        grads = [None if h is None else h.to(device, non_blocking=True) for h in host]
        done = torch.cuda.Event()
        done.record(streams.to_device)
    return grads, done


def ready_here(grads: list[Tensor | None], device: torch.device, done: Any) -> None:
    """Make the current stream wait for the copy ``done`` and own the copied tensors."""
    current = torch.cuda.current_stream(device)
    current.wait_event(done)
    for g in grads:
        if g is not None:
            g.record_stream(current)


def park(device: torch.device) -> None:
    """Move the gradients of every side loss still on ``device`` to host memory (called as a
    new side loss starts: its own gradients will be the newest)."""
    for record in _live(device):
        record.to_host()


class Parked:
    """Gradients of one side loss (moved only with ``offload``): on the device
    (``"device"``), in or on their way to host memory (``"host"``), on their way back
    (``"fetching"``), or handed out (``"taken"``)."""

    def __init__(self, grads: list[Tensor | None], offload: bool) -> None:
        self.grads: list[Tensor | None] = grads
        self.state = "device"
        self.device = next((g.device for g in grads if g is not None), None)
        self.movable = (
            offload
            and self.device is not None
            and self.device.type in MOVED_DEVICES
            and all(g is None or g.layout == torch.strided for g in grads)  # sparse ones stay
        )
        self._done: Any = None  # event: the gradients are complete, or the last copy done
        if self.movable:
            self._done = mark(self.device)
            _register(self)

    def to_host(self) -> None:
        """Start moving the gradients to pinned host memory; the device copies are freed."""
        if self.state == "device" and self.movable:
            self.grads, self._done = copy_to_host(self.grads, self.device, self._done)
            self.state = "host"

    def fetch(self) -> None:
        """Start copying the gradients back to the device."""
        if self.state == "host":
            self.grads, self._done = copy_to_device(self.grads, self.device, self._done)
            self.state = "fetching"

    def take(self) -> list[Tensor | None]:
        """The gradients, on the device and ready for the current stream; starts fetching the
        side loss the backward will reach next (the newest one still parked)."""
        if self.state == "taken":
            raise RuntimeError("a side loss's stored gradients were taken twice")
        self.fetch()  # still in host memory: fetched now, the backward waits for it
        if self.state == "fetching":
            ready_here(self.grads, self.device, self._done)
        grads, self.grads, self.state = self.grads, [], "taken"
        if self.movable:
            ahead = _live(self.device)
            if ahead:
                ahead[-1].fetch()
        return grads
