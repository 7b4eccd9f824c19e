"""Per-sample contributions of parameters whose output is broadcast over the batch.

A position embedding looked up with ``arange(T)`` (nanoGPT, HF GPT-2/BERT) computes a tensor
``w`` from parameters only: it carries no batch. The samples only come in where ``w`` meets a
batched tensor, e.g. ``h = tok_emb + w`` with ``tok_emb: [N, T, D]``. There, ``w`` is first
expanded to the batched shape (exactly what broadcasting does), so the gradient arriving at the
expanded tensor, ``h_grad [N, T, D]``, holds each sample's part separately:

    c_n(w) = sum over the dimensions ``w`` was broadcast along of h_grad[n]   ([N, *w.shape])

and each parameter ``p`` that ``w`` derives from gets ``c_n(p) = (dw/dp)ᵀ c_n(w)``, computed for
all samples at once by one batched vector-Jacobian product (``is_grads_batched``). Where ``w``
has the batch size in the batch dimension without being broadcast (an ``expand`` of a buffer to
``[N, T]``), sample n's part of ``h_grad`` is placed at row n of an otherwise zero tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .batch import BatchDim, BatchTracker
from .ops import Contribute, hand_back

# ops that broadcast their tensor operands elementwise (or concatenate them): a batch-free
# operand can be expanded to the batched shape first without changing the result
ELEMENTWISE_MEETINGS = frozenset(
    {"add", "sub", "mul", "div", "truediv", "true_divide", "rsub", "where", "maximum", "minimum",
     "addcmul", "addcdiv", "lerp"}
)  # fmt: skip
CONCAT_MEETINGS = frozenset({"cat", "concat", "concatenate"})


class BroadcastCapture(torch.autograd.Function):
    """``w.expand(shape)`` whose backward also hands each sample's part to ``contribute``."""

    @staticmethod
    def forward(ctx: Any, w: Tensor, shape: tuple[int, ...], bd: BatchDim, n: int,
                params: tuple[nn.Parameter, ...], contribute: Contribute) -> Tensor:  # fmt: skip
        ctx.w, ctx.bd, ctx.n, ctx.params, ctx.contribute = w, bd, n, params, contribute
        return w.expand(shape)

    @staticmethod
    def backward(ctx: Any, h: Tensor) -> tuple[Tensor | None, ...]:
        w, bd, n = ctx.w, ctx.bd, ctx.n
        if not ctx.contribute.closed:
            with ctx.contribute.computing():
                hand_back(w, ctx.params, _per_sample_parts(h, w.shape, bd, n), ctx.contribute)
        return h.sum_to_size(w.shape), None, None, None, None, None


def _per_sample_parts(h: Tensor, w_shape: torch.Size, bd: BatchDim, n: int) -> Tensor:
    """Each sample's part of the gradient to ``w`` (broadcast to ``h.shape``): ``[N, *w_shape]``.

    ``h: [*S]`` with the batch at ``bd``; ``w`` is aligned with ``S`` from the right."""
    lead, d = h.dim() - len(w_shape), bd.dim
    rest = (*h.shape[:d], *h.shape[d + 1 :])
    # sample n's rows of h: [N, *S] with S[d] replaced by `inner`
    hs = h.movedim(d, 0).reshape(n, bd.inner, *rest).movedim(1, d + 1)
    w_d = d - lead  # w's dimension aligned with the batch (< 0: w has none)
    if w_d >= 0 and w_shape[w_d] != 1:  # w is not broadcast there: rows go to their sample
        full = h.new_zeros(n, *h.shape)
        view = full.view(n, *h.shape[:d], n, bd.inner, *h.shape[d + 1 :]).movedim(d + 1, 1)
        idx = torch.arange(n, device=h.device)
        view[idx, idx] = hs
        hs = full
    return hs.sum_to_size(n, *([1] * lead), *w_shape).reshape(n, *w_shape)


def meet(
    tracker: BatchTracker, name: str, args: tuple[Any, ...], owned: frozenset[nn.Parameter],
    contribute: Contribute, count_use: Callable[[frozenset[nn.Parameter]], None],
) -> tuple[Any, ...]:  # fmt: skip
    """``args`` with every parameter-derived operand of a meeting op expanded to the batched
    shape through :class:`BroadcastCapture` (unchanged if the op is no meeting).

    Only operands derived from parameters in ``owned`` are captured here (the others belong
    to a torch.func fallback root, which computes their individual gradients itself)."""
    is_cat = name in CONCAT_MEETINGS
    if name not in ELEMENTWISE_MEETINGS and not is_cat:
        return args
    operands = list(args[0]) if is_cat else list(args)
    tensors = [t for t in operands if isinstance(t, Tensor)]
    batched = [(t, tracker.info(t)) for t in tensors]
    batched = [(t, i) for t, i in batched if isinstance(i, BatchDim)]

    def captured(t: Any) -> bool:
        params = tracker.derived_params(t)
        return bool(params) and params <= owned

    if not batched or not any(captured(t) for t in tensors):
        return args
    ref, ref_bd = batched[0]
    if is_cat:
        shape_of: Callable[[Tensor], tuple[int, ...]] = lambda t: tuple(t.shape)  # noqa: E731
        out_nd = ref.dim()
    else:
        full = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
        shape_of = lambda t: full  # noqa: E731
        out_nd = len(full)
    bd = BatchDim(out_nd - (ref.dim() - ref_bd.dim), ref_bd.inner)
    n = tracker.n or 0
    new = []
    for t in operands:
        if captured(t):
            params = tuple(tracker.derived_params(t))
            count_use(frozenset(params))
            e = BroadcastCapture.apply(t, shape_of(t), bd, n, params, contribute)
            tracker.mark(e, bd)
            t = e
        new.append(t)
    return (new, *args[1:]) if is_cat else tuple(new)
