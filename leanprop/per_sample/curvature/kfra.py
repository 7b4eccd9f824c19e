"""KFRA (Botev et al., 2017; BackPACK's ``KFRA``): Kronecker factors of the GGN's blocks of
a chain of linear layers, with the output-side factor averaged over the batch after every
step back.

At the output, ``B = sum_n H_n`` ``[D, D]`` (the loss Hessians, with the reduction's scale).
Going back through each op between two linear layers (activations, dropout, reshapes: per
sample) with Jacobians ``J_n``: ``B <- 1/N sum_n J_n^T B J_n`` (after every op, as BackPACK
averages after every module); through a layer itself ``B <- W^T B W``. A layer whose output has
``B`` gets weight ``[B, A]`` with ``A = 1/N sum_n a_n a_n^T`` of its inputs ``a`` ``[N, I]``,
bias ``[B]``. With one sample this is KFLR's (the exact GGN block for the last layer).

It applies where the graph is a chain: every parameter belongs to an ``nn.Linear`` on ``[N, I]``
inputs, one row per sample (replaced by the context, or torch's own op where the context
replaces none: the BackPACK facade's), each layer's input reaches back to at most one other
layer (none for the first) and the output to exactly one, through ops taking one
differentiable input each: elementwise ones (activations, dropout; ``J_n = diag(d_n)``, ``d``
from one backward pass of ones) and views keeping the samples first. Any other op between two
layers is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from ...errors import UnsupportedModelError
from ..capture import PerSample
from .batched_columns import linear_layer

_REFUSAL = (
    "KFRA: the model is not a chain of linear layers on [N, I] inputs (BackPACK's KFRA needs "
    "its sequence of supported modules too); {what}. Ask for KFLR or KFAC instead (Kronecker "
    "factors of any layer leanprop covers), or DiagGGNExact."
)


@dataclass(frozen=True, eq=False)
class _Layer:
    """A linear layer in the graph: the autograd node whose output is its output, the module,
    its input ``[N, I]``."""

    node: Any
    module: nn.Linear
    x: Tensor


def _weight_of(edge: tuple[Any, int]) -> Tensor | None:
    """The leaf behind ``weight.t()``'s edge (torch's linear: ``addmm(b, x, w.t())``)."""
    node = edge[0]
    if node is None or node.name() != "TBackward0":
        return None
    return getattr(node.next_functions[0][0], "variable", None)


def _as_layer(node: Any, linears: dict[int, nn.Linear], n: int) -> _Layer | None:
    """``node`` as a linear layer on ``[N, I]`` inputs, one row per sample: a replaced one
    (``fused.py``), or torch's own ``addmm``/``mm`` of an ``nn.Linear``'s weight (a context
    that does not replace ops: the BackPACK facade's); None for any other node."""
    if isinstance(node, BackwardCFunction):  # (a replaced op: of these models' layers only)
        if linear_layer(node) and linears.get(id(node.module.weight)) is node.module:
            return _Layer(node, node.module, node.saved_tensors[0])
        return None
    name = node.name()
    if name == "AddmmBackward0":
        w, x = _weight_of(node.next_functions[2]), node._saved_mat1
    elif name == "MmBackward0":
        w, x = _weight_of(node.next_functions[1]), node._saved_self
    else:
        return None
    module = linears.get(id(w))
    if module is None or x.dim() != 2 or x.shape[0] != n:
        return None
    return _Layer(node, module, x)


def layer_chain(
    output: Tensor, params: Sequence[nn.Parameter], models: Sequence[nn.Module]
) -> list[_Layer]:
    """The linear layers from ``output`` back to the model's input, in that order.

    Raises:
        UnsupportedModelError: the graph is not such a chain (see the module docstring).
    """
    linears = {
        id(m.weight): m for model in models for m in model.modules() if isinstance(m, nn.Linear)
    }
    wanted, n = {id(p) for p in params}, output.shape[0]
    chain: list[_Layer] = []
    reached: set[int] = set()
    start = output.grad_fn
    while start is not None:
        behind: list[_Layer] = []
        seen, todo = set(), [start]
        while todo:  # back to the next layers (not through them)
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            layer = _as_layer(node, linears, n)
            if layer is not None:
                behind.append(layer)
                continue
            if isinstance(node, BackwardCFunction):  # (a layer replaced by a context)
                module = getattr(node, "module", None)
                what = f"'{node.name()}'" if module is None else type(module).__name__
                what = f"it has a {what} layer (not a linear one on [N, I])"
                if module is not None and linear_layer(node):
                    what = (
                        "it reaches a layer outside the context's model (another per_sample "
                        "context's): open one context on the whole model"
                    )
                raise UnsupportedModelError(_REFUSAL.format(what=what))
            for child, _ in node.next_functions:
                leaf = getattr(child, "variable", None)
                if leaf is not None and id(leaf) in wanted:
                    raise UnsupportedModelError(
                        _REFUSAL.format(
                            what="its parameters are not all in linear layers on [N, I] "
                            "inputs, one row per sample, each used once"
                        )
                    )
                todo.append(child)
        if len(behind) > 1:
            raise UnsupportedModelError(
                _REFUSAL.format(what="a layer's input (or the output) depends on two layers")
            )
        if not behind:
            break
        layer = behind[0]
        if id(layer.module) in reached:
            raise UnsupportedModelError(
                _REFUSAL.format(
                    what="its parameters are not all in linear layers on [N, I] inputs, one "
                    "row per sample, each used once"
                )
            )
        reached.add(id(layer.module))
        chain.append(layer)
        start = layer.x.grad_fn
    if not chain:
        raise UnsupportedModelError(
            _REFUSAL.format(
                what="its parameters are not all in linear layers on [N, I] inputs, one row "
                "per sample, each used once"
            )
        )
    return chain


def _ops_between(target: Tensor, layer: Any) -> list[tuple[GradientEdge, GradientEdge]]:
    """The ops from ``layer``'s output to ``target``, as (output, input) edges from
    ``target`` back; each must take one differentiable input (a chain of ops, as BackPACK's
    sequence of modules)."""
    ops, out = [], GradientEdge(target.grad_fn, target.output_nr)
    while out.node is not layer:
        inputs = [(child, nr) for child, nr in out.node.next_functions if child is not None]
        other_function = isinstance(inputs[0][0], BackwardCFunction) if inputs else False
        if len(inputs) != 1 or (other_function and inputs[0][0] is not layer):
            raise UnsupportedModelError(
                _REFUSAL.format(
                    what=f"'{out.node.name()}' between two layers takes {len(inputs)} "
                    "differentiable inputs, or is not a torch op (one input each: activations, "
                    "dropout, reshapes)"
                )
            )
        ops.append((out, GradientEdge(*inputs[0])))
        out = ops[-1][1]
    return ops


# ops between two layers that KFRA carries ``B`` through (autograd node names without their
# "Backward<k>" suffix): elementwise ones (with one differentiable input, the input's shape:
# a diagonal Jacobian per sample), and views that keep the samples first
_ELEMENTWISE = frozenset(
    {"Relu", "Sigmoid", "Tanh", "Gelu", "Silu", "Elu", "Celu", "LeakyRelu", "Softplus",
     "Hardtanh", "Hardswish", "Hardsigmoid", "Mish", "LogSigmoid", "Threshold", "Mul", "Div",
     "Add", "Sub", "Neg", "Clone", "NativeDropout"}
)  # fmt: skip
_VIEWS = frozenset({"View", "UnsafeView", "ReshapeAlias", "Reshape"})


def _kind(node: Any) -> str:
    return node.name().split("Backward")[0]


def _averaged_through(
    contexts: Sequence[PerSample], b: Tensor, target: Tensor, layer: Any, create_graph: bool
) -> Tensor:
    """``b`` (over ``target``'s units per sample) carried back to ``layer``'s output op by op:
    ``b <- 1/N sum_n J_n^T b J_n``. An elementwise op's ``J_n = diag(d_n)`` (``d`` from one
    backward pass of ones): ``b * (d^T d) / N``; a view keeping the samples first leaves ``b``
    as it is. Any other op is refused. ``create_graph``: ``d`` as a function of the
    parameters."""
    n, shape = target.shape[0], tuple(target.shape)
    with ExitStack() as stack:
        for c in contexts:  # (passes of ours: nothing per sample, nothing recorded)
            stack.enter_context(c.computing(frozenset()))
            stack.enter_context(c.for_layer_outputs())
        for out, inp in _ops_between(target, layer):
            ones = torch.ones(shape, dtype=target.dtype, device=target.device)
            (d,) = torch.autograd.grad(out, inp, ones, retain_graph=True, create_graph=create_graph)
            kind, before = _kind(out.node), tuple(d.shape)
            if kind in _ELEMENTWISE and before == shape:
                d = d.reshape(n, -1).to(b.dtype)
                b = b * (d.mT @ d) / n
            elif not (kind in _VIEWS and before[:1] == shape[:1] == (n,)):
                raise UnsupportedModelError(
                    _REFUSAL.format(
                        what=f"'{out.node.name()}' between two layers, from {list(before)} to "
                        f"{list(shape)}, is neither elementwise nor a view keeping the samples "
                        "first"
                    )
                )
            shape = before
    return b


def kfra_factors(
    contexts: Sequence[PerSample], output: Tensor, front: Tensor, batch_dim: int,
    params: Sequence[nn.Parameter], create_graph: bool = False,
) -> dict[nn.Parameter, list[Tensor]]:  # fmt: skip
    """``{weight: [B, A], bias: [B]}`` of each layer of the chain behind ``output`` (its
    samples in ``batch_dim``; see the module docstring); ``front``: the loss Hessian's factor
    ``[M, N, *S]``, samples first. ``create_graph``: the factors as functions of the
    parameters (``front`` one too)."""
    if batch_dim != 0:
        raise UnsupportedModelError(
            _REFUSAL.format(what=f"the output holds the samples in dimension {batch_dim}, not 0")
        )
    chain = layer_chain(output, params, [c.model for c in contexts])
    flat = front.reshape(-1, front[0, 0].numel())  # [M N, D]
    b = flat.mT @ flat  # sum_n H_n
    target = output
    out: dict[nn.Parameter, list[Tensor]] = {}
    for layer in chain:
        if target.grad_fn is not layer.node:  # ops between: averaged through each one's J_n
            b = _averaged_through(contexts, b, target, layer.node, create_graph)
        module = layer.module
        x, weight = layer.x, module.weight
        if not create_graph:
            x, weight = x.detach(), weight.detach()
        b = b.to(module.weight.dtype)
        if module.weight.requires_grad:
            out[module.weight] = [b, x.mT @ x / x.shape[0]]
        if module.bias is not None and module.bias.requires_grad:
            out[module.bias] = [b]
        b = weight.mT @ b @ weight
        target = layer.x
    return out
