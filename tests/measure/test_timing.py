"""time_fn: runs counted, statistics ordered, bad repetition counts refused; rounds of
time_interleaved and their paired ratio."""

from __future__ import annotations

import pytest

from leanprop import LeanpropValueError, time_fn
from leanprop.measure import Timing, paired_ratio, time_interleaved


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


def test_rounds_rotate_their_order():
    """Each round calls every function once, in the order rotated by one more each round, so
    that no function always runs right after the same other one (nor right after itself, as
    with every other round reversed: review)."""
    calls = []
    time_interleaved({k: (lambda k=k: calls.append(k)) for k in "abc"}, warmup=0, reps=4)
    assert calls == list("abcbcacababc")


def test_paired_ratio_cancels_a_slow_round():
    """The median of the rounds' own ratios: a round the machine ran 10x slower slows both
    sides and leaves the ratio alone, where the ratio of medians moves."""
    a = Timing(0.0, 0.0, (2.0, 20.0, 2.0, 20.0, 2.0))
    b = Timing(0.0, 0.0, (1.0, 10.0, 1.0, 10.0, 10.0))
    assert paired_ratio(a, b) == 2.0
    with pytest.raises(LeanpropValueError, match="same time_interleaved call"):
        paired_ratio(a, Timing(0.0, 0.0, (1.0,)))
