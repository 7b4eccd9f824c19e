"""KFRA (Botev et al., 2017; BackPACK's ``KFRA``): Kronecker factors of the GGN's blocks of
a chain of linear layers and convolutions, with the output-side factor averaged over the batch
after every step back.

At the output, ``B = sum_n H_n`` ``[D, D]`` (the loss Hessians, with the reduction's scale).
Going back through each op between two layers (activations, dropout, pooling, padding,
reshapes: per sample) with Jacobians ``J_n``: ``B <- 1/N sum_n J_n^T B J_n`` (after every op,
as BackPACK averages after every module); through a layer itself ``B <- J^T B J`` (the same
for every sample: ``W^T B W`` for a linear layer, two transposed convolutions of ``B``'s
columns for a convolution). A linear layer whose output has ``B`` gets weight ``[B, A]`` with
``A = 1/N sum_n a_n a_n^T`` of its inputs ``a`` ``[N, I]``, bias ``[B]``; a convolution (output
``[N, C, *S]``) weight ``[B_c, A]`` and bias ``[B_c]``, with ``B_c`` ``[C, C]`` ``B`` summed
over the output positions on both sides and ``A`` KFLR's (the unfolded input's, summed over
positions, averaged over samples), as BackPACK's. With one sample this is KFLR's (the exact GGN
block for the last linear layer).

It applies where the graph is a chain: every parameter belongs to an ``nn.Linear`` on ``[N, I]``
inputs or an ``nn.Conv1d/2d/3d`` (``groups=1``, zero padding) on ``[N, C, *S]``, one sample
per row (replaced by the context, or torch's own op where the context replaces none: the
BackPACK facade's), each layer's input reaches back to at most one other layer (none for the
first) and the output to exactly one, through ops taking one differentiable input each:
elementwise ones (activations, dropout; ``J_n = diag(d_n)``, ``d`` from one backward pass of
ones), max pooling (``J_n`` selects the maxima: ``J_n^T B J_n`` adds ``B``'s entries up by the
pooling indices), average pooling, constant padding and means over the positions (``J`` the
same for every sample: ``J^T B J`` by backward passes through the op, N columns each) and
views keeping the samples first. Any other op between two layers is refused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from ...errors import UnsupportedModelError
from ..capture import PerSample
from .kronecker import CONVS, input_factor, unsupported_conv

_REFUSAL = (
    "KFRA: the model is not a chain of linear layers on [N, I] inputs and convolutions "
    "(BackPACK's KFRA needs its sequence of supported modules too); {what}. Ask for KFLR or "
    "KFAC instead (Kronecker factors of any layer leanprop covers), or DiagGGNExact."
)
_NOT_ALL_IN_LAYERS = (
    "its parameters are not all in linear layers on [N, I] inputs or convolutions on "
    "[N, C, ...] inputs, one sample per row, each used once"
)
_LAYERS = (nn.Linear, *CONVS)


@dataclass(frozen=True, eq=False)
class _Layer:
    """A layer in the graph: the autograd node whose output is its output, the module, its
    input (``[N, I]``; a convolution's ``[N, C_in, *S]``)."""

    node: Any
    module: nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d
    x: Tensor


def _weight_of(edge: tuple[Any, int]) -> Tensor | None:
    """The leaf behind ``weight.t()``'s edge (torch's linear: ``addmm(b, x, w.t())``)."""
    node = edge[0]
    if node is None or node.name() != "TBackward0":
        return None
    return getattr(node.next_functions[0][0], "variable", None)


def _as_layer(node: Any, layers: dict[int, nn.Module], n: int) -> _Layer | None:
    """``node`` as a layer, one sample per row of its input: a replaced op (``fused.py``), or
    torch's own ``addmm``/``mm`` of an ``nn.Linear``'s weight or convolution of a conv module's
    (a context that does not replace ops: the BackPACK facade's); None for any other node.

    Raises:
        UnsupportedModelError: a convolution whose Kronecker factors are not defined.
    """
    if isinstance(node, BackwardCFunction):  # (a replaced op: of these models' layers only)
        module = getattr(node, "module", None)
        if module is None or layers.get(id(module.weight)) is not module:
            return None
        x, bd = node.saved_tensors[0], node.call.in_bd
        rows = bd.dim == 0 and bd.inner == 1 and x.shape[0] == node.call.n
        return _checked(_Layer(node, module, x), n) if rows else None
    name = node.name()
    if name == "AddmmBackward0":
        w, x = _weight_of(node.next_functions[2]), node._saved_mat1
    elif name == "MmBackward0":
        w, x = _weight_of(node.next_functions[1]), node._saved_self
    elif name == "ConvolutionBackward0" and not node._saved_transposed:
        w, x = getattr(node.next_functions[1][0], "variable", None), node._saved_input
    else:
        return None
    module = layers.get(id(w))
    layer = None if module is None else _checked(_Layer(node, module, x), n)
    if layer is not None and name == "ConvolutionBackward0":  # (the module's own call)
        called = (node._saved_stride, node._saved_padding, node._saved_dilation)
        if tuple(map(tuple, called)) != (module.stride, module.padding, module.dilation):
            return None
    return layer


def _checked(layer: _Layer, n: int) -> _Layer | None:
    """``layer`` if its input holds ``n`` samples, one per row (``[N, I]`` for a linear
    layer, ``[N, C_in, *S]`` for a convolution), else None; refused for a convolution whose
    factors are not defined."""
    module, x = layer.module, layer.x
    if x.shape[0] != n or x.dim() != (2 if isinstance(module, nn.Linear) else module.weight.dim()):
        return None
    why = None if isinstance(module, nn.Linear) else unsupported_conv(module)
    if why is not None:
        raise UnsupportedModelError(_REFUSAL.format(what=f"it has a {why}"))
    return layer


def layer_chain(
    output: Tensor, params: Sequence[nn.Parameter], models: Sequence[nn.Module]
) -> list[_Layer]:
    """The layers from ``output`` back to the model's input, in that order.

    Raises:
        UnsupportedModelError: the graph is not such a chain (see the module docstring).
    """
    layers = {
        id(m.weight): m for model in models for m in model.modules() if isinstance(m, _LAYERS)
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
            layer = _as_layer(node, layers, n)
            if layer is not None:
                behind.append(layer)
                continue
            if isinstance(node, BackwardCFunction):  # (a layer replaced by a context)
                module = getattr(node, "module", None)
                what = f"'{node.name()}'" if module is None else type(module).__name__
                what = (
                    f"it has a {what} layer (not a linear one on [N, I] or a convolution, one "
                    "sample per row)"
                )
                if isinstance(module, _LAYERS) and layers.get(id(module.weight)) is not module:
                    what = (
                        "it reaches a layer outside the context's model (another per_sample "
                        "context's): open one context on the whole model"
                    )
                raise UnsupportedModelError(_REFUSAL.format(what=what))
            for child, _ in node.next_functions:
                leaf = getattr(child, "variable", None)
                if leaf is not None and id(leaf) in wanted:
                    raise UnsupportedModelError(_REFUSAL.format(what=_NOT_ALL_IN_LAYERS))
                todo.append(child)
        if len(behind) > 1:
            raise UnsupportedModelError(
                _REFUSAL.format(what="a layer's input (or the output) depends on two layers")
            )
        if not behind:
            break
        layer = behind[0]
        if id(layer.module) in reached:
            raise UnsupportedModelError(_REFUSAL.format(what=_NOT_ALL_IN_LAYERS))
        reached.add(id(layer.module))
        chain.append(layer)
        start = layer.x.grad_fn
    if not chain:
        raise UnsupportedModelError(_REFUSAL.format(what=_NOT_ALL_IN_LAYERS))
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
# a diagonal Jacobian per sample), max pooling (a selection per sample, by its indices), ops
# linear and the same for every sample, and views that keep the samples first
_ELEMENTWISE = frozenset(
    {"Relu", "Sigmoid", "Tanh", "Gelu", "Silu", "Elu", "Celu", "LeakyRelu", "Softplus",
     "Hardtanh", "Hardswish", "Hardsigmoid", "Mish", "LogSigmoid", "Threshold", "Mul", "Div",
     "Add", "Sub", "Neg", "Clone", "NativeDropout"}
)  # fmt: skip
_MAX_POOLS = {  # -> the dimensions pooled (the last ones; the samples' stay apart)
    "MaxPool2DWithIndices": 2, "MaxPool3DWithIndices": 3, "AdaptiveMaxPool2D": 2,
    "AdaptiveMaxPool3D": 3,
}  # fmt: skip
_POOLS = frozenset({"AvgPool2D", "AvgPool3D", "AdaptiveAvgPool2D", "AdaptiveAvgPool3D"})
_VIEWS = frozenset({"View", "UnsafeView", "ReshapeAlias", "Reshape", "Squeeze", "Unsqueeze"})


def _kind(node: Any) -> str:
    return node.name().split("Backward")[0]


def _same_for_every_sample(kind: str, node: Any, in_dims: int) -> bool:
    """Whether an op (its input of ``in_dims`` dimensions, the samples first in its input and
    output) is linear with the same Jacobian for every sample: average pooling (over the last
    dimensions), constant padding of other dimensions than the samples', a mean or sum over
    them (global average pooling)."""
    if kind in _POOLS:
        return True
    if kind == "ConstantPadNd":
        return len(node._saved_pad) // 2 < in_dims
    if node.name() in ("MeanBackward1", "SumBackward1"):
        # (negative dimensions are read back as unsigned 64-bit numbers)
        dims = [d - 2**64 if d >= 2**63 else d for d in node._saved_dim]
        return bool(dims) and all(d % in_dims != 0 for d in dims)
    return False


def _averaged_through(
    contexts: Sequence[PerSample], b: Tensor, target: Tensor, layer: Any, create_graph: bool
) -> tuple[Tensor, tuple[int, ...]]:
    """``b`` (over ``target``'s units per sample) carried back to ``layer``'s output op by op:
    ``b <- 1/N sum_n J_n^T b J_n`` (see the module docstring); a view keeping the samples
    first leaves ``b`` as it is. Any other op is refused. ``create_graph``: the result as a
    function of the parameters. Returns ``b`` and the shape of ``layer``'s output."""
    n, shape = target.shape[0], tuple(target.shape)
    with ExitStack() as stack:
        for c in contexts:  # (passes of ours: nothing per sample, nothing recorded)
            stack.enter_context(c.computing(frozenset()))
            stack.enter_context(c.for_layer_outputs())
        for out, inp in _ops_between(target, layer):
            ones = torch.ones(shape, dtype=target.dtype, device=target.device)
            (d,) = torch.autograd.grad(out, inp, ones, retain_graph=True, create_graph=create_graph)
            kind, before = _kind(out.node), tuple(d.shape)
            samples_first = before[:1] == shape[:1] == (n,)
            if kind in _ELEMENTWISE and before == shape:
                d = d.reshape(n, -1).to(b.dtype)
                b = b * (d.mT @ d) / n
            elif kind in _MAX_POOLS and samples_first:
                b = _through_max_pool(b, out.node._saved_result1, before, _MAX_POOLS[kind])
            elif samples_first and _same_for_every_sample(kind, out.node, len(before)):
                b = _through_op(b, functools.partial(_vjp, out, inp, shape, create_graph), n)
            elif not (kind in _VIEWS and samples_first):
                raise UnsupportedModelError(
                    _REFUSAL.format(
                        what=f"'{out.node.name()}' between two layers, from {list(before)} to "
                        f"{list(shape)}, is neither elementwise, pooling, padding, a mean over "
                        "the positions nor a view keeping the samples first"
                    )
                )
            shape = before
    return b, shape


def _through_max_pool(
    b: Tensor, indices: Tensor, in_shape: tuple[int, ...], pooled: int
) -> Tensor:  # fmt: skip
    """``1/N sum_n P_n^T b P_n`` for max pooling over the last ``pooled`` dimensions: ``P_n``
    ``[D_out, D_in]`` picks, for each output unit, the input unit of its maximum (``indices``,
    of the output's shape, flat within each plane of pooled positions, as torch returns them).
    """
    n, positions = in_shape[0], math.prod(in_shape[-pooled:])
    planes = math.prod(in_shape[1:-pooled])  # (channels; 1 for [N, H, W] taken unbatched)
    offsets = torch.arange(planes, device=indices.device).mul_(positions).view(planes, 1)
    d_in, d_out = planes * positions, b.shape[0]
    total = b.new_zeros(d_in, d_in)
    for at in (indices.reshape(n, planes, -1) + offsets).reshape(n, -1):  # [D_out] each
        total = total.index_add(1, at, b.new_zeros(d_in, d_out).index_add(0, at, b))
    return total / n


def _vjp(
    out: GradientEdge, inp: GradientEdge, shape: tuple[int, ...], create_graph: bool, rows: Tensor
) -> Tensor:  # fmt: skip
    """Rows ``[k, N, D_out]`` (each as the op's output, of ``shape``) taken back through one
    op: ``[k, N, D_in]`` (a backward pass each: autograd takes no batched gradients at an
    edge)."""
    return torch.stack([
        torch.autograd.grad(
            out, inp, row.reshape(shape), retain_graph=True, create_graph=create_graph
        )[0].reshape(row.shape[0], -1)
        for row in rows
    ])  # fmt: skip


def _sandwiched(b: Tensor, columns_back: Callable[[Tensor], Tensor]) -> Tensor:
    """``J^T b J`` for a Jacobian ``J`` ``[D_out, D_in]`` the same for every sample (``b``
    symmetric), from ``columns_back(m)``: ``J^T`` applied to each row of ``m`` ``[R, D_out]``,
    ``[R, D_in]``."""
    jb = columns_back(b)  # [D_out, D_in]: b J (b symmetric)
    return columns_back(jb.mT.contiguous())  # J^T (b J)


def _through_op(b: Tensor, back: Callable[[Tensor], Tensor], n: int) -> Tensor:
    """``J^T b J`` for an op between layers whose Jacobian is the same for every sample:
    ``back(rows)`` takes ``[k, N, D_out]`` output gradients (reshaped as the op's output) to
    the input's ``[k, N, D_in]``. Each sample's slot carries another column, so ``D`` columns
    cost ``D / N`` passes."""

    def columns_back(m: Tensor) -> Tensor:
        rows = m.shape[0]
        k = -(-rows // n)
        packed = torch.cat([m, m.new_zeros(k * n - rows, m.shape[1])]).view(k, n, -1)
        return back(packed).reshape(k * n, -1)[:rows]

    return _sandwiched(b, columns_back)


def _through_conv(
    module: nn.Conv1d | nn.Conv2d | nn.Conv3d, weight: Tensor, in_shape: tuple[int, ...],
    out_shape: tuple[int, ...], b: Tensor,
) -> Tensor:  # fmt: skip
    """``J^T b J`` for a convolution's input Jacobian ``J`` (the same for every sample): the
    columns through the transposed convolution, all at once."""
    back = _CONV_INPUT_GRAD[weight.dim() - 2]
    options = (module.stride, module.padding, module.dilation)

    def columns_back(m: Tensor) -> Tensor:
        grads = m.reshape(m.shape[0], *out_shape[1:])
        return back((m.shape[0], *in_shape[1:]), weight, grads, *options).flatten(1)

    return _sandwiched(b, columns_back)


_CONV_INPUT_GRAD = {
    1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input
}  # fmt: skip


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
        shape = tuple(target.shape)  # (the layer's output's)
        if target.grad_fn is not layer.node:  # ops between: averaged through each one's J_n
            b, shape = _averaged_through(contexts, b, target, layer.node, create_graph)
        module = layer.module
        x, weight = layer.x, module.weight
        if not create_graph:
            x, weight = x.detach(), weight.detach()
        b = b.to(module.weight.dtype)
        if isinstance(module, nn.Linear):
            out_side = b
        else:  # summed over the output positions on both sides: [C_out, C_out]
            c = module.out_channels
            out_side = b.view(c, b.shape[0] // c, c, -1).sum((1, 3))
        if module.weight.requires_grad:
            out[module.weight] = [out_side, input_factor(module, x)]
        if module.bias is not None and module.bias.requires_grad:
            out[module.bias] = [out_side]
        if layer is chain[-1]:  # (the model's input: nothing behind to carry b to)
            break
        if isinstance(module, nn.Linear):
            b = weight.mT @ b @ weight
        else:
            b = _through_conv(module, weight, tuple(x.shape), shape, b)
        target = layer.x
    return out
