"""The private-training examples run, train, and account."""

from __future__ import annotations

import math
import pathlib
import runpy

import pytest

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


def test_dp_sgd_example_trains_and_accounts():
    pytest.importorskip("opacus")
    losses, epsilon = runpy.run_path(str(EXAMPLES / "dp_sgd.py"))["main"](epochs=3)
    assert losses[-1] < 0.9 * losses[0], losses
    assert 0 < epsilon < math.inf


@pytest.mark.filterwarnings("ignore:Optimal order is the")
def test_opacus_facade_example_runs():
    pytest.importorskip("opacus")
    epsilon = runpy.run_path(str(EXAMPLES / "opacus_facade.py"))["main"](epochs=1)
    assert 0 < epsilon < math.inf
