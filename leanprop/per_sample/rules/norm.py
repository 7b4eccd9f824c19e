"""Rules for ``nn.LayerNorm`` and ``nn.GroupNorm``: ``y = x̂ ⊙ w + b``.

``x̂`` is recomputed from the captured input; the individual gradients are
``w_n = sum (g_n ⊙ x̂_n)`` and ``b_n = sum g_n`` over every position of sample n that shares
the same weight entry. The op is replaced during capture (``fused.py``): its ordinary backward
is torch's own kernel on the recomputed statistics (a differentiable recomputation under
``create_graph``, for which torch's group-norm kernel has no derivative).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..registry import INPUT, RuleOptions, register_rule
from ..stats import widen


def _layer_norm_check(module: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    x, k = inputs[0], len(module.normalized_shape)
    if x.dim() <= k:
        return (
            f"got an input of shape {tuple(x.shape)}; expected [N, ..., "
            f"{', '.join(map(str, module.normalized_shape))}] with the batch first"
        )
    return None


def _norm_backward(module: nn.Module, x: Tensor, g: Tensor, mask: list[bool]) -> tuple:
    """``(grad_x, grad_weight, grad_bias)`` of the module's op at ``x`` (those in ``mask``;
    the others None), by torch's backward kernel (under ``create_graph``: by autograd on the
    op recomputed, differentiable)."""
    if torch.is_grad_enabled():
        leaves = [
            t if t is None or not m or t.requires_grad else t.detach().requires_grad_()
            for t, m in zip((x, module.weight, module.bias), mask, strict=True)
        ]
        with torch.enable_grad():
            out = _op(module, *leaves)
        wrt = [t for t, m in zip(leaves, mask, strict=True) if m]
        found = iter(torch.autograd.grad(out, wrt, g, create_graph=True))
        return tuple(next(found) if m else None for m in mask)
    weight, bias = module.weight, module.bias  # (in their own dtype, as torch's kernels take)
    if isinstance(module, nn.LayerNorm):
        shape = tuple(module.normalized_shape)
        # (with the affine parameters: mixed dtypes keep their statistics in float32)
        _, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, module.eps)
        return torch.ops.aten.native_layer_norm_backward(
            g, x, shape, mean, rstd, weight, bias, mask
        )
    n, c, groups = x.shape[0], x.shape[1], module.num_groups
    hw = math.prod(x.shape[2:])
    x, g = x.contiguous(), g.contiguous()  # (the kernels' layout, as F.group_norm makes it)
    _, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hw, groups, module.eps)
    return torch.ops.aten.native_group_norm_backward(
        g, x, mean, rstd, weight, n, c, hw, groups, mask
    )


def _op(module: nn.Module, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, tuple(module.normalized_shape), weight, bias, module.eps)
    return F.group_norm(x, module.num_groups, weight, bias, module.eps)


def norm_input_grad(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """Ordinary input gradient ``[N, ...]`` (the shape of ``x``)."""
    return _norm_backward(module, x, g, [True, False, False])[0]


def norm_param_grads(
    module: nn.Module, x: Tensor, g: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Ordinary (summed) gradients of weight and bias (those in ``names``)."""
    mask = [False, "weight" in names, "bias" in names]
    _, weight, bias = _norm_backward(module, x, g, mask)
    return {k: v for k, v in (("weight", weight), ("bias", bias)) if v is not None}


