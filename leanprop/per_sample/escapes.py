"""Parameters that reach the loss after the samples were combined.

A value computed from the parameters alone (a penalty ``λ·||w||²``, a temperature) joined with
one in which the samples were summed together (the mean loss: ``batch.Combined``) gives the
parameters a part of their gradient that is no sample's: per-sample quantities cannot add up to
the gradient, however small that part is. The op interception passes each such operand through
:class:`EscapeWatch`, whose backward receives exactly the gradient of that use: where it gives
a parameter a gradient that is not zero (``loss + 0.0 * sum(p.sum() ...)``, DDP's idiom for
unused parameters, gives none), the use is reported and the check refuses the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from .._torch_compat import saveable


class EscapeWatch(torch.autograd.Function):
    """The identity on ``t``; its backward hands the gradient of this use to ``on_gradient``
    (with ``t``) before passing it on."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, on_gradient: Callable[[Tensor, Tensor], None]) -> Tensor:
        ctx.on_gradient = on_gradient
        ctx.save_for_backward(saveable(t))
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        (t,) = ctx.saved_tensors
        ctx.on_gradient(t, g)
        return g, None


def reached(t: Tensor | GradientEdge, params: list[nn.Parameter], g: Tensor) -> list[nn.Parameter]:
    """The ``params`` to which the gradient ``g`` of ``t`` (a tensor, or the edge of a tensor's
    value before an in-place op) gives a gradient that is not zero (one more backward pass
    through ``t``'s graph, which holds parameters only)."""
    grads = torch.autograd.grad(t, params, g, retain_graph=True, allow_unused=True)
    return [p for p, gp in zip(params, grads, strict=True) if gp is not None and bool(gp.any())]
