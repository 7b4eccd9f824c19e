"""Slow, obvious oracles for per-sample quantities, used by the tests and offered to users.

They loop over the samples one at a time with ordinary autograd: nothing clever, so they are
easy to trust and slow. Tolerances: float64 results should match leanprop to ~1e-10 relative.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from .errors import LeanpropValueError

LossFn = Callable[[Tensor, Tensor, str], Tensor]
REDUCTIONS = ("mean", "sum")


def individual_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    reduction: Literal["mean", "sum"] = "mean",
    create_graph: bool = False,
) -> dict[str, Tensor]:
    """Contribution of each sample to the batch gradient, by a loop over samples.

    ``c_n = grad f_n`` for ``reduction="sum"`` and ``grad f_n / N`` for ``"mean"``, where
    ``f_n = loss_fn(model(x[n:n+1]), y[n:n+1], "sum")`` is sample n's own loss.

    Args:
        model: a module whose output for a batch is the concatenation of per-sample outputs.
        loss_fn: ``loss_fn(output, target, reduction)`` reducing over samples with
            ``reduction`` (``"mean"`` or ``"sum"``).
        x: inputs ``[N, ...]``; y: targets ``[N, ...]``.
        reduction: how the batch loss reduces over samples.
        create_graph: keep the graph so the result can be differentiated.

    Returns:
        ``{name: [N, *p.shape]}`` for every trainable parameter (zeros where unused).
    """
    if reduction not in REDUCTIONS:
        raise LeanpropValueError(
            f"individual_gradients() got reduction={reduction!r}; allowed: 'mean', 'sum' "
            "(the batch loss must be a mean or a sum of per-sample losses)."
        )
    names, params = zip(
        *[(k, p) for k, p in model.named_parameters() if p.requires_grad], strict=True
    )
    n = x.shape[0]
    rows = []
    for i in range(n):
        loss = loss_fn(model(x[i : i + 1]), y[i : i + 1], "sum")
        grads = torch.autograd.grad(loss, params, create_graph=create_graph, allow_unused=True)
        if reduction == "mean":
            grads = [None if g is None else g / n for g in grads]
        rows.append(
            [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        )
    return {
        k: torch.stack([r[j] for r in rows]) if rows else params[j].new_zeros(0, *params[j].shape)
        for j, k in enumerate(names)
    }


def clipped_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    max_grad_norm: float | dict[str, float],
) -> tuple[dict[str, Tensor], Tensor]:
    """DP-SGD's clipped sum by a loop over samples: ``sum_n min(1, C / (||g_n|| + 1e-6)) g_n``
    with ``g_n = grad f_n`` each sample's own gradient (``f_n`` as in
    :func:`individual_gradients`), ``||g_n||`` over all trainable parameters (``max_grad_norm``
    a number) or per parameter (a dict of thresholds by name).

    Returns:
        ``({name: clipped sum}, [N] norms of g_n over all parameters)``.
    """
    per = individual_gradients(model, loss_fn, x, y, "sum")
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per.values()]).sum(0).sqrt()
    out = {}
    for k, g in per.items():
        if isinstance(max_grad_norm, dict):
            own = g.flatten(1).square().sum(1).sqrt()
            a = (max_grad_norm[k] / (own + 1e-6)).clamp(max=1.0)
        else:
            a = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        out[k] = torch.tensordot(a, g, dims=1)
    return out, norms


def individual_gradients_of_losses(
    losses: Tensor, params: dict[str, Tensor], reduction: Literal["mean", "sum"] = "sum"
) -> dict[str, Tensor]:
    """Contribution of each sample, from the per-sample losses of *one* batch forward.

    ``c_n = grad losses[n]`` (``/ N`` for ``reduction="mean"``), one backward through the
    batch graph per sample: the dropout masks and any other randomness are those of that
    forward, so this is the oracle for models in training mode. Valid when sample n's loss
    depends on sample n only. The graph must be retained (it is retained here as well).

    Args:
        losses: ``[N]`` per-sample losses of the batch forward.
        params: ``{name: parameter}`` to differentiate.
    """
    if reduction not in REDUCTIONS:
        raise LeanpropValueError(
            f"individual_gradients_of_losses() got reduction={reduction!r}; allowed: 'mean', 'sum'."
        )
    names, tensors = list(params), list(params.values())
    n = losses.shape[0]
    rows = []
    for i in range(n):
        grads = torch.autograd.grad(losses[i], tensors, retain_graph=True, allow_unused=True)
        rows.append(
            [
                torch.zeros_like(p) if g is None else (g / n if reduction == "mean" else g)
                for p, g in zip(tensors, grads, strict=True)
            ]
        )
    return {
        k: torch.stack([r[j] for r in rows]) if rows else tensors[j].new_zeros(0, *tensors[j].shape)
        for j, k in enumerate(names)
    }


def quantities_from_individual(grads: Tensor) -> dict[str, Tensor]:
    """Reference quantities from individual gradients ``[N, *shape]`` (BackPACK definitions)."""
    n = grads.shape[0]
    return {
        "grad_batch": grads,
        "batch_l2": grads.reshape(n, math.prod(grads.shape[1:])).pow(2).sum(1),
        "batch_dot": torch.stack(
            [torch.stack([(grads[i] * grads[j]).sum() for j in range(n)]) for i in range(n)]
        )
        if n
        else grads.new_zeros(0, 0),
        "sum_grad_squared": grads.pow(2).sum(0),
        "variance": grads.var(0, unbiased=False) if grads.shape[0] else grads.sum(0) * float("nan"),
    }


def ggn_blocks(
    model: nn.Module,
    x: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    y: Tensor,
    differentiable: bool = False,
) -> dict[str, tuple[Tensor, Tensor]]:
    """The generalized Gauss-Newton matrix ``G = J^T H J`` by brute force (full Jacobians of
    the output with respect to each parameter, the loss's full Hessian with respect to the
    output), for checking curvature quantities on small problems. ``differentiable``: as a
    function of the parameters (``J`` and ``H`` both), for checking derivatives.

    Returns:
        ``name -> (G_pp [P, P], per-sample diagonals [N, P])`` for each trainable parameter
        (P its number of elements): the parameter's diagonal block of G, and each sample's
        share of its diagonal ``diag(J_n^T H_nn J_n)``.
    """
    from torch.func import functional_call, jacrev

    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    out = functional_call(model, params, (x,))
    n, k = out.shape[0], out[0].numel()
    if differentiable:  # (by autograd: torch.func's derivative of jacrev through layer_norm
        # is wrong in torch 2.13, 60 % off against finite differences)
        names = list(params)
        found = torch.autograd.functional.jacobian(
            lambda *ps: functional_call(model, dict(zip(names, ps, strict=True)), (x,)),
            tuple(params.values()), create_graph=True,
        )  # fmt: skip
        jac = dict(zip(names, found, strict=True))
    else:
        jac = jacrev(lambda ps: functional_call(model, ps, (x,)))(params)
    at = out if differentiable else out.detach()
    hess = torch.autograd.functional.hessian(
        lambda o: loss_fn(o, y), at, create_graph=differentiable
    )
    h = hess.reshape(n, k, n, k)
    h_nn = torch.diagonal(h, dim1=0, dim2=2).permute(2, 0, 1)  # [N, K, K]
    blocks = {}
    for name, p in params.items():
        j = jac[name].reshape(n, k, p.numel())
        full = torch.einsum("akp,akbl,blq->pq", j, h, j)
        per = torch.einsum("nkp,nkl,nlp->np", j, h_nn, j)
        blocks[name] = (full, per)
    return blocks


def hessian_blocks(
    model: nn.Module,
    x: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    y: Tensor,
    differentiable: bool = False,
) -> dict[str, Tensor]:
    """Each trainable parameter's diagonal block of the loss's Hessian by brute force
    (autograd's full Hessian with respect to that parameter, the others held fixed), for
    checking ``HMP`` on small problems whose forward is deterministic. ``differentiable``: as
    functions of the parameters, for checking derivatives.

    Returns:
        ``name -> H_pp [P, P]`` (P the parameter's number of elements).
    """
    from torch.func import functional_call

    params = {
        k: p if differentiable else p.detach()
        for k, p in model.named_parameters()
        if p.requires_grad
    }
    out = {}
    for name, p in params.items():

        def loss_of(w: Tensor, name: str = name) -> Tensor:
            return loss_fn(functional_call(model, {**params, name: w}, (x,)), y)

        h = torch.autograd.functional.hessian(loss_of, p, create_graph=differentiable)
        out[name] = h.reshape(p.numel(), p.numel())
    return out


def hessian_diagonals(
    model: nn.Module,
    x: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    y: Tensor,
    differentiable: bool = False,
) -> dict[str, tuple[Tensor, Tensor]]:
    """The Hessian's diagonal by brute force (autograd's full Hessian of the loss with respect
    to each parameter), and each sample's share (the Hessian of the loss with every other
    sample's output held fixed at its value), for checking ``DiagHessian`` on small problems
    whose model keeps samples apart (no BatchNorm in training mode, no dropout) and whose
    output holds them in dimension 0. ``differentiable``: as functions of the parameters,
    for checking derivatives.

    Returns:
        ``name -> (diagonal p.shape, per-sample diagonals [N, *p.shape])`` for each trainable
        parameter.
    """
    from torch.func import functional_call

    params = {
        k: p if differentiable else p.detach()
        for k, p in model.named_parameters()
        if p.requires_grad
    }
    with torch.set_grad_enabled(differentiable):
        fixed = functional_call(model, params, (x,))
    n = x.shape[0]
    out = {}
    for name, p in params.items():

        def loss_of(w: Tensor, only: int | None = None, name: str = name) -> Tensor:
            o = functional_call(model, {**params, name: w}, (x,))
            if only is not None:  # sample `only`'s output live, the others' fixed
                keep = torch.zeros(n, dtype=torch.bool, device=o.device)
                keep[only] = True
                o = torch.where(keep.view(-1, *[1] * (o.dim() - 1)), o, fixed)
            return loss_fn(o, y)

        def diag(f: Callable[[Tensor], Tensor], p: Tensor = p) -> Tensor:
            h = torch.autograd.functional.hessian(f, p, create_graph=differentiable)
            return h.reshape(p.numel(), p.numel()).diagonal().view_as(p)

        full = diag(loss_of)
        per = torch.stack([diag(lambda w, i=i: loss_of(w, i)) for i in range(n)])
        out[name] = (full, per)
    return out
