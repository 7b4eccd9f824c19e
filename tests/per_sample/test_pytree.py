"""The op interception's quick flattening (leanprop/per_sample/pytree.py) agrees with torch's
pytree on every kind of call, quick path or not."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from leanprop.per_sample.pytree import flatten, unflatten

x, w = torch.randn(2, 3), torch.randn(3, 3)


@pytest.mark.parametrize(
    "tree",
    [
        x,
        ((x, w, None, 1, 2.0, "mean"), {}),
        ((x,), {"weight": w, "dtype": torch.float64, "dim": -1}),
        ((x, [w, w]), {}),  # a list inside: torch's walk
        ((x,), {"sizes": (2, 3)}),
        ((x, torch.Size([3, 2])), {}),
        (x, w),  # not a call
        [x, {"a": w}],
    ],
    ids=[
        "tensor",
        "flat-args",
        "flat-kwargs",
        "nested-list",
        "tuple-kwarg",
        "size",
        "pair",
        "nested",
    ],
)
def test_flatten_agrees_with_torch_and_round_trips(tree):
    leaves, spec = flatten(tree)
    expected, _ = tree_flatten(tree)
    assert len(leaves) == len(expected)
    assert all(a is b for a, b in zip(leaves, expected, strict=True))
    back = unflatten(leaves, spec)  # as torch's own round trip (which gives a Size as tuple)
    assert tree_flatten(back)[1] == tree_flatten(tree_unflatten(*tree_flatten(tree)))[1]
    assert all(a is b for a, b in zip(tree_flatten(back)[0], expected, strict=True))
