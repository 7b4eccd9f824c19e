"""Closed forms for parameters used directly in common ops (the fast path of ``ops.py``).

``x: [..., I]`` with the batch in a leading dimension (possibly flattened with others, as in
HF's ``Conv1D``: ``addmm(b, x.view(-1, I), W)``), output gradient ``g: [..., O]``. With
``x_n: [S, I]`` and ``g_n: [S, O]`` sample n's rows:

* ``linear(x, W, b)``, ``W: [O, I]``: ``W_n = g_nᵀ x_n``, ``b_n = sum_s g_n[s]``;
* ``matmul(x, W)``, ``W: [I, O]``: ``W_n = x_nᵀ g_n``;
* ``addmm(b, x, W)``: as ``matmul``, plus ``b_n = sum_s g_n[s]``;
* ``chunked_linear_cross_entropy(h, W, target, b)`` (a loss summed over rows, the rows of each
  sample together): ``W_n = sum_s d_nsᵀ h_ns`` with ``d`` the gradient of the loss with respect
  to the logits, recomputed a chunk of rows at a time (``[N, V, D]`` is the result).

Each returns ``{tensor position: [N, *shape]}`` for the captured positions, or None when the
call has another form (the generic batched vector-Jacobian product then runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..side_losses.lm_head import LossSpec, logit_grads, rows_per_chunk
from .batch import BatchDim, to_front
from .chunks import Scratch, sample_chunks
from .clipping import scale_per_sample
from .rules.linear import gram_is_cheaper
from .stats import sample_sum, sq_norms, widen


def _rows(t: Tensor, bd: BatchDim, n: int) -> Tensor:
    """``[N, S, last]``: sample n's rows of ``t`` (batch in a leading dimension)."""
    front = to_front(t, bd, n)
    return front.reshape(n, front[:1].numel() // t.shape[-1] if n else 0, t.shape[-1])


def linear_form(
    name: str, tensors: Sequence[Tensor], in_batch: Sequence[BatchDim | None],
    positions: Sequence[int], n_args: int,
) -> tuple[Tensor, BatchDim, int, int, Tensor | None] | None:  # fmt: skip
    """``(x, its batch, weight position, bias position, bias)`` of a linear/matmul/mm/addmm
    call whose closed forms apply (parameters at ``positions``; the tensors passed
    positionally), or None for other forms."""
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
    if bd is None or bd.dim >= x.dim() - 1:
        return None
    if bias is not None and bias.dim() != 1:
        return None
    w_at, b_at = (1, 2) if name != "addmm" else (2, 0)
    return x, bd, w_at, b_at, bias


def _linear_rows(
    name: str, tensors: Sequence[Tensor], in_batch: Sequence[BatchDim | None],
    positions: Sequence[int], g: Tensor, out_bd: BatchDim | None, n: int, n_args: int,
) -> tuple[Tensor, Tensor, int, int, Tensor | None] | None:  # fmt: skip
    """``(xs [N, S, I], gs [N, S, O], weight position, bias position, bias)`` of a
    linear/matmul/addmm call with parameters at ``positions``, or None for other forms."""
    form = linear_form(name, tensors, in_batch, positions, n_args)
    if form is None or out_bd is None or out_bd.dim >= g.dim() - 1:
        return None
    x, bd, w_at, b_at, bias = form
    # in the dtype the op computed in (autocast: the output gradient's)
    xs, gs = _rows(x.to(g.dtype), bd, n), _rows(g, out_bd, n)  # [N, S, I], [N, S, O]
    return xs, gs, w_at, b_at, bias


def closed_form(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], tensors: Sequence[Tensor],
    in_batch: Sequence[BatchDim | None], positions: Sequence[int], g: Tensor,
    out_bd: BatchDim | None, n: int, n_args: int,
) -> dict[int, Tensor] | None:  # fmt: skip
    """Per-sample contributions of the tensors at ``positions``, by a closed form, or None.

    ``args, kwargs``: the op's call; ``tensors``: its tensors in order, ``n_args`` of them
    positional; ``out_bd``: the batch in the output (None: it has none, e.g. a summed loss)."""
    if name == "chunked_linear_cross_entropy":
        return _chunked_cross_entropy(args, kwargs, in_batch[0], positions, g, n)
    parts = _linear_rows(name, tensors, in_batch, positions, g, out_bd, n, n_args)
    if parts is None:
        return None
    xs, gs, w_at, b_at, bias = parts
    out: dict[int, Tensor] = {}
    if w_at in positions:
        out[w_at] = torch.bmm(gs.mT, xs) if name == "linear" else torch.bmm(xs.mT, gs)
    if b_at in positions and bias is not None:
        out[b_at] = gs.sum(1)
    return out if set(out) == set(positions) else None


