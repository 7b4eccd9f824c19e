"""The GGN's diagonals of models made of linear layers on ``[N, I]`` inputs, from all the loss
factor's columns at once.

``ggn.py`` runs one backward pass per column of the loss Hessian's factor ``V`` ``[M, N, *S]``
through the per-sample engine (any layer, any graph). Where every parameter belongs to a linear
layer whose input is ``[N, I]`` (an MLP), each column's individual gradient of a weight is the
outer product ``S[m, n] ⊗ a[n]`` of the column backpropagated to the layer's output,
``S`` ``[M, N, O]``, and the layer's input ``a``. One backward pass of all M columns together
(``is_grads_batched``: autograd's vmap) gives every layer's ``S``; then::

    diag(G_W) = sum_{m,n} S[m,n]² ⊗ a[n]²,   diag(G_b) = sum_{m,n} S[m,n]²

(each sample's share without the sum over n). This replaces M passes through the engine by
one, and the per-sample work by two products per layer.

It applies where the graph between the output and the parameters holds only torch's own
autograd nodes and the replaced linear ops (``fused.py``) whose input is ``[N, I]`` with the
samples first, each parameter reached through exactly one of them; anywhere else (and for the
square roots, products and Kronecker factors), ``ggn.py``'s passes run.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from ..capture import PerSample
from ..stats import widen
from .contexts import own_work
from .quantities import CurvatureQuantity


def _linear_layer(node: Any) -> bool:
    """A replaced linear op whose input is ``[N, I]`` with the samples first."""
    if type(node).__name__ != "FusedOpBackward" or not isinstance(node.module, nn.Linear):
        return False
    x = node.saved_tensors[0]
    return x.dim() == 2 and node.call.in_bd.dim == 0


def linear_layers(output: Tensor, params: Sequence[nn.Parameter]) -> list[Any] | None:
    """The replaced linear ops between ``output`` and ``params``, if the model is one the
    batched columns cover (see the module docstring), else None."""
    wanted = {id(p) for p in params}
    layers, seen, todo = [], set(), [output.grad_fn]
    parents: dict[int, int] = {}  # id(parameter) -> nodes reaching it
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad
            continue
        if isinstance(node, BackwardCFunction):  # a Python autograd function
            if not _linear_layer(node):
                return None
            layers.append(node)
        for child, _ in node.next_functions:
            leaf = getattr(child, "variable", None)
            if leaf is not None and id(leaf) in wanted:
                if not (isinstance(node, BackwardCFunction) and _linear_layer(node)):
                    return None  # a parameter used outside a linear layer
                parents[id(leaf)] = parents.get(id(leaf), 0) + 1
            todo.append(child)
    if any(count > 1 for count in parents.values()):  # (shared: two layers, or twice in one)
        return None
    return layers


def batched_diagonals(
    contexts: Sequence[PerSample],
    output: Tensor,
    factor: Tensor,
    layers: list[Any],
    params: list[nn.Parameter],
    quantities: list[CurvatureQuantity],
    results: list[dict[str, object]],
) -> None:
    """The diagonal quantities (summed, and each sample's) of ``params`` into ``results``,
    from one batched backward of ``factor`` ``[M, *output.shape]`` to the ``layers``."""
    with ExitStack() as stack:
        for c in contexts:  # (a pass of ours: no per-sample work, nothing recorded, and no
            stack.enter_context(c.computing(frozenset()))  # parameter's gradient formed)
            stack.enter_context(c.for_layer_outputs())
        edges = [GradientEdge(node, 0) for node in layers]
        found = torch.autograd.grad(
            output, edges, factor, retain_graph=True, allow_unused=True, is_grads_batched=True
        )
        stack.enter_context(own_work(contexts))  # (the products: ours, not the model's)
        _diagonals(layers, found, params, quantities, results)


def _diagonals(
    layers: list[Any],
    found: Sequence[Tensor | None],
    params: list[nn.Parameter],
    quantities: list[CurvatureQuantity],
    results: list[dict[str, object]],
) -> None:
    index = {id(p): i for i, p in enumerate(params)}
    for node, s in zip(layers, found, strict=True):
        if s is None:
            continue
        a2 = widen(node.saved_tensors[0].detach()).square()  # [N, I]
        t = widen(s.detach()).square().sum(0)  # [N, O]: sum over the columns of S²
        for name, p in node.call.params.items():
            i = index.get(id(p))
            if i is None:
                continue
            for q in quantities:
                if name == "bias":
                    value = t if q.per_sample else t.sum(0)
                else:  # each sample's t[n] ⊗ a²[n], or their sum tᵀ a²
                    value = t[:, :, None] * a2[:, None, :] if q.per_sample else t.t() @ a2
                results[i][q.attr] = value


def covers(quantities: Sequence[CurvatureQuantity]) -> bool:
    """Whether the batched columns give all of ``quantities`` (diagonals, summed or each
    sample's)."""
    return all(not (q.root or q.product or q.kronecker or q.second_order) for q in quantities)
