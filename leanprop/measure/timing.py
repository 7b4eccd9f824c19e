"""Run time of a callable: synchronised, after warm-up, several runs, median and min."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LeanpropValueError


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
    return time_interleaved({"fn": fn}, device, warmup=warmup, reps=reps)["fn"]


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    device: str | torch.device = "cpu",
    warmup: int = 1,
    reps: int = 10,
) -> dict[str, Timing]:
    """Time several callables in rounds (each round calls every one once, in the given order
    rotated by one more each round, so that none always follows the same one, nor itself),
    so that a change in the machine's load during the measurement affects them all alike;
    see :func:`paired_ratio` for a ratio that cancels a slow round.

    Example:
        >>> t = time_interleaved({"a": lambda: sum(range(100)), "b": lambda: None}, reps=3)
        >>> sorted(t)
        ['a', 'b']
    """
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (reps, warmup))
    if not ints or reps < 1 or warmup < 0:
        raise LeanpropValueError(
            f"timing got reps={reps}, warmup={warmup}; need reps >= 1 and warmup >= 0."
        )
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    runs: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(reps):
        turn = r % len(order)
        for name, fn in order[turn:] + order[:turn]:
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            runs[name].append(time.perf_counter() - start)
    return {name: Timing(statistics.median(r), min(r), tuple(r)) for name, r in runs.items()}


def paired_ratio(a: Timing, b: Timing) -> float:
    """The median over rounds of ``a``'s time over ``b``'s in the same round (both from one
    :func:`time_interleaved`): a round the machine ran slow slows both, and cancels.

    Example:
        >>> paired_ratio(Timing(2.0, 1.0, (1.0, 4.0, 2.0)), Timing(1.0, 0.5, (0.5, 2.0, 1.0)))
        2.0
    """
    if len(a.runs) != len(b.runs) or not a.runs:
        raise LeanpropValueError(
            f"paired_ratio got timings of {len(a.runs)} and {len(b.runs)} rounds; pass two "
            "timings of the same time_interleaved call."
        )
    pairs = zip(a.runs, b.runs, strict=True)
    return statistics.median(x / y if y > 0 else float("nan") for x, y in pairs)