@register_rule(
    nn.LayerNorm, check_input=_layer_norm_check, op_takes_module_input=lambda module: True,
    input_grad=norm_input_grad, param_grads=norm_param_grads, input_grad_too=True,
)  # fmt: skip
def layer_norm_batch_grads(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str], _: RuleOptions
) -> dict[str, Tensor]:
    """Individual gradients ``[N, *normalized_shape]`` of weight and bias; asked for
    (``INPUT``, autograd not recording, one dtype throughout), the ordinary input gradient
    too, from the statistics the weight's gradients normalise with (bit for bit torch's)."""
    x = inputs[0]
    n, shape = x.shape[0], tuple(module.normalized_shape)
    out: dict[str, Tensor] = {}
    stats = None
    same = x.dtype == g.dtype and all(
        t is None or t.dtype == x.dtype for t in (module.weight, module.bias)
    )  # (mixed dtypes: torch keeps the statistics in float32, the kernel wants them so)
    # (torch's CPU kernel normalises without a weight by a path 2-3x slower than with one;
    # a weight of ones gives the same values)
    wanted = "weight" in names or INPUT in names
    ones = x.new_ones(shape) if wanted and x.device.type == "cpu" else None
    if INPUT in names and not torch.is_grad_enabled() and same:
        x_hat, mean, rstd = torch.native_layer_norm(x, shape, ones, None, module.eps)
        stats = mean, rstd
    elif "weight" in names:
        x_hat = F.layer_norm(x, shape, ones, eps=module.eps)  # torch's own kernel
    if "weight" in names:
        out["weight"] = (g * x_hat.to(g.dtype)).reshape(n, -1, *shape).sum(1)
    if "bias" in names:
        out["bias"] = g.reshape(n, -1, *shape).sum(1)
    if stats is not None:
        weight, bias = module.weight, module.bias
        out[INPUT] = torch.ops.aten.native_layer_norm_backward(
            g, x, shape, *stats, weight, bias, [True, False, False]
        )[0]
    return out


def _group_norm_check(module: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    x = inputs[0]
    if x.dim() < 2:
        return f"got an input of shape {tuple(x.shape)}; expected [N, {module.num_channels}, ...]"
    return None


@register_rule(
    nn.GroupNorm, check_input=_group_norm_check, batch_first=True,
    op_takes_module_input=lambda module: True, input_grad=norm_input_grad,
    param_grads=norm_param_grads, input_grad_too=True,
)  # fmt: skip
def group_norm_batch_grads(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str], _: RuleOptions
) -> dict[str, Tensor]:
    """Individual gradients ``[N, C]`` of weight and bias.

    With each sample's groups taken as groups of their own (``[1, N*C, ...]`` in ``N*G``
    groups: the same statistics), torch's backward kernel sums over the one "sample" only, so
    its weight and bias gradients ``[N*C]`` are the individual ones, and its input gradient
    (asked for as ``INPUT``: the weight repeated for each sample) is the ordinary one, bit for
    bit, in the same call; where autograd records (``create_graph``: that kernel has no
    derivative) or the dtypes differ, by formula."""
    x = inputs[0]
    n, c = x.shape[0], x.shape[1]
    if not torch.is_grad_enabled() and x.dtype == g.dtype and x.numel():
        rows, groups = n * c, n * module.num_groups
        hw = math.prod(x.shape[2:])
        # (16-bit values in float32; the kernels' contiguous layout)
        xs = widen(x.reshape(1, rows, hw)).contiguous()
        gs = widen(g.reshape(1, rows, hw)).contiguous()
        _, mean, rstd = torch.native_group_norm(xs, None, None, 1, rows, hw, groups, module.eps)
        wants_input = (
            INPUT in names and xs.dtype == x.dtype and module.weight is not None
            and module.weight.dtype == x.dtype  # (mixed dtypes: the ordinary kernel's way)
        )  # fmt: skip
        mask = [wants_input, "weight" in names, "bias" in names]
        # (the weight only scales the input gradient; repeated by a copy of its expanded
        # view: half the time of repeat())
        weight = module.weight.expand(n, c).reshape(rows) if wants_input else gs.new_ones(rows)
        grad_x, grad_w, grad_b = torch.ops.aten.native_group_norm_backward(
            gs, xs, mean, rstd, weight, 1, rows, hw, groups, mask
        )
        pairs = (("weight", grad_w), ("bias", grad_b))
        found = {k: v.view(n, c) for k, v in pairs if v is not None}
        if grad_x is not None:
            found[INPUT] = grad_x.view(x.shape)
        return found
    out: dict[str, Tensor] = {}
    if "weight" in names:
        x_hat = F.group_norm(x, module.num_groups, eps=module.eps).to(g.dtype)
        out["weight"] = (g * x_hat).reshape(n, c, -1).sum(2)
    if "bias" in names:
        out["bias"] = g.reshape(n, c, -1).sum(2)
    return out