def linear_input_grad(
    name: str, tensors: Sequence[Tensor], in_batch: Sequence[BatchDim | None],
    positions: Sequence[int], g: Tensor, n_args: int,
) -> tuple[int, Tensor] | None:  # fmt: skip
    """``(position, gradient)`` of the activation operand of a linear/matmul/mm/addmm call
    whose closed forms apply (``linear_form``), by the product autograd's own backward
    computes (the same values, bit for bit), or None for other forms and mixed dtypes
    (autocast: autograd's casts decide).

    Computed here rather than by a backward through the op's own graph: under a
    non-reentrant checkpoint, such a backward (a graph task of its own) would recompute the
    checkpointed block once more, and hold what it recomputed to the end of backward."""
    form = linear_form(name, tensors, in_batch, positions, n_args)
    if form is None:
        return None
    x, _, w_at, _, _ = form
    w = tensors[w_at]
    if not (x.dtype == w.dtype == g.dtype) or (name in ("addmm", "mm") and x.dim() != 2):
        return None
    return (1 if name == "addmm" else 0), g @ (w if name == "linear" else w.mT)


def closed_norms(
    name: str, tensors: Sequence[Tensor], in_batch: Sequence[BatchDim | None],
    positions: Sequence[int], g: Tensor, out_bd: BatchDim | None, n: int, n_args: int,
    workspace_bytes: int, scratch: Scratch, sums_wanted: bool = True,
) -> dict[int, tuple[Tensor, Tensor]] | None:  # fmt: skip
    """``{position: (||c_n||² [N], summed gradient)}`` without keeping the individual
    gradients, for linear/matmul/addmm: from Gram matrices ``[N, S, S]`` where
    ``gram_is_cheaper``, else materialised a chunk of samples at a time (at most
    ``workspace_bytes``) in the ``scratch`` buffer. None for other ops (and for the
    materialised form while autograd records). ``sums_wanted=False`` (clipping): zeros
    (a stride-0 view) for the summed gradient of the Gram form, which then pays off sooner."""
    parts = _linear_rows(name, tensors, in_batch, positions, g, out_bd, n, n_args)
    if parts is None:
        return None
    xs, gs, w_at, b_at, bias = parts
    s, i, o = xs.shape[1], xs.shape[2], gs.shape[2]
    out: dict[int, tuple[Tensor, Tensor]] = {}
    if w_at in positions and gram_is_cheaper(s, i, o, sums_wanted):
        norms = (torch.bmm(xs, xs.mT) * torch.bmm(gs, gs.mT)).sum((1, 2))
        x2, g2 = xs.reshape(-1, i), gs.reshape(-1, o)
        w = tensors[w_at]
        if not sums_wanted:
            out[w_at] = (norms, w.new_zeros(()).expand_as(w))
        else:
            out[w_at] = (norms, g2.mT @ x2 if name == "linear" else x2.mT @ g2)
    elif w_at in positions:
        if torch.is_grad_enabled():  # create_graph: the per-sample path keeps them in the graph
            return None
        left, right = (gs.mT, xs) if name == "linear" else (xs.mT, gs)
        out[w_at] = _materialised_norms(left, right, workspace_bytes, scratch)
    if b_at in positions and bias is not None:
        per = gs.sum(1)  # [N, O]
        out[b_at] = (per.square().sum(1), per.sum(0))
    return out if set(out) == set(positions) else None


