"""Timing and peak memory of one training-step callable, run in a fresh process.

Peak memory is measured in a process of its own so that nothing allocated by other methods
(or by the allocator's caches) leaks into the number:

* CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus the bytes allocated
  just before the call (exact tensor bytes).
* CPU: the high-water mark of the resident set (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``) minus the resident set just before the call, as BackPACK's and our
  reference scripts do. RSS includes allocator slack, so differences under a few MiB are noise.

Time: the step runs once to warm up, then ``reps`` synchronised runs; median and min reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mib(step: Callable[[], object], device: torch.device) -> float:
    """Peak memory (MiB) of one cold call of ``step`` above the memory in use before it."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = step()
        _sync(device)
        del out
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    _reset_hwm()
    base = _rss_kib("VmRSS:")
    out = step()
    peak = _rss_kib("VmHWM:")
    del out
    return (peak - base) / 1024


def times(step: Callable[[], object], device: torch.device, reps: int) -> tuple[float, float]:
    """(median, min) seconds of ``reps`` synchronised calls after one warm-up call."""
    step()
    _sync(device)
    ts = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts)
