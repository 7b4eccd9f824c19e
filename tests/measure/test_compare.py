"""compare: ratios, memory and agreement of variants, and every kind of result checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import leanprop
from leanprop import LeanpropValueError, MismatchError, compare


def test_compare_reports_ratios_memory_and_agreement(capsys):
    x = torch.randn(128, 128)
    rows = compare(
        {
            "matmul": lambda: x @ x,
            "einsum": lambda: torch.einsum("ij,jk->ik", x, x),
            "two": lambda: [x @ x, torch.cat([x, x])],
        },
        reps=2,
        check=False,
    )
    names = [r.name for r in rows]
    assert names == ["matmul", "einsum", "two"]
    assert rows[0].time_ratio == 1.0 and rows[0].peak_mib == 128 * 128 * 4 / 2**20
    assert rows[2].mem_ratio == pytest.approx(3.0)  # result + concatenation of two
    out = capsys.readouterr().out
    assert "einsum" in out and "x base" in out


def test_compare_raises_on_disagreement_after_printing(capsys):
    x = torch.randn(16)
    with pytest.raises(MismatchError, match="'wrong' do not agree with 'right'"):
        compare({"right": lambda: x * 2, "wrong": lambda: x * 2 + 1e-3}, reps=1)
    assert "DISAGREES (max abs diff 1.0e-03)" in capsys.readouterr().out


def test_compare_checks_structure_and_baseline():
    with pytest.raises(MismatchError):
        compare({"a": lambda: torch.ones(2), "b": lambda: torch.ones(3)}, reps=1, show=False)
    with pytest.raises(LeanpropValueError, match="baseline='c'"):
        compare({"a": lambda: 1}, baseline="c")
    with pytest.raises(LeanpropValueError, match="no variants"):
        compare({})


def test_compare_checks_every_kind_of_result():
    """Numbers were not compared (1.0 vs 2.0 agreed); NaN and inf at the same places agree;
    dicts compare by key; a list of variants is refused."""
    nan = float("nan")
    cases = [
        (1.0, 2.0, False), (1.0, 1.0, True), (3, 3, True), (1 + 2j, 1 + 3j, False),
        (nan, nan, True), (float("inf"), float("inf"), True), (float("inf"), -float("inf"), False),
        (torch.tensor([1.0, nan, float("inf")]), torch.tensor([1.0, nan, float("inf")]), True),
        (torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0]), False),
        ({"a": torch.ones(2), "b": 1.0}, {"b": 1.0, "a": torch.ones(2)}, True),
        ({"a": 1.0}, {"b": 1.0}, False), ("x", "x", True), ("x", "y", False),
        (torch.tensor([1, 2]), torch.tensor([1, 3]), False),
        (np.array([1.0, 2.0]), np.array([1.0, 2.0]), True),
        (np.array([1.0, 2.0]), np.array([1.0, 2.5]), False),
        (torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), True),  # objects: not compared
    ]  # fmt: skip
    for a, b, agrees in cases:
        rows = compare({"ref": lambda b=b: b, "got": lambda a=a: a}, reps=1, show=False,
                       check=False)  # fmt: skip
        from leanprop.measure.compare import _agreement

        assert _agreement(a, b, 1e-5, 1e-7)[0] is agrees, (a, b)
        del rows
    with pytest.raises(MismatchError):
        compare({"ref": lambda: 1.0, "got": lambda: 2.0}, reps=1, show=False)
    with pytest.raises(LeanpropValueError, match=r"variants as a list.*dict"):
        compare([lambda: 1.0])


def test_compare_per_sample_against_loop():
    """leanprop vs the per-sample loop, through the public comparison API."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def ours():
        with leanprop.per_sample(model, leanprop.BatchGrad()):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad()
        return [p.grad_batch for p in model.parameters()]

    def loop():
        from leanprop.testing import individual_gradients

        def loss(o, t, r):
            return torch.nn.functional.cross_entropy(o, t, reduction=r)

        return list(individual_gradients(model, loss, x, y, "mean").values())

    rows = compare({"loop": loop, "leanprop": ours}, reps=1, rtol=1e-5, atol=1e-6, show=False)
    assert rows[1].agrees is True
