"""Resident-set peak of one call, for comparison with RSS-based numbers (BackPACK's example,
the reference scripts). Prefer :class:`leanprop.track_memory`; see its module for why RSS is
noisy. Linux only (reads ``/proc/self``)."""

from __future__ import annotations

from collections.abc import Callable


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def rss_peak_mib(step: Callable[[], object]) -> float | None:
    """High-water mark of the resident set during ``step()`` above the resident set before it
    (None where ``/proc/self/clear_refs`` cannot reset the mark)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    base = _rss_kib("VmRSS:")
    out = step()
    peak = _rss_kib("VmHWM:")
    del out
    return (peak - base) / 1024
