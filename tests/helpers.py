"""Assertions with failure messages that name the worst entries."""

from __future__ import annotations

import torch
from torch import Tensor


def assert_close(actual: Tensor, expected: Tensor, what: str, rtol: float, atol: float) -> None:
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    if torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True):
        return
    err = (actual - expected).abs() - rtol * expected.abs()
    flat = err.flatten().nan_to_num(float("inf"))
    worst = flat.topk(min(3, flat.numel())).indices
    lines = [
        f"  at {tuple(int(j) for j in torch.unravel_index(torch.tensor(i), actual.shape))}: "
        f"got {actual.flatten()[i].item():.6g}, expected {expected.flatten()[i].item():.6g}"
        for i in worst.tolist()
    ]
    raise AssertionError(
        f"{what} differs (rtol={rtol}, atol={atol}); worst entries:\n" + "\n".join(lines)
    )
