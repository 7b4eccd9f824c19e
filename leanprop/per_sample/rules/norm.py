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

from ..registry import RuleOptions, register_rule


def _layer_norm_check(module: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    x, k = inputs[0], len(module.normalized_shape)
    if x.dim() <= k:
        return (
            f"got an input of shape {tuple(x.shape)}; expected [N, ..., "
            f"{', '.join(map(str, module.normalized_shape))}] with the batch first"
        )
    return None


def _affine(module: nn.Module, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
    weight, bias = module.weight, module.bias
    return (
        None if weight is None else weight.to(g.dtype),
        None if bias is None else bias.to(g.dtype),
    )


def _norm_backward(module: nn.Module, x: Tensor, g: Tensor, mask: list[bool]) -> tuple:
    """``(grad_x, grad_weight, grad_bias)`` of the module's op at ``x`` (those in ``mask``;
    the others None), by torch's backward kernel (under ``create_graph``: by autograd on the
    op recomputed, differentiable)."""
    if torch.is_grad_enabled():
        leaves = [
            t if t is None or not m or t.requires_grad else t.detach().requires_grad_()
            for t, m in zip((x, module.weight, module.bias), mask, strict=True)
        ]
        x_, weight, bias = leaves
        with torch.enable_grad():
            out = _op(module, x_, *(None if t is None else t.to(g.dtype) for t in (weight, bias)))
        wrt = [t for t, m in zip(leaves, mask, strict=True) if m]
        found = iter(torch.autograd.grad(out, wrt, g, create_graph=True))
        return tuple(next(found) if m else None for m in mask)
    weight, bias = _affine(module, g)
    if isinstance(module, nn.LayerNorm):
        shape = tuple(module.normalized_shape)
        _, mean, rstd = torch.native_layer_norm(x, shape, None, None, module.eps)
        return torch.ops.aten.native_layer_norm_backward(
            g, x, shape, mean, rstd, weight, bias, mask
        )
    n, c, groups = x.shape[0], x.shape[1], module.num_groups
    hw = math.prod(x.shape[2:])
    _, mean, rstd = torch.native_group_norm(x, None, None, n, c, hw, groups, module.eps)
    return torch.ops.aten.native_group_norm_backward(
        g.contiguous(), x.contiguous(), mean, rstd, weight, n, c, hw, groups, mask
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
    input_grad=norm_input_grad, param_grads=norm_param_grads,
)  # fmt: skip
def layer_norm_batch_grads(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str], _: RuleOptions
) -> dict[str, Tensor]:
    """Individual gradients ``[N, *normalized_shape]`` of weight and bias."""
    x = inputs[0]
    n, shape = x.shape[0], tuple(module.normalized_shape)
    out: dict[str, Tensor] = {}
    if "weight" in names:
        x_hat = F.layer_norm(x, shape, eps=module.eps).to(g.dtype)  # torch's own kernel
        out["weight"] = (g * x_hat).reshape(n, -1, *shape).sum(1)
    if "bias" in names:
        out["bias"] = g.reshape(n, -1, *shape).sum(1)
    return out


def _group_norm_check(module: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    x = inputs[0]
    if x.dim() < 2:
        return f"got an input of shape {tuple(x.shape)}; expected [N, {module.num_channels}, ...]"
    return None


@register_rule(
    nn.GroupNorm, check_input=_group_norm_check, batch_first=True,
    op_takes_module_input=lambda module: True, input_grad=norm_input_grad,
    param_grads=norm_param_grads,
)  # fmt: skip
def group_norm_batch_grads(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str], _: RuleOptions
) -> dict[str, Tensor]:
    """Individual gradients ``[N, C]`` of weight and bias.

    With each sample's groups taken as groups of their own (``[1, N*C, ...]`` in ``N*G``
    groups: the same statistics), torch's backward kernel sums over the one "sample" only, so
    its weight and bias gradients ``[N*C]`` are the individual ones; where autograd records
    (``create_graph``: that kernel has no derivative) or the dtypes differ, by formula."""
    x = inputs[0]
    n, c = x.shape[0], x.shape[1]
    if not torch.is_grad_enabled() and x.dtype == g.dtype and x.numel():
        rows, groups = n * c, n * module.num_groups
        hw = x[0, 0].numel()
        xs, gs = x.reshape(1, rows, hw), g.reshape(1, rows, hw)
        _, mean, rstd = torch.native_group_norm(xs, None, None, 1, rows, hw, groups, module.eps)
        mask = [False, "weight" in names, "bias" in names]
        _, weight, bias = torch.ops.aten.native_group_norm_backward(
            gs.contiguous(),
            xs.contiguous(),
            mean,
            rstd,
            g.new_ones(rows),
            1,
            rows,
            hw,
            groups,
            mask,
        )
        found = (("weight", weight), ("bias", bias))
        return {k: v.view(n, c) for k, v in found if v is not None}
    out: dict[str, Tensor] = {}
    if "weight" in names:
        x_hat = F.group_norm(x, module.num_groups, eps=module.eps).to(g.dtype)
        out["weight"] = (g * x_hat).reshape(n, c, -1).sum(2)
    if "bias" in names:
        out["bias"] = g.reshape(n, c, -1).sum(2)
    return out
