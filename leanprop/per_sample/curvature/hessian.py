"""The Hessian's diagonal: the GGN's, plus the terms of the model's curved activations.

For a loss ``L = sum_n l(f(x_n, θ), y_n)`` whose model is built from ops linear in each of their
inputs (linear and convolution layers, poolings, reshapes, additions, dropout's mask) and
elementwise activations ``a = σ(z)``, the Hessian is (Dangel et al., 2020: BackPACK's
``DiagHessian``)::

    H = G + sum_activations sum_n sum_k r_nk ∇_θ z_nk ∇_θ z_nkᵀ,   r = δ ⊙ σ''(z),  δ = ∂L/∂a.

Each activation's term is a GGN of its own: its diagonal "loss Hessian" ``r`` at ``z`` is split
as ``r₊ - r₋``, and each part's square root, at one unit ``k`` of every sample, is a column
backpropagated from ``z`` like the loss factor's columns from the output (``ggn.py``): at most
``2 K`` passes for ``K`` units per sample. Other second-order terms come from an op whose
parameter-dependent inputs it does not act on linearly: a product whose operands share a
parameter (a weight used twice, ``x * x``, attention's ``q kᵀ``), LayerNorm, softmax. The
autograd graph is checked for them first; a model with one is refused (its GGN is available).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from ...errors import UnsupportedModelError
from ..batch import op_name
from ..capture import PerSample
from ..registry import RuleOptions

# autograd nodes linear in their inputs taken together (sums, reshapes, selections, poolings
# by averages), or piecewise linear (second derivative zero almost everywhere)
_LINEAR = frozenset({
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "NegBackward0",
    "MulBackward1", "DivBackward1", "ViewBackward0", "UnsafeViewBackward0",
    "ReshapeAliasBackward0", "TBackward0", "TransposeBackward0", "TransposeBackward1",
    "PermuteBackward0", "ExpandBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "SqueezeBackward3", "SqueezeBackward4", "UnsqueezeBackward0",
    "CloneBackward0", "CatBackward0", "StackBackward0", "SliceBackward0", "SelectBackward0",
    "IndexBackward0", "SumBackward0", "SumBackward1", "MeanBackward0", "MeanBackward1",
    "AvgPool1DBackward0", "AvgPool2DBackward0", "AvgPool3DBackward0",
    "AdaptiveAvgPool1DBackward0", "AdaptiveAvgPool2DBackward0", "AdaptiveAvgPool3DBackward0",
    "ConstantPadNdBackward0", "ToCopyBackward0", "AliasBackward0", "SplitBackward0",
    "SplitWithSizesBackward0", "UnbindBackward0", "RepeatBackward0", "NativeDropoutBackward0",
    "EmbeddingBackward0", "BroadcastCaptureBackward", "ReluBackward0", "LeakyReluBackward0",
    "HardtanhBackward0", "ThresholdBackward0", "MaxPool2DWithIndicesBackward0",
    "MaxPool3DWithIndicesBackward0", "AdaptiveMaxPool2DBackward0", "AdaptiveMaxPool3DBackward0",
    "AbsBackward0", "ClampBackward1", "ClampMinBackward0", "ClampMaxBackward0", "RsubBackward0",
    "RsubBackward1", "UpsampleNearest1DBackward0", "UpsampleNearest2DBackward0",
    "UpsampleNearest3DBackward0", "UpsampleBilinear2DBackward0", "ReflectionPad1DBackward0",
    "ReflectionPad2DBackward0", "ReplicationPad1DBackward0", "ReplicationPad2DBackward0",
    "FlipBackward0", "RollBackward0",
})  # fmt: skip

# nodes linear in each input on its own (products): exact where no parameter reaches two
# of their inputs
_MULTILINEAR = frozenset({
    "MulBackward0", "MmBackward0", "BmmBackward0", "MvBackward0", "DotBackward0",
    "AddmmBackward0", "AddmvBackward0", "BaddbmmBackward0", "ConvolutionBackward0",
})  # fmt: skip
_MULTILINEAR_OPS = frozenset({
    "linear", "addmm", "mm", "bmm", "matmul", "mul", "conv1d", "conv2d", "conv3d", "einsum",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "embedding", "embedding_bag",
})  # fmt: skip
_NORM_OPS = frozenset({"layer_norm", "group_norm", "rms_norm"})


def _saved_input(node: Any, graph: bool) -> Tensor:
    """The input ``z`` a node saved; ``graph``: as a function of the parameters (its graph)."""
    return node._saved_self if graph else node._saved_self.detach()


def _saved_output(node: Any, graph: bool) -> Tensor:
    """The output ``a`` a node saved; ``graph``: as a function of the parameters."""
    return node._saved_result if graph else node._saved_result.detach()


def _generic(fn: Callable[[Tensor, Any], Tensor]) -> Callable[[Any, bool], Tensor]:
    """``σ''(z)`` of an elementwise op whose node saved its input ``z``, by differentiating
    ``fn(z, node)`` twice (``graph``: as a function of the parameters, through ``z``)."""

    def second(node: Any, graph: bool) -> Tensor:
        z = _saved_input(node, graph)
        with torch.enable_grad():
            if not (graph and z.requires_grad):  # (a leaf of its own: no graph wanted)
                z = z.detach().requires_grad_()
            (d1,) = torch.autograd.grad(fn(z, node).sum(), z, create_graph=True)
            (d2,) = torch.autograd.grad(d1.sum(), z, create_graph=graph)
        return d2

    return second


def _from_result(fn: Callable[[Tensor], Tensor]) -> Callable[[Any, bool], Tensor]:
    return lambda node, graph: fn(_saved_output(node, graph))


def _elu_inplace(n: Any, graph: bool) -> Tensor:
    a = _saved_output(n, graph)  # (negative exactly where z is)
    return torch.where(a <= 0, n._saved_input_scale**2 * (a + n._saved_scale * n._saved_alpha), 0.0)


def _celu_inplace(n: Any, graph: bool) -> Tensor:
    a = _saved_output(n, graph)
    return torch.where(a <= 0, (a + n._saved_alpha) / n._saved_alpha**2, 0.0)


# σ''(z) of each curved elementwise node, from what it saved (``graph``: as a function of the
# parameters)
_CURVED: dict[str, Callable[[Any, bool], Tensor]] = {
    "TanhBackward0": _from_result(lambda a: -2 * a * (1 - a * a)),
    "SigmoidBackward0": _from_result(lambda s: s * (1 - s) * (1 - 2 * s)),
    "ExpBackward0": _from_result(lambda e: e),
    "SqrtBackward0": _from_result(lambda r: -0.25 / r**3),
    "GeluBackward0": _generic(lambda z, n: F.gelu(z, approximate=n._saved_approximate)),
    "SiluBackward0": _generic(lambda z, n: F.silu(z)),
    "MishBackward0": _generic(lambda z, n: F.mish(z)),
    "HardswishBackward0": _generic(lambda z, n: F.hardswish(z)),
    "SoftplusBackward0": _generic(lambda z, n: F.softplus(z, n._saved_beta, n._saved_threshold)),
    "EluBackward0": _generic(
        lambda z, n: torch.ops.aten.elu(z, n._saved_alpha, n._saved_scale, n._saved_input_scale)
    ),
    "CeluBackward0": _generic(lambda z, n: F.celu(z, n._saved_alpha)),
    # in place (inplace=True): from the output
    "EluBackward1": _elu_inplace,
    "CeluBackward1": _celu_inplace,
    "LogSigmoidBackward0": _generic(lambda z, n: F.logsigmoid(z)),
    "SinBackward0": _generic(lambda z, n: torch.sin(z)),
    "CosBackward0": _generic(lambda z, n: torch.cos(z)),
    "LogBackward0": _generic(lambda z, n: torch.log(z)),
    "PowBackward0": _generic(lambda z, n: z**n._saved_exponent),
}


@dataclass
class Curved:
    """A curved activation of the recorded forward whose input depends on parameters.

    Attributes:
        node: its autograd node (``a = σ(z)``).
        z: the edge of its input ``z``, where its columns start.
        dim: where ``z`` holds the samples.
        layer: where ``z`` is the output of a linear or convolution layer (replaced op) fed
            the data (its input depends on no parameter), that op's node: the term then has a
            closed form (:func:`layer_term`), no passes.
    """

    node: Any
    z: GradientEdge
    dim: int
    layer: Any = None


def _kind(node: Any) -> tuple[str, str]:
    """The node's name for the tables above, and for messages."""
    name = type(node).__name__
    if name == "FusedOpBackward":  # a layer's op replaced during capture (fused.py)
        layer = type(node.module).__name__
        if isinstance(node.module, nn.LayerNorm | nn.GroupNorm):
            return "Norm", layer  # (nonlinear in its input, linear in weight and bias)
        return "MulBackward0", layer  # linear and convolution: bilinear in (input, weight)
    if name == "OpCaptureBackward":  # an op using parameters directly (ops.py)
        op = op_name(node.op.func)
        if op in _NORM_OPS:
            return "Norm", f"'{op}'"
        return ("MulBackward0" if op in _MULTILINEAR_OPS else op), f"'{op}'"
    op = re.sub(r"Backward\d*$", "", name)
    return name, f"{op} (autograd node {name})"