def linear_reweigher(
    name: str, tensors: Sequence[Tensor], in_batch: Sequence[BatchDim | None], position: int,
    g: Tensor, out_bd: BatchDim | None, n: int, n_args: int,
) -> Callable[[Tensor], Tensor] | None:  # fmt: skip
    """For clipping (``clipping.py``): the function ``a -> sum_n a_n c_n`` (``a: [N]``) of
    the parameter at ``position`` of a linear/matmul/addmm call: its summed gradient with the
    output gradient scaled per sample. None for other forms.

    Args:
        name: the op (``"linear"``, ``"matmul"``, ``"mm"``, ``"addmm"``).
        tensors: the op's tensors in order; in_batch: where each holds the batch.
        position: the parameter's place among ``tensors``.
        g: the output gradient; out_bd: where it holds the batch.
        n: the batch size N; n_args: how many of ``tensors`` were positional.
    """
    parts = _linear_rows(name, tensors, in_batch, [position], g, out_bd, n, n_args)
    if parts is None:
        return None
    xs, gs, w_at, _, _ = parts

    def reweigh(a: Tensor) -> Tensor:
        ga = scale_per_sample(gs, a)  # [N, S, O]
        if position != w_at:  # the bias
            return ga.sum((0, 1))
        x2, g2 = xs.reshape(-1, xs.shape[2]), ga.reshape(-1, ga.shape[2])
        return g2.mT @ x2 if name == "linear" else x2.mT @ g2

    return reweigh


def _materialised_norms(
    left: Tensor, right: Tensor, workspace_bytes: int, scratch: Scratch
) -> tuple[Tensor, Tensor]:
    """Squared norms ``[N]`` and sum ``[A, B]`` of the products ``left[n] @ right[n]``
    (``left: [N, A, S]``, ``right: [N, S, B]``), a chunk of samples at a time."""
    n, a, b = left.shape[0], left.shape[1], right.shape[2]
    norms: list[Tensor] = []
    total: Tensor | None = None
    for start, stop in sample_chunks(n, a * b * left.element_size(), workspace_bytes):
        part = scratch.take((stop - start, a, b), left)
        torch.bmm(left[start:stop], right[start:stop], out=part)
        norms.append(sq_norms(part))
        s = sample_sum(widen(part))  # (16-bit chunks add up in float32)
        total = s if total is None else total.add_(s)
    if total is None:  # no samples
        return left.new_zeros(0), left.new_zeros(a, b)
    return torch.cat(norms) if len(norms) > 1 else norms[0], total.to(left.dtype)


def _chunked_cross_entropy(
    args: Sequence[Any], kwargs: dict[str, Any], bd: BatchDim | None, positions: Sequence[int],
    g: Tensor, n: int,
) -> dict[int, Tensor] | None:  # fmt: skip
    h, weight, target = args[0], args[1], args[2]
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    h2, t1 = h.reshape(-1, h.shape[-1]), target.reshape(-1).long()
    rows = h2.shape[0]
    if bd is None or bd.dim != 0 or not n or rows % n or not set(positions) <= {1, 3}:
        return None  # rows not grouped by sample: the generic path decides
    inner = rows // n  # rows of one sample (h is [N*T, D] or [N, T, D])
    chunk = rows_per_chunk(weight, kwargs.get("chunk_size"), kwargs.get("chunk_mib", 32.0))
    spec = LossSpec(
        kwargs.get("ignore_index", -100), kwargs.get("class_weight"),
        float(kwargs.get("label_smoothing", 0.0)),
    )  # fmt: skip
    acc = torch.float32 if h2.dtype != torch.float64 else h2.dtype
    reduction = kwargs.get("reduction", "mean")
    per_row = g.reshape(-1) if reduction == "none" else None  # each row's output gradient
    scale = g
    if reduction == "mean":
        keep = t1 != spec.ignore_index
        mass = spec.row_weights(t1, keep, acc).sum()
        # a total weight of 0, as torch: NaN where a row was kept, else 0
        scale = torch.where(keep.any(), torch.where(mass == 0, torch.nan, g / mass), 0)
    per_w = weight.new_zeros(n, *weight.shape) if 1 in positions else None
    per_b = bias.new_zeros(n, *bias.shape) if 3 in positions and bias is not None else None
    for start, stop, d, _ in logit_grads(h2, weight, bias, t1, chunk, spec, acc):
        if per_row is not None:
            d = d * per_row[start:stop, None].to(d.dtype)
        for s in range(start // inner, (stop - 1) // inner + 1):  # samples in the chunk
            lo, hi = max(start, s * inner), min(stop, (s + 1) * inner)
            if per_w is not None:
                per_w[s].addmm_(d[lo - start : hi - start].mT, h2[lo:hi])
            if per_b is not None:
                per_b[s] += d[lo - start : hi - start].sum(0).sum_to_size(bias.shape)
    out: dict[int, Tensor] = {}
    for i, per in ((1, per_w), (3, per_b)):
        if per is not None:
            out[i] = per if per_row is not None else per.mul_(scale.to(per.dtype))
    return out if set(out) == set(positions) else None
