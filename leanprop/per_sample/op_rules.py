"""Closed forms for parameters used directly in common ops (the fast path of ``ops.py``).

``x: [..., I]`` with the batch in a leading dimension (possibly flattened with others, as in
HF's ``Conv1D``: ``addmm(b, x.view(-1, I), W)``), output gradient ``g: [..., O]``. With
``x_n: [S, I]`` and ``g_n: [S, O]`` sample n's rows:

* ``linear(x, W, b)``, ``W: [O, I]``: ``W_n = g_nᵀ x_n``, ``b_n = sum_s g_n[s]``;
* ``matmul(x, W)``, ``W: [I, O]``: ``W_n = x_nᵀ g_n``;
* ``addmm(b, x, W)``: as ``matmul``, plus ``b_n = sum_s g_n[s]``.

Each returns ``{tensor position: [N, *shape]}`` for the captured positions, or None when the
call has another form (the generic batched vector-Jacobian product then runs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .batch import BatchDim, to_front


def _rows(t: Tensor, bd: BatchDim, n: int) -> Tensor:
    """``[N, S, last]``: sample n's rows of ``t`` (batch in a leading dimension)."""
    front = to_front(t, bd, n)
    return front.reshape(n, -1, t.shape[-1])


def closed_form(
    name: str, tensors: Sequence[Tensor], in_batch: Sequence[BatchDim | None],
    positions: Sequence[int], g: Tensor, out_bd: BatchDim, n: int, n_args: int,
) -> dict[int, Tensor] | None:  # fmt: skip
    """Per-sample contributions of the tensors at ``positions``, by a closed form, or None.

    ``n_args``: how many of ``tensors`` were positional (the rest came as keywords)."""
    if name in ("linear", "matmul", "mm"):
        x, w = (tensors[0], tensors[1]) if len(tensors) >= 2 else (None, None)
        bias = tensors[2] if name == "linear" and len(tensors) == 3 else None
        if n_args != len(tensors) or w is None or w.dim() != 2 or 0 in positions:
            return None
    elif name == "addmm":
        if len(tensors) != 3 or n_args != 3 or 1 in positions:
            return None
        bias, x, w = tensors
    else:
        return None
    bd = in_batch[0 if name != "addmm" else 1]
    if bd is None or bd.dim >= x.dim() - 1 or out_bd.dim >= g.dim() - 1:
        return None
    # in the dtype the op computed in (autocast: the output gradient's)
    xs, gs = _rows(x.to(g.dtype), bd, n), _rows(g, out_bd, n)  # [N, S, I], [N, S, O]
    out: dict[int, Tensor] = {}
    w_at, b_at = (1, 2) if name != "addmm" else (2, 0)
    if w_at in positions:
        out[w_at] = torch.bmm(gs.mT, xs) if name == "linear" else torch.bmm(xs.mT, gs)
    if b_at in positions and bias is not None:
        if bias.dim() != 1:
            return None
        out[b_at] = gs.sum(1)
    return out if set(out) == set(positions) else None