def _reached(
    root: Any, params: set[nn.Parameter]
) -> tuple[dict[Any, frozenset[nn.Parameter]], set[Any]]:
    """The parameters each node of ``root``'s graph leads to (its inputs depend on), and the
    nodes whose inputs also take data: a tensor autograd does not follow, a leaf that is not
    one of ``params`` (an input that requires grad), an embedding's indices."""
    memo: dict[Any, frozenset[nn.Parameter]] = {}
    data: set[Any] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in memo:
            continue
        nexts = [f for f, _ in node.next_functions if f is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((f, False) for f in nexts if f not in memo)
            continue
        own = getattr(node, "variable", None)
        found = frozenset({own}) if own is not None and own in params else frozenset()
        memo[node] = found.union(*(memo[f] for f in nexts))
        if (
            len(nexts) < len(node.next_functions)
            or any(f in data for f in nexts)
            or (own is not None and own not in params)
            or type(node).__name__ in _FROM_DATA
        ):
            data.add(node)
    return memo, data


# the outputs of a linear or convolution layer's own op (batch first, as documented), and the
# ops between such an output and an activation that keep the batch first (elementwise ops,
# poolings, paddings, the view a linear layer's output on [N, ..., I] inputs gets)
_LAYER_OUTPUTS = frozenset({"AddmmBackward0", "MmBackward0", "ConvolutionBackward0"})
_KEEP_BATCH_FIRST = frozenset({
    "AddBackward0", "SubBackward0", "MulBackward0", "MulBackward1", "DivBackward1",
    "NegBackward0", "NativeDropoutBackward0", "CloneBackward0", "ReluBackward0",
    "LeakyReluBackward0", "HardtanhBackward0", "ThresholdBackward0", "ViewBackward0",
    "UnsafeViewBackward0", "ReshapeAliasBackward0", "MaxPool1DWithIndicesBackward0",
    "MaxPool2DWithIndicesBackward0", "MaxPool3DWithIndicesBackward0", "AvgPool1DBackward0",
    "AvgPool2DBackward0", "AvgPool3DBackward0", "AdaptiveAvgPool2DBackward0",
    "AdaptiveMaxPool2DBackward0", "ConstantPadNdBackward0", "ReflectionPad2DBackward0",
    "ReplicationPad2DBackward0",
})  # fmt: skip
# nodes whose input is data autograd does not follow (an embedding's indices)
_FROM_DATA = frozenset({"EmbeddingBackward0", "EmbeddingBagBackward0"})


def _from_a_layer(node: Any) -> bool:
    """Whether ``node``'s output comes from a linear or convolution layer's op through ops
    that keep its dimensions (elementwise ones): its samples are where the layer's are."""
    for _ in range(64):  # (a chain, not a search: the first input at each step)
        name = type(node).__name__
        if name in _LAYER_OUTPUTS:
            return True
        if name not in _KEEP_BATCH_FIRST and name not in _CURVED:
            return False
        node = node.next_functions[0][0]
        if node is None:
            return False
    return False


_BILINEAR_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _fed_the_data(node: Any, reached: dict[Any, frozenset[nn.Parameter]], dim: int) -> bool:
    """Whether ``node`` is a replaced linear or convolution op (``fused.py``) whose input
    depends on no parameter, with the samples first."""
    if type(node).__name__ != "FusedOpBackward" or dim != 0:
        return False
    if not isinstance(node.module, _BILINEAR_LAYERS) or node.call.in_bd.dim != 0:
        return False
    x_node = node.next_functions[0][0]  # (the op's input x; then its weight and bias)
    return x_node is None or not reached.get(x_node)


def layer_term(curved: Curved, r: Tensor, per_sample: bool) -> dict[nn.Parameter, Tensor]:
    """The activation's term of the Hessian's diagonal for the parameters of the layer that
    computes its input, where that layer takes the data (``curved.layer``): ``z`` is linear in
    them, ``∂z_k/∂W = x`` entries, so ``sum_k r_k (∂z_k/∂W)²`` is the layer's own weight
    gradient with ``x²`` for the input and ``r`` (:func:`residual`) for the output gradient
    (each sample's with ``per_sample``: ``[N, *p.shape]``)."""
    layer = curved.layer
    x = layer.saved_tensors[0]  # (the op input; then the weight where x needs a gradient)
    rule, module, params = layer.call.site.rule, layer.module, layer.call.params
    x2 = (x * x).to(r.dtype)
    if per_sample:
        found = rule.batch_grads(module, (x2,), r, frozenset(params), RuleOptions())
    else:
        found = rule.param_grads(module, x2, r, frozenset(params))
    return {params[k]: v for k, v in found.items()}


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"DiagHessian: {what}, so the Hessian has terms leanprop does not form (it covers "
        "linear and convolution layers, poolings, reshapes, dropout and elementwise "
        "activations such as tanh, sigmoid, GELU, SiLU, ELU, softplus; no parameter used "
        "twice along one path). DiagGGNExact (the Hessian without the activations' terms) "
        "covers this model."
    )


