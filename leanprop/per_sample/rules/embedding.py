"""Rule for ``nn.Embedding``: ``y[n, t] = W[i_nt]`` with indices ``i: [N, *T]``, ``W: [V, D]``.

Individual gradient: ``W_n = sum_t e_{i_nt} g_ntᵀ  [V, D]`` (rows at ``padding_idx`` stay zero).
Squared norm without materialising it: ``||W_n||² = sum_{t,s} [i_nt = i_ns] (g_nt·g_ns)``;
for a weight shared with other layers (tied), the same from factors (``factors.py``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..factors import Factors, Lookup, inner, materialize
from ..registry import RuleOptions, register_rule


def _check(module: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    if module.scale_grad_by_freq:
        return (
            "has scale_grad_by_freq=True, which scales each gradient row by its frequency in the "
            "whole batch and so mixes samples; construct it with scale_grad_by_freq=False"
        )
    if inputs[0].dim() < 1:
        return f"got indices of shape {tuple(inputs[0].shape)}; expected [N, ...]"
    return None


def _flat(module: nn.Module, idx: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    n = idx.shape[0]
    flat_idx = idx.reshape(n, -1)  # [N, T]
    flat_g = g.reshape(n, -1, module.embedding_dim)  # [N, T, D]
    if module.padding_idx is not None:
        flat_g = flat_g * (flat_idx != module.padding_idx).unsqueeze(2).to(flat_g.dtype)
    return flat_idx, flat_g


def embedding_factors(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str]
) -> dict[str, Factors]:
    """The weight's individual gradients as factors ``Lookup(i_n [T], g_n [T, D])``."""
    idx, gs = _flat(module, inputs[0], g)
    return {"weight": Lookup(idx, gs, module.num_embeddings)} if "weight" in names else {}


def embedding_batch_l2(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str],
    options: RuleOptions,
) -> dict[str, Tensor]:  # fmt: skip
    """Squared norms ``[N]`` from the Gram matrix of output gradients, masked by equal indices
    (the factors' own inner product)."""
    f = embedding_factors(module, inputs, g, names)["weight"]
    return {"weight": inner(f, f, options.workspace_bytes)}


def _workspace(module: nn.Module, inputs: tuple[Any, ...], g: Tensor, _: RuleOptions) -> int:
    return module.num_embeddings * module.embedding_dim * g.element_size()


@register_rule(
    nn.Embedding, batch_l2=embedding_batch_l2, workspace=_workspace, check_input=_check,
    factors=embedding_factors, op_takes_module_input=lambda module: True,
)  # fmt: skip
def embedding_batch_grads(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str], _: RuleOptions
) -> dict[str, Tensor]:
    """Individual gradients ``{"weight": [N, V, D]}`` by scatter-add of the output gradients."""
    return {"weight": materialize(embedding_factors(module, inputs, g, names)["weight"])}
