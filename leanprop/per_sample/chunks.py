"""Samples in chunks, so that a layer's scratch memory stays within a budget."""

from __future__ import annotations

from collections.abc import Iterator


def sample_chunks(n: int, per_sample_bytes: int, budget_bytes: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``range(n)``, each of as many samples as fit in
    ``budget_bytes`` at ``per_sample_bytes`` each (at least one)."""
    size = max(1, budget_bytes // max(per_sample_bytes, 1))
    for start in range(0, n, size):
        yield start, min(n, start + size)
