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

from .batch import BatchDim, BatchTracker, Lookup, ThroughCopies
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
                params: tuple[nn.Parameter, ...], contribute: Contribute,
                lookup: Lookup | None, root: tuple[Tensor | ThroughCopies]) -> Tensor:  # fmt: skip
        """``root``: ``(where,)``, where the product to ``w``'s parameters starts
        (``BatchTracker.vjp_root``: ``w``, what a reentrant checkpoint's recomputation detached
        ``w`` from, or a :class:`ThroughCopies` for a tensor computed from such copies; in a
        tuple, so that autograd does not take it for an input)."""
        ctx.w, ctx.bd, ctx.n, ctx.params, ctx.contribute = w, bd, n, params, contribute
        ctx.lookup, ctx.root = lookup, root[0]
        return w.expand(shape)

    @staticmethod
    def backward(ctx: Any, h: Tensor) -> tuple[Tensor | None, ...]:
        w, bd, n = ctx.w, ctx.bd, ctx.n
        ctx.contribute.refuse_if_dropped()
        if not ctx.contribute.closed:
            with ctx.contribute.computing():
                if ctx.lookup is not None:  # rows of one parameter: scattered directly
                    rows = _looked_up_rows(h, w.shape, bd, n, ctx.lookup)
                    ctx.contribute({ctx.lookup.weight: rows}, None)
                else:
                    parts = _per_sample_parts(h, w.shape, bd, n)
                    hand_back(ctx.root, ctx.params, parts, ctx.contribute)
        return h.sum_to_size(w.shape), None, None, None, None, None, None, None


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


def _looked_up_rows(h: Tensor, w_shape: torch.Size, bd: BatchDim, n: int, lookup: Lookup) -> Tensor:
    """Each sample's gradient ``[N, V, D]`` of ``lookup.weight`` when ``w = weight[ids]``
    (``w_shape = [*ids.shape, D]``) was broadcast to ``h.shape``: each sample's part of ``h``
    scattered to its rows, in one ``index_add`` (a batched vector-Jacobian product through
    the embedding would loop over samples)."""
    ids, weight = lookup.ids, lookup.weight
    rows, dim = weight.shape
    w_d = bd.dim - (h.dim() - len(w_shape))  # w's dimension aligned with the batch
    if w_d >= 0 and w_shape[w_d] != 1:  # w has the batch there (an expanded buffer's lookup)
        values = h.sum_to_size(w_shape)  # its rows at batch index j belong to sample j
        shape = [1] * ids.dim()
        shape[w_d] = n
        sample = torch.arange(n, device=h.device).view(shape).expand(ids.shape)
    else:  # broadcast along the batch: every sample has a part for every row
        values = _per_sample_parts(h, w_shape, bd, n)  # [N, *w_shape]
        sample = torch.arange(n, device=h.device).view(n, *[1] * ids.dim()).expand(n, *ids.shape)
        ids = ids.expand(n, *ids.shape)
    index = (sample * rows + ids).reshape(-1)
    values = values.reshape(-1, dim)
    if lookup.padding_idx is not None:  # the padding row gets no gradient
        keep = ids.reshape(-1) != lookup.padding_idx
        index, values = index[keep], values[keep]
    out = values.new_zeros(n * rows, dim).index_add_(0, index, values)
    return out.view(n, rows, dim)


def meet(
    tracker: BatchTracker, name: str, args: tuple[Any, ...], owned: frozenset[nn.Parameter],
    contribute: Contribute, count_use: Callable[[frozenset[nn.Parameter]], None],
    refuse: Callable[[str], None],
) -> tuple[Any, ...]:  # fmt: skip
    """``args`` with every parameter-derived operand of a meeting op expanded to the batched
    shape through :class:`BroadcastCapture` (unchanged if the op is no meeting); ``refuse``
    gets what makes an operand's contributions out of reach (see ``BatchTracker.vjp_root``).

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
            lookup = tracker.lookup(t)
            if lookup is not None and (
                params != (lookup.weight,) or bd.inner != 1 or t.shape[:-1] != lookup.ids.shape
            ):
                lookup = None
            # (rows scattered directly: no product from t, so no root to look for)
            root = (t if lookup is not None else tracker.vjp_root(t, refuse),)
            e = BroadcastCapture.apply(t, shape_of(t), bd, n, params, contribute, lookup, root)
            tracker.mark(e, bd)
            t = e
        new.append(t)
    return (new, *args[1:]) if is_cat else tuple(new)
