"""Gradient transforms (transform_grad, scale_grad): the gradient changed in backward, the
forward value untouched, and a wrong result of fn refused."""

from __future__ import annotations

import pytest
import torch

import leanprop
from leanprop import LeanpropValueError, scale_grad, transform_grad


def test_transform_grad_must_return_the_gradient():
    """fn returning None dropped the gradient silently."""
    x = torch.randn(3, 2, requires_grad=True)
    with pytest.raises(LeanpropValueError, match=r"returned NoneType.*same shape"):
        transform_grad(x * 1.0, lambda g: None).sum().backward()
    with pytest.raises(LeanpropValueError, match=r"returned \(2,\)"):
        transform_grad(x * 1.0, lambda g: g[0]).sum().backward()


def test_scale_and_transform_grad():
    x = torch.randn(3, 2, requires_grad=True)
    scale_grad(x, 3.0).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    s = torch.tensor([1.0, 2.0, 0.0])
    scale_grad(x, s).sum().backward()
    assert torch.equal(x.grad, s[:, None].expand(3, 2))
    x.grad = None
    transform_grad(x * 1.0, lambda g: g.clamp(max=0.5)).mul(2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 0.5))
    assert torch.equal(leanprop.scale_grad(x, 2.0), x)
