"""Matrix-free products with the Jacobian, its transpose, the Hessian and the generalized
Gauss-Newton matrix, by autograd alone (BackPACK's ``backpack.hessianfree``, same names).

Vectors are lists of tensors shaped like the tensors they pair with. Jacobian-vector products
use the double-backward identity ``J v = d/du <J^T u, v>`` (``u`` a dummy of the output's
shape), so every product is one or two ordinary backward passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

Tensors = Tensor | Sequence[Tensor]


def _listed(t: Tensors) -> list[Tensor]:
    return [t] if isinstance(t, Tensor) else list(t)


def _done(ts: Sequence[Tensor], detach: bool) -> tuple[Tensor, ...]:
    return tuple(t.detach() for t in ts) if detach else tuple(ts)


def L_op(ys: Tensors, xs: Tensors, ws: Tensors, retain_graph: bool = True, detach: bool = True):
    """``J^T w``: the vector(s) ``ws`` (shaped like ``ys``) times the transposed Jacobian of
    ``ys`` with respect to ``xs``; a tuple shaped like ``xs`` (zeros where unused)."""
    grads = torch.autograd.grad(
        _listed(ys), _listed(xs), _listed(ws), create_graph=True, retain_graph=retain_graph,
        allow_unused=True, materialize_grads=True,
    )  # fmt: skip
    return _done(grads, detach)


def R_op(ys: Tensors, xs: Tensors, vs: Tensors, retain_graph: bool = True, detach: bool = True):
    """``J v``: the Jacobian of ``ys`` with respect to ``xs`` times the vector(s) ``vs``
    (shaped like ``xs``); a tuple shaped like ``ys``."""
    outs = _listed(ys)
    dummies = [torch.zeros_like(y, requires_grad=True) for y in outs]
    vjp = torch.autograd.grad(
        outs, _listed(xs), dummies, create_graph=True, retain_graph=True, allow_unused=True,
        materialize_grads=True,
    )  # fmt: skip
    jvp = torch.autograd.grad(
        vjp, dummies, _listed(vs), create_graph=True, retain_graph=retain_graph,
        allow_unused=True, materialize_grads=True,
    )  # fmt: skip
    return _done(jvp, detach)


def transposed_jacobian_vector_product(f, x, v, retain_graph=True, detach=True):
    """Alias of :func:`L_op`."""
    return L_op(f, x, v, retain_graph=retain_graph, detach=detach)


def jacobian_vector_product(f, x, v, retain_graph=True, detach=True):
    """Alias of :func:`R_op`."""
    return R_op(f, x, v, retain_graph=retain_graph, detach=detach)


def hessian_vector_product(
    f: Tensor, params: Tensors, v: Tensors, grad_params: Tensors | None = None,
    detach: bool = True,
) -> tuple[Tensor, ...]:  # fmt: skip
    """``H v`` with ``H`` the Hessian of the scalar ``f`` with respect to ``params``.

    Args:
        grad_params: the gradient of ``f`` with respect to ``params`` if already computed
            with ``create_graph=True`` (saves one backward).
    """
    if grad_params is None:
        grad_params = torch.autograd.grad(
            f, _listed(params), create_graph=True, retain_graph=True, materialize_grads=True
        )
    return R_op(tuple(_listed(grad_params)), params, v, detach=detach)


def ggn_vector_product_from_plist(
    loss: Tensor, output: Tensor, plist: Sequence[nn.Parameter], v: Sequence[Tensor]
) -> tuple[Tensor, ...]:
    """``G v = J^T H J v`` for the parameters ``plist`` (``J``: the Jacobian of ``output``
    with respect to them, ``H``: the Hessian of ``loss`` with respect to ``output``)."""
    jv = R_op(output, plist, v)
    hjv = hessian_vector_product(loss, output, jv)
    return L_op(output, plist, hjv)


def ggn_vector_product(
    loss: Tensor, output: Tensor, model: nn.Module, v: Sequence[Tensor]
) -> tuple[Tensor, ...]:
    """:func:`ggn_vector_product_from_plist` for all trainable parameters of ``model``."""
    plist = [p for p in model.parameters() if p.requires_grad]
    return ggn_vector_product_from_plist(loss, output, plist, v)
