"""The GGN's diagonals of models made of linear layers on ``[N, I]`` inputs, from all the loss
factor's columns at once.

``ggn.py`` runs one backward pass per column of the loss Hessian's factor ``V`` ``[M, N, *S]``
through the per-sample engine (any layer, any graph). Where every parameter belongs to a linear
layer whose input is ``[N, I]`` (an MLP), each column's individual gradient of a weight is the
outer product ``S[m, n] ⊗ a[n]`` of the column backpropagated to the layer's output,
``S`` ``[M, N, O]``, and the layer's input ``a``. One backward pass of all M columns together
(``torch.func.vmap`` over the backward) gives every layer's ``S``; then::

    diag(G_W) = sum_{m,n} S[m,n]² ⊗ a[n]²,   diag(G_b) = sum_{m,n} S[m,n]²

(each sample's share without the sum over n), and Kronecker factors ``B = SᵀS``. This replaces
M passes through the engine by one, and the per-sample work by two products per layer. The
Hessian's terms of a curved activation (``hessian.py``: one column per unit and sign) go back
the same way where linear layers alone lie behind the activation, in batches of columns.

For the Kronecker factors alone (KFLR, KFAC) the layers may be convolutions too: ``B`` needs
only each column's output gradient (summed over the output positions) and ``A`` the saved
input, so the columns go back by autograd to the layers' outputs, one at a time (a CNN's
output gradients are large), with no per-sample work.

It applies where the graph between the output and the parameters holds only torch's own
autograd nodes and the replaced linear ops (``fused.py``; for the factors alone, also
convolutions) whose input has the samples first (``[N, I]`` for a linear layer), each
parameter reached through exactly one of them; anywhere else (and for the square roots and
products), ``ggn.py``'s passes run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from ..capture import PerSample
from ..stats import widen
from .contexts import own_work
from .hessian import Curved
from .kronecker import CONVS, input_factor, output_factor, unsupported_conv
from .quantities import CurvatureQuantity


def linear_layer(node: Any) -> bool:
    """A replaced linear op whose input is ``[N, I]``, one row per sample (not rows of
    ``[N * T, I]``: samples flattened with another dimension)."""
    if type(node).__name__ != "FusedOpBackward" or not isinstance(node.module, nn.Linear):
        return False
    x, bd = node.saved_tensors[0], node.call.in_bd
    return x.dim() == 2 and bd.dim == 0 and bd.inner == 1 and x.shape[0] == node.call.n


def kronecker_layer(node: Any) -> bool:
    """A :func:`linear_layer`, or a replaced convolution whose input is ``[N, C, *S]`` with
    the samples first and whose Kronecker factors are defined (``kronecker.py``): the layers
    whose Kronecker factors (alone) the columns give."""
    if linear_layer(node):
        return True
    if type(node).__name__ != "FusedOpBackward" or not isinstance(node.module, CONVS):
        return False
    x, bd = node.saved_tensors[0], node.call.in_bd
    return (
        bd.dim == 0 and bd.inner == 1 and x.shape[0] == node.call.n
        and unsupported_conv(node.module) is None
    )  # fmt: skip


def linear_layers(
    root: Any, params: Sequence[nn.Parameter], accept: Callable[[Any], bool] = linear_layer
) -> list[Any] | None:
    """The replaced linear ops (``accept``: the layers taken) between autograd node ``root``
    (an output's ``grad_fn``, or an activation input's node) and ``params``, if the graph is
    one the batched columns cover (see the module docstring), else None."""
    wanted = {id(p) for p in params}
    layers, seen, todo = [], set(), [root]
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
            if not accept(node):
                return None
            layers.append(node)
        for child, _ in node.next_functions:
            leaf = getattr(child, "variable", None)
            if leaf is not None and id(leaf) in wanted:
                if not (isinstance(node, BackwardCFunction) and accept(node)):
                    return None  # a parameter used outside the layers taken
                parents[id(leaf)] = parents.get(id(leaf), 0) + 1
            todo.append(child)
    if any(count > 1 for count in parents.values()):  # (shared: two layers, or twice in one)
        return None
    return layers


def column_squares(
    contexts: Sequence[PerSample],
    start: Tensor | GradientEdge,
    columns: Tensor,
    layers: list[Any],
) -> list[Tensor | None]:
    """``sum_m S[m]²`` ``[N, O]`` at each of ``layers``' outputs (see :func:`layer_columns`;
    None where a layer is not reached)."""
    found = layer_columns(contexts, start, columns, layers)
    with own_work(contexts):  # (the squares: ours, not the model's)
        return squares_of(found)


def squares_of(found: Sequence[Tensor | None]) -> list[Tensor | None]:
    """``sum_m S[m]²`` ``[N, O]`` of each layer's columns ``S`` (16-bit ones in float32;
    ``vector_norm`` over the leading dimension is several times slower on CPU)."""
    return [None if s is None else widen(s).square().sum(0) for s in found]


def layer_columns(
    contexts: Sequence[PerSample],
    start: Tensor | GradientEdge,
    columns: Tensor,
    layers: list[Any],
) -> list[Tensor | None]:
    """``S`` ``[M, N, O]`` at each of ``layers``' outputs: the ``columns``
    ``[M, *start.shape]`` backpropagated from ``start`` all at once (None where a layer is not
    reached); the layer whose output ``start`` is (an activation's input) gets the columns.
    Along a chain of linear layers and the activations :data:`_CHAIN_RULES` knows (an MLP):
    by their Jacobians directly; anywhere else, by autograd (vmapped over the columns)."""
    with own_work(contexts):  # (products of ours, not the model's ops)
        chained = _along_chain(start, columns, layers)
    if chained is not None:
        return chained
    direct = start.node if isinstance(start, GradientEdge) else None
    upstream = [node for node in layers if node is not direct]
    found = dict.fromkeys(layers)
    with ExitStack() as stack:
        for c in contexts:  # (a pass of ours: no per-sample work, nothing recorded, and no
            stack.enter_context(c.computing(frozenset()))  # parameter's gradient formed)
            stack.enter_context(c.for_layer_outputs())
        if upstream:
            edges = [GradientEdge(node, 0) for node in upstream]

            def backward(column: Tensor) -> tuple[Tensor | None, ...]:
                return torch.autograd.grad(
                    start, edges, column, retain_graph=True, allow_unused=True
                )

            # (torch.func's vmap: autograd's is_grads_batched uses the older one, which loops
            # over the columns for ops without a batching rule of its own, e.g. matmul)
            with warnings.catch_warnings():  # (functorch's note on an op it loops over)
                warnings.filterwarnings("ignore", "There is a performance drop")
                grads = torch.func.vmap(backward)(columns)
            found.update(zip(upstream, grads, strict=True))
        if direct in found:
            found[direct] = columns
    return [None if s is None else s.detach() for s in found.values()]


# the backward of an elementwise activation on the columns [M, N, ...], from its result r
_CHAIN_RULES = {
    "ReluBackward0": lambda r, s: s * (r > 0),
    "SigmoidBackward0": lambda r, s: s * (r * (1 - r)),
    "TanhBackward0": lambda r, s: s * (1 - r * r),
}


def _along_chain(start: Tensor | GradientEdge, columns: Tensor, layers: list[Any]) -> (
    list[Tensor | None] | None
):  # fmt: skip
    """:func:`layer_columns` where the graph from ``start`` to the last of ``layers`` is one
    chain of them and of activations in :data:`_CHAIN_RULES`, each activation's result the
    input of the layer after it: the columns times each Jacobian in turn (``S @ W`` through a
    layer), from what the layers saved. None anywhere else, and where a layer's saved tensors
    go through hooks (a checkpoint would recompute its block outside any backward)."""
    node = start.node if isinstance(start, GradientEdge) else start.grad_fn
    if isinstance(start, GradientEdge) and start.output_nr != 0:
        return None
    found: dict[Any, Tensor] = {}
    left, s, result = set(layers), columns.detach(), None
    while left:
        if node in left and not node.hooked and isinstance(node.module, nn.Linear):
            found[node] = s
            left.discard(node)
            if not left:
                break
            x, weight = node.saved_tensors  # (the weight: saved where x needs its gradient)
            if weight is None or weight.dtype != s.dtype:  # (autocast: autograd's way)
                return None
            s, result = s @ weight.detach(), x.detach()  # (x W^T + b: x's gradient is S W)
            node = node.next_functions[0][0]  # (x: the first tensor FusedOp.apply takes)
        elif type(node).__name__ in _CHAIN_RULES and result is not None:
            s, result = _CHAIN_RULES[type(node).__name__](result, s), None
            node = node.next_functions[0][0]
        else:
            return None
    return [found.get(node) for node in layers]


def column_results(
    contexts: Sequence[PerSample],
    output: Tensor,
    factor: Tensor,
    layers: list[Any],
    params: list[nn.Parameter],
    quantities: list[CurvatureQuantity],
    results: list[dict[str, object]],
) -> bool:
    """Write ``quantities`` (:func:`covers` them) of ``layers``' parameters to ``results``
    from the loss factor's columns ``factor`` ``[M, *output.shape]``: all at once through
    linear layers; a column at a time where there are convolutions (Kronecker factors alone:
    their output gradients are large, and each column's ``B`` adds up). Returns True (for
    ``_batched``: None where vmap cannot run the backward)."""
    diagonals = any(not q.kronecker for q in quantities)
    kronecker = any(q.kronecker for q in quantities)
    linear = all(isinstance(node.module, nn.Linear) for node in layers)
    step = factor.shape[0] if linear else 1
    squares: list[Tensor | None] = [None] * len(layers)
    outer: list[Tensor | None] = [None] * len(layers)
    for start in range(0, factor.shape[0], step):
        found = layer_columns(contexts, output, factor[start : start + step], layers)
        with own_work(contexts):
            if diagonals:
                squares = _added(squares, squares_of(found))
            if kronecker:
                outer = _added(outer, output_factors(layers, found))
    with own_work(contexts):
        add_diagonals(layers, squares, params, quantities, results)
        add_kronecker_factors(layers, outer, params, quantities, results)
    return True


def _added(a: Sequence[Tensor | None], b: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Two lists of values added elementwise (None: no value)."""
    return [x if y is None else y if x is None else x + y for x, y in zip(a, b, strict=True)]


def output_factors(layers: list[Any], found: Sequence[Tensor | None]) -> list[Tensor | None]:
    """``B = sum_{m,n} S S^T`` ``[O, O]`` of each layer from its columns ``S``
    (:func:`layer_columns`, ``[M, N, O]`` or a convolution's ``[M, N, C_out, *S]``:
    ``kronecker.output_factor`` of the columns' gradients together); None where a layer is
    not reached.
    Additive over the columns: the sum of those of column chunks is that of all."""
    return [None if s is None else output_factor(s.flatten(0, 1)) for s in found]


def add_kronecker_factors(
    layers: list[Any],
    outer: Sequence[Tensor | None],
    params: list[nn.Parameter],
    quantities: list[CurvatureQuantity],
    results: list[dict[str, object]],
) -> None:
    """KFLR/KFAC (``kronecker.py``'s definition) of each layer from its
    :func:`output_factors` ``B``: weight ``[B, A]``, bias ``[B]``, with ``A`` the input's
    factor (``1/N sum_n a_n a_n^T`` of a linear layer's input ``[N, I]``)."""
    if not any(q.kronecker for q in quantities):
        return
    a_of: dict[Any, Tensor] = {}  # layer -> A
    for node, b, name, i in _layer_params(layers, outer, params):
        if name == "weight":
            if node not in a_of:
                a_of[node] = input_factor(node.module, node.saved_tensors[0].detach())
            factors = [b, a_of[node]]
        else:
            factors = [b]
        for q in quantities:
            if q.kronecker:
                results[i][q.attr] = factors


def add_diagonals(
    layers: list[Any],
    squares: Sequence[Tensor | None],
    params: list[nn.Parameter],
    quantities: list[CurvatureQuantity],
    results: list[dict[str, object]],
    sign: float = 1.0,
) -> None:
    """Add ``sign`` times each layer's diagonal terms from its :func:`column_squares` ``t``
    ``[N, O]`` to ``results`` (set where there is none yet): weight ``t[n] ⊗ a[n]²`` each
    sample's (their sum ``tᵀ a²``), bias ``t[n]``."""
    for node, t, name, i in _layer_params(layers, squares, params):
        a2 = None  # [N, I], for the weight
        taken = False  # (t itself is one quantity's, not two results' shared)
        for q in quantities:
            if q.kronecker:
                continue
            if name == "bias":
                value = (t.clone() if taken else t) if q.per_sample else t.sum(0)
                taken = taken or q.per_sample
            else:
                if a2 is None:
                    a2 = widen(node.saved_tensors[0].detach()).square()
                value = t[:, :, None] * a2[:, None, :] if q.per_sample else t.t() @ a2
            old = results[i].get(q.attr)  # (no copy of a value added as it is)
            if old is not None:
                results[i][q.attr] = torch.add(old, value, alpha=sign)
            else:
                results[i][q.attr] = value if sign == 1.0 else sign * value


def _layer_params(
    layers: list[Any], values: Sequence[Tensor | None], params: list[nn.Parameter]
) -> Iterator[tuple[Any, Tensor, str, int]]:
    """``(layer, its value, parameter name, index in params)`` for each parameter of each
    layer that has a value and is among ``params``."""
    index = {id(p): i for i, p in enumerate(params)}
    for node, value in zip(layers, values, strict=True):
        if value is None:
            continue
        for name, p in node.call.params.items():
            if id(p) in index:
                yield node, value, name, index[id(p)]


def covers(quantities: Sequence[CurvatureQuantity]) -> bool:
    """Whether the batched columns give all of ``quantities`` (diagonals, summed or each
    sample's, and Kronecker factors)."""
    return all(not (q.root or q.product or q.second_order) for q in quantities)


_COLUMN_BYTES = 64 * 2**20  # the columns and their gradients at the layers, per batch of them


def residual_squares(
    contexts: Sequence[PerSample], act: Curved, r: Tensor, sign: float, layers: list[Any]
) -> list[Tensor | None]:
    """:func:`column_squares` of one part of an activation's residual term (``hessian.py``'s
    :func:`residual_columns`: ``sqrt(max(0, sign r))`` at one unit of every sample per
    column), for an activation input ``[N, K]``: its columns in batches."""
    root = (sign * r).clamp(min=0).sqrt()  # [N, K]
    n, k = root.shape
    units = root.any(0).nonzero().flatten()
    widths = k + sum(node.call.site.module.out_features for node in layers)
    step = max(1, _COLUMN_BYTES // max(1, n * widths * root.element_size()))
    total: list[Tensor | None] = [None] * len(layers)
    for start in range(0, len(units), step):
        chunk = units[start : start + step]
        columns = root.new_zeros(len(chunk), n, k)
        picked = torch.arange(len(chunk), device=root.device)
        columns[picked, :, chunk] = root[:, chunk].t()
        total = _added(total, column_squares(contexts, act.z, columns, layers))
    return total
