"""Measurement: exact peak tensor memory (``memory``), timing in interleaved rounds
(``timing``), and side-by-side comparison of training-step variants (``compare``)."""

from .compare import MismatchError, Row, as_dict, compare, format_table
from .memory import track_memory
from .timing import Timing, paired_ratio, synchronize, time_fn, time_interleaved

__all__ = [
    "MismatchError", "Row", "Timing", "as_dict", "compare", "format_table", "paired_ratio",
    "synchronize", "time_fn", "time_interleaved", "track_memory",
]  # fmt: skip
