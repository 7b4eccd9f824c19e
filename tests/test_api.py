"""The public surface: one door, pinned."""

import leanprop

EXPECTED = {
    "BatchGrad",
    "BatchL2Grad",
    "Quantity",
    "SumGradSquared",
    "Variance",
    "per_sample",
    "register_rule",
    "BatchError",
    "LeanpropError",
    "LeanpropValueError",
    "UnsupportedModelError",
}


def test_all_is_pinned():
    assert set(leanprop.__all__) == EXPECTED
    assert len(leanprop.__all__) == len(EXPECTED)
    for name in leanprop.__all__:
        assert hasattr(leanprop, name), name


def test_errors_subclass_builtins():
    assert issubclass(leanprop.LeanpropValueError, ValueError)
    assert issubclass(leanprop.BatchError, ValueError)
    assert issubclass(leanprop.UnsupportedModelError, RuntimeError)
    for e in (leanprop.LeanpropValueError, leanprop.BatchError, leanprop.UnsupportedModelError):
        assert issubclass(e, leanprop.LeanpropError)
