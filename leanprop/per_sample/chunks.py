"""Samples in chunks, so that a layer's scratch memory stays within a budget, and one reusable
buffer for the chunks' temporaries."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import torch
from torch import Tensor


def sample_chunks(n: int, per_sample_bytes: int, budget_bytes: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``range(n)``: as few as fit ``budget_bytes`` at
    ``per_sample_bytes`` each (at least one sample), of sizes differing by at most one (a
    small last chunk runs its kernels at a fraction of their speed: 32 samples by 14 are
    cut 11, 11, 10, not 14, 14, 4)."""
    size = max(1, budget_bytes // max(per_sample_bytes, 1))
    count = -(-n // size)
    start = 0
    for i in range(count):
        stop = start + n // count + (i < n % count)
        yield start, stop
        start = stop


_Key = tuple[torch.device, torch.dtype, str]

# CPU scratch buffers between backward passes (see Scratch.clear), at most _KEPT_BYTES in all
_KEPT: dict[_Key, Tensor] = {}
_KEPT_BYTES = 64 * 2**20
_KEPT_LOCK = threading.Lock()


def release_kept() -> None:
    """Free the CPU scratch buffers kept between backward passes (the next backward makes its
    own again): so that a measured block pays for them as a first step does, and its peak
    holds them (``leanprop.track_memory`` calls it on entry)."""
    with _KEPT_LOCK:
        _KEPT.clear()


class Scratch:
    """One buffer per device, dtype and slot, reused by every chunk of one backward pass for
    temporaries that are consumed before the next chunk is computed (individual gradients
    reduced to norms or sums). A fresh large temporary per chunk costs page faults on CPU,
    often more than the arithmetic; the buffer grows to the largest chunk (at most the
    workspace budget). On CPU, where a freed large buffer goes back to the system and the next
    one faults its pages in again (a few ms per step), :meth:`clear` keeps the buffers for the
    next backward pass (at most 64 MiB in this process, one buffer per device, dtype and
    slot); elsewhere (the CUDA caching allocator keeps freed memory) they are dropped."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, Tensor] = {}

    def take(self, shape: tuple[int, ...], like: Tensor, slot: str = "") -> Tensor:
        """A contiguous uninitialised tensor of ``shape`` with ``like``'s device and dtype,
        valid until the next ``take`` of the same ``slot`` (one per tensor a chunk needs at
        once, e.g. a layer's weight and bias) or until :meth:`clear`."""
        numel, key = math.prod(shape), (like.device, like.dtype, slot)
        buf = self._buffers.get(key)
        if buf is None and key[0].type == "cpu" and _KEPT:
            with _KEPT_LOCK:
                buf = _KEPT.pop(key, None)
            if buf is not None:
                self._buffers[key] = buf
        if buf is None or buf.numel() < numel:
            self._buffers[key] = buf = None  # (the old one is freed before the new one)
            buf = self._buffers[key] = like.new_empty(numel)
        return buf[:numel].view(shape)

    def clear(self) -> None:
        """Done with the buffers: CPU ones kept for the next backward pass (see above)."""
        with _KEPT_LOCK:
            for key, buf in self._buffers.items():
                if key[0].type != "cpu" or key in _KEPT:
                    continue
                held = sum(b.numel() * b.element_size() for b in _KEPT.values())
                if held + buf.numel() * buf.element_size() <= _KEPT_BYTES:
                    _KEPT[key] = buf
        self._buffers.clear()