def curved_activations(
    contexts: Sequence[PerSample], output: Tensor, params: list[nn.Parameter]
) -> list[Curved]:
    """The curved activations between ``params`` and ``output``; refuses a graph with other
    second-order terms (see the module docstring)."""
    if output.grad_fn is None:
        return []
    reached, from_data = _reached(output.grad_fn, set(params))
    n = {c.samples for c in contexts} - {None}
    followed = all(c.follows_the_batch for c in contexts)
    found: list[Curved] = []
    for node in reached:
        inputs = [reached[f] for f, _ in node.next_functions if f is not None]
        live = [r for r in inputs if r]
        if not live or type(node).__name__ == "AccumulateGrad":
            continue
        name, shown = _kind(node)
        if name in _LINEAR:
            continue
        first = reached.get(node.next_functions[0][0], frozenset())  # (the node's input x)
        if name == "DivBackward0" and not reached.get(node.next_functions[1][0], frozenset()):
            continue  # (a divisor that depends on no parameter: linear)
        if name in _MULTILINEAR or (name == "Norm" and not first):
            for i, a in enumerate(live):
                if any(a & b for b in live[i + 1 :]):
                    raise _refuse(
                        f"a parameter reaches two operands of one product ({shown}: a weight "
                        "used twice along one path, or a product of activations)"
                    )
            continue
        if name in _CURVED:
            dims = {c.batch_dim_of_node(node) for c in contexts} - {None}
            ints = [d for d in dims if isinstance(d, int)]
            if len(dims) != 1 or not ints:
                raise _refuse(
                    f"leanprop did not follow the samples to the input of {shown} "
                    f"({next(iter(dims - set(ints)), 'not recorded in the block')})"
                )
            shape, dim = _saved(node).shape, ints[0]
            if dim >= len(shape) or any(shape[dim] != k for k in n):
                raise _refuse(
                    f"the input of {shown} {tuple(shape)} does not hold the forward's "
                    f"{sorted(n)} samples in dimension {dim}"
                )
            input_node = node.next_functions[0][0]
            if not followed and (
                input_node not in from_data
                or (
                    any(i != dim and s in n for i, s in enumerate(shape))
                    and not _from_a_layer(input_node)
                )
            ):  # (no op interception: the samples' dimension is the documented one)
                raise _refuse(
                    f"without batch tracking (the BackPACK facade), leanprop cannot tell which "
                    f"dimension of the input of {shown} {tuple(shape)} holds the samples, or "
                    "whether it holds them at all (leanprop.ggn inside leanprop.per_sample "
                    "follows them)"
                )
            layer = input_node if _fed_the_data(input_node, reached, ints[0]) else None
            found.append(Curved(node, GradientEdge(*node.next_functions[0]), ints[0], layer))
            continue
        raise _refuse(f"the model computes {shown} of a parameter-dependent input")
    return found


