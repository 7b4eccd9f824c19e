"""Rule for ``nn.Linear``: ``y = x Wᵀ + b`` with ``x: [N, *T, I]``, ``y: [N, *T, O]``.

Individual gradients: ``W_n = sum_t g_nt x_ntᵀ  [O, I]`` and ``b_n = sum_t g_nt  [O]``.
Squared norms without materialising ``W_n``:

* 2-D input: ``||W_n||² = ||x_n||² ||g_n||²``.
* sequence input: ``||W_n||² = sum_{t,s} (x_nt·x_ns)(g_nt·g_ns)`` (Gram matrices ``[N, T, T]``),
  used where that is cheaper than materialising ``W_n`` (:func:`gram_is_cheaper`).
* a weight shared with other layers (tied): the same from factors (``factors.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..factors import Factors, Outer, inner
from ..registry import RuleOptions, register_rule


def _check(module: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    x = inputs[0]
    if x.dim() < 2:
        return (
            f"got an input of shape {tuple(x.shape)}; expected [N, ..., {module.in_features}] "
            "with the batch first"
        )
    return None


def gram_is_cheaper(t: int, i: int, o: int, sums_wanted: bool = True) -> bool:
    """Whether the Gram form of the norms (``T² (I + O)`` per sample, plus the ordinary
    ``T I O`` gradient it still needs) beats materialising ``W_n`` (``T I O`` per sample, whose
    sum is the gradient): only where ``T (I + O)`` is well below ``I O`` (measured on CPU:
    about even at a half, materialising wins above, the Gram form far below). Without the
    summed gradient (``sums_wanted=False``): where ``T (I + O)`` is below ``I O``."""
    return (2 if sums_wanted else 1) * t * (i + o) < i * o


def _as_sequence(x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    return x.flatten(1, -2), g.flatten(1, -2)  # [N, T, I], [N, T, O]


def linear_batch_l2(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str],
    options: RuleOptions,
) -> dict[str, Tensor]:  # fmt: skip
    """Squared norms ``[N]`` of the individual gradients where a closed form is cheaper: the
    weight's (from the factors' norms, or their Gram matrices), and on a 2-D input the bias's
    (its individual gradients are the output gradient's rows; on sequences they are sums over
    positions, ``[N, O]``, whose own sum is cheaper than the summed gradient's pass over
    ``g``)."""
    x = inputs[0]
    out: dict[str, Tensor] = {}
    if "bias" in names and x.dim() == 2:
        out["bias"] = torch.linalg.vector_norm(g, dim=1).square()  # [N]
    if "weight" in names:
        if x.dim() == 2:  # (one product per sample: fewer kernel calls than pow and sum)
            out["weight"] = torch.linalg.vecdot(x, x) * torch.linalg.vecdot(g, g)  # [N]
        else:
            xs, gs = _as_sequence(x, g)
            t, i, o = xs.shape[1], xs.shape[2], gs.shape[2]
            if gram_is_cheaper(t, i, o, options.sums_wanted):  # the factors' inner product
                out["weight"] = inner(Outer(gs, xs), Outer(gs, xs), options.workspace_bytes)
    return out


def linear_factors(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str]
) -> dict[str, Factors]:
    """The weight's individual gradients as factors ``Outer(g_n [S, O], x_n [S, I])``."""
    x = inputs[0]
    xs, gs = (x.unsqueeze(1), g.unsqueeze(1)) if x.dim() == 2 else _as_sequence(x, g)
    return {"weight": Outer(gs, xs)} if "weight" in names else {}


def _workspace(module: nn.Module, inputs: tuple[Any, ...], g: Tensor, _: RuleOptions) -> int:
    return module.in_features * module.out_features * g.element_size()


def linear_input_grad(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """Ordinary input gradient ``g W``: ``[N, *T, I]`` (as one ``mm``: under autograd's
    batched gradients, whose vmap has a batching rule for ``mm`` and loops over ``matmul``)."""
    flat = g.reshape(-1, g.shape[-1]).mm(module.weight.to(g.dtype))  # [N*T, I]
    return flat.reshape(*g.shape[:-1], flat.shape[-1])


def linear_param_grads(
    module: nn.Module, x: Tensor, g: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Ordinary (summed) parameter gradients."""
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])  # [N*T, O], [N*T, I]
    out: dict[str, Tensor] = {}
    if "weight" in names:
        out["weight"] = g2.mT @ x2  # [O, I]
    if "bias" in names:
        out["bias"] = g2.sum(0)  # [O]
    return out


@register_rule(
    nn.Linear,
    batch_l2=linear_batch_l2,
    workspace=_workspace,
    check_input=_check,
    input_grad=linear_input_grad,
    param_grads=linear_param_grads,
    can_fuse=lambda module: True,
    accepts_out=True,
    factors=linear_factors,
    op_takes_module_input=lambda module: True,
)
def linear_batch_grads(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str], _: RuleOptions,
    out: dict[str, Tensor | None] | None = None,
) -> dict[str, Tensor]:  # fmt: skip
    """Individual gradients ``{"weight": [N, O, I], "bias": [N, O]}`` (those in ``names``);
    the weight's written into ``out["weight"]`` where given."""
    x = inputs[0]
    target = (out or {}).get("weight")
    grads: dict[str, Tensor] = {}
    if x.dim() == 2:
        if "weight" in names:
            grads["weight"] = torch.mul(g.unsqueeze(2), x.unsqueeze(1), out=target)  # [N, O, I]
        if "bias" in names:
            grads["bias"] = g  # [N, O]
        return grads
    xs, gs = _as_sequence(x, g)
    if "weight" in names:
        grads["weight"] = torch.bmm(gs.mT, xs, out=target)  # [N, O, I]
    if "bias" in names:
        grads["bias"] = gs.sum(1)  # [N, O]
    return grads
