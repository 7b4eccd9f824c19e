"""time_fn: runs counted, statistics ordered, bad repetition counts refused."""

from __future__ import annotations

import pytest

from leanprop import LeanpropValueError, time_fn


def test_time_fn_counts_runs_and_orders_stats():
    calls = []
    t = time_fn(lambda: calls.append(1), warmup=2, reps=5)
    assert len(calls) == 7 and len(t.runs) == 5
    assert t.min <= t.median and t.min == min(t.runs)


def test_time_fn_rejects_bad_reps():
    with pytest.raises(LeanpropValueError, match="reps=0"):
        time_fn(lambda: None, reps=0)


def test_time_fn_reps_must_be_a_whole_number():
    from leanprop import time_fn

    with pytest.raises(LeanpropValueError, match=r"reps=2\.5"):
        time_fn(lambda: None, reps=2.5)
