"""Rules for ``nn.LayerNorm`` and ``nn.GroupNorm``: ``y = x̂ ⊙ w + b``.

``x̂`` is recomputed from the captured input; the individual gradients are
``w_n = sum (g_n ⊙ x̂_n)`` and ``b_n = sum g_n`` over every position of sample n that shares
the same weight entry.
"""

from __future__ import annotations

from typing import Any

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


@register_rule(
    nn.LayerNorm, check_input=_layer_norm_check, op_takes_module_input=lambda module: True
)
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
    op_takes_module_input=lambda module: True,
)  # fmt: skip
def group_norm_batch_grads(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str], _: RuleOptions
) -> dict[str, Tensor]:
    """Individual gradients ``[N, C]`` of weight and bias."""
    x = inputs[0]
    n, c = x.shape[0], x.shape[1]
    out: dict[str, Tensor] = {}
    if "weight" in names:
        x_hat = F.group_norm(x, module.num_groups, eps=module.eps).to(g.dtype)
        out["weight"] = (g * x_hat).reshape(n, c, -1).sum(2)
    if "bias" in names:
        out["bias"] = g.reshape(n, c, -1).sum(2)
    return out
