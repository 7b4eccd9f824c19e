"""Run time of a callable: synchronised, after warm-up, several runs, median and min."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import LeanpropValueError


@dataclass(frozen=True)
class Timing:
    """Seconds per call: ``median``, ``min`` and every run in ``runs``."""

    median: float
    min: float
    runs: tuple[float, ...]


def synchronize(device: str | torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any], device: str | torch.device = "cpu", warmup: int = 1, reps: int = 10
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``reps`` calls each bracketed by device
    synchronisation.

    Example:
        >>> t = time_fn(lambda: sum(range(1000)), reps=3)
        >>> t.min <= t.median
        True
    """
    if reps < 1 or warmup < 0:
        raise LeanpropValueError(
            f"time_fn() got reps={reps}, warmup={warmup}; need reps >= 1 and warmup >= 0."
        )
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        runs.append(time.perf_counter() - start)
    return Timing(statistics.median(runs), min(runs), tuple(runs))
