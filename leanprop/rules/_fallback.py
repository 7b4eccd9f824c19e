"""Generic rule for any module that owns parameters but has no closed-form rule.

Individual gradients come from ``torch.func``: for every sample, the gradient of
``<module(x_n), g_n>`` with respect to the module's parameters, vectorised with ``vmap``. The
module's whole sub-tree is handled in one go, so modules that use their children's parameters
directly (``nn.MultiheadAttention``) are covered.

Inputs and outputs are split along ``batch_dim`` (0, or 1 for sequence-first modules such as
``nn.MultiheadAttention(batch_first=False)``); tensors whose size there differs from N are
passed whole to every sample.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten


def batch_dim_of(module: nn.Module) -> int:
    """Batch dimension of the module's inputs: 1 for sequence-first attention/RNNs, else 0."""
    seq_first = (nn.MultiheadAttention, nn.RNNBase)
    if isinstance(module, seq_first) and not getattr(module, "batch_first", False):
        return 1
    return 0


def _split_dim(t: Any, preferred: int, n: int) -> int | None:
    if not isinstance(t, Tensor):
        return None
    if t.dim() > preferred and t.shape[preferred] == n:
        return preferred
    return None


def fallback_batch_grads(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grads_out: list[Tensor | None],
    names: frozenset[str],
    n: int,
) -> dict[str, Tensor]:
    """Individual gradients ``{name: [N, *p.shape]}`` of the module's parameters in ``names``.

    Args:
        module: the module, called as ``module(*args, **kwargs)`` during forward.
        args, kwargs: the captured call (a chunk of samples along the batch dim).
        grads_out: gradient of each leaf of the flattened output, None where it got none.
        names: qualified parameter names (as in ``module.named_parameters()``) to differentiate.
        n: number of samples in this chunk.
    """
    bd = batch_dim_of(module)
    params = {k: p for k, p in module.named_parameters() if k in names}
    leaves, spec = tree_flatten((args, kwargs))
    in_dims = [_split_dim(t, bd, n) for t in leaves]
    got = [(i, g) for i, g in enumerate(grads_out) if g is not None]
    g_dims = [_split_dim(g, bd, n) if _split_dim(g, bd, n) is not None else 0 for _, g in got]

    def one(p: dict[str, Tensor], in_leaves: list[Any], g_leaves: list[Tensor]) -> Tensor:
        full = [
            t.unsqueeze(d) if d is not None else t for t, d in zip(in_leaves, in_dims, strict=True)
        ]
        a, kw = tree_unflatten(full, spec)
        out_leaves, _ = tree_flatten(functional_call(module, p, a, kw))
        total = 0.0
        for (i, _), g, d in zip(got, g_leaves, g_dims, strict=True):
            total = total + (out_leaves[i] * g.unsqueeze(d)).sum()
        return total

    g_leaves = [g for _, g in got]
    with warnings.catch_warnings():
        # torch's note that some op (e.g. CPU flash attention) is vmapped by a slow loop
        warnings.filterwarnings("ignore", message="There is a performance drop")
        return vmap(grad(one), in_dims=(None, in_dims, g_dims))(params, leaves, g_leaves)
