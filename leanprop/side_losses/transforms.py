"""Gradient transforms: identity in forward, the gradient changed in backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..errors import LeanpropValueError


class _TransformGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.fn = fn
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        out = ctx.fn(g)
        if not isinstance(out, Tensor) or out.shape != g.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise LeanpropValueError(
                f"transform_grad(): fn(grad) returned {got} for a gradient of shape "
                f"{tuple(g.shape)}; it must return the new gradient, a tensor of the same shape "
                "(return grad itself to leave it unchanged, torch.zeros_like(grad) to stop it)."
            )
        return out, None


def transform_grad(h: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Identity in forward; in backward the gradient ``g`` flowing into ``h`` becomes ``fn(g)``.

    ``fn`` is written with differentiable ops if ``create_graph=True`` is used.
    """
    if not isinstance(h, Tensor) or not callable(fn):
        raise LeanpropValueError(
            "transform_grad(h, fn) needs a tensor h and a callable fn(grad) -> grad."
        )
    return _TransformGrad.apply(h, fn)


def scale_grad(h: Tensor, s: float | Tensor) -> Tensor:
    """Identity in forward; backward multiplies the gradient by ``s``: a number, a scalar
    tensor, or per-sample factors ``[N]`` (broadcast over ``h``'s other dims)."""
    if not isinstance(h, Tensor):
        raise LeanpropValueError(f"scale_grad() needs a tensor h, got {type(h).__name__}.")
    if not (isinstance(s, Tensor) or (isinstance(s, int | float) and not isinstance(s, bool))):
        raise LeanpropValueError(
            f"scale_grad() got s={s!r}; it must be a number, a scalar tensor or per-sample "
            f"factors [{h.shape[0] if h.dim() else 1}]."
        )
    if isinstance(s, Tensor) and s.dim() == 1 and h.dim() > 1:
        if s.shape[0] != h.shape[0]:
            raise LeanpropValueError(
                f"scale_grad() got per-sample factors of shape {tuple(s.shape)} for h of shape "
                f"{tuple(h.shape)}; they need one factor per sample, [{h.shape[0]}]."
            )
        s = s.reshape(-1, *([1] * (h.dim() - 1)))
    elif isinstance(s, Tensor) and s.dim() > 0:
        try:
            ok = torch.broadcast_shapes(s.shape, h.shape) == h.shape
        except RuntimeError:
            ok = False
        if not ok:
            raise LeanpropValueError(
                f"scale_grad() got factors of shape {tuple(s.shape)} for h of shape "
                f"{tuple(h.shape)}; they must broadcast to h's shape (a scalar, or one factor "
                "per sample)."
            )
    return transform_grad(h, lambda g: g * s)