def residual(curved: Curved, delta: Tensor, graph: bool = False) -> Tensor:
    """The activation's diagonal "loss Hessian" at its input, ``r = δ ⊙ σ''(z)`` (the shape
    of ``z``), from ``delta``: ``δ = ∂L/∂a``; ``graph``: ``σ''(z)`` as a function of the
    parameters (``delta`` carries its own graph where it has one)."""
    return delta * _CURVED[type(curved.node).__name__](curved.node, graph).to(delta.dtype)


def residual_columns(curved: Curved, r: Tensor, sign: float) -> Iterator[Tensor]:
    """The columns of one part of an activation's residual term ``r`` (:func:`residual`):
    ``sqrt(max(0, sign * r))`` at unit k of every sample (zero elsewhere), for each unit k
    where any sample has one."""
    root = (sign * r).clamp(min=0).sqrt().movedim(curved.dim, 0)  # [N, *unit dims]
    flat = root.reshape(root.shape[0], -1)  # [N, K]
    for k in flat.any(0).nonzero().flatten().tolist():
        column = torch.zeros_like(flat)
        column[:, k] = flat[:, k]
        yield column.view_as(root).movedim(0, curved.dim)


def unit_columns(curved: Curved, r: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
    """For each unit k of an activation's input: the column that is 1 at unit k of every
    sample (zero elsewhere), and ``r`` there ``[N]``. A pass of the column gives each
    sample's ``∂z_nk/∂θ`` (``g``), and the unit's share of the term is ``sum_n r_nk g²``:
    smooth in ``r`` (the derivatives, ``create_graph``), where the square roots of its parts
    (:func:`residual_columns`) are not at ``r = 0``. Every unit (``r`` may be 0 where its
    derivative is not): one pass per unit, where the parts take one per unit and sign
    that has a nonzero entry."""
    flat = r.movedim(curved.dim, 0).reshape(r.shape[curved.dim], -1)  # [N, K]
    for k in range(flat.shape[1]):
        column = torch.zeros_like(flat.detach())
        column[:, k] = 1.0
        shaped = column.view(r.movedim(curved.dim, 0).shape).movedim(0, curved.dim)
        yield shaped, flat[:, k]


def _saved(node: Any) -> Tensor:
    """What a curved node saved: its output or its input (the same shape)."""
    return node._saved_result if hasattr(node, "_saved_result") else node._saved_self


def activation_gradients(
    loss: Tensor, curved: list[Curved], create_graph: bool = False
) -> list[Tensor]:
    """``δ = ∂L/∂a`` at each curved activation's output (one pass, nothing accumulates;
    ``create_graph``: as functions of the parameters)."""
    if not curved:  # (a linear or piecewise-linear model: nothing to differentiate to)
        return []
    edges = [GradientEdge(c.node, 0) for c in curved]
    found = torch.autograd.grad(
        loss, edges, retain_graph=True, create_graph=create_graph, allow_unused=True
    )
    return [
        torch.zeros_like(_saved(c.node)) if d is None else d
        for c, d in zip(curved, found, strict=True)
    ]
