"""Where the batch lands when a tensor is indexed: ``x[...]`` with slices, integers, boolean
masks or index tensors, and which samples a pick along the batch takes (so that two different
picks meeting later are told as different samples meeting)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .infos import BatchDim, Combined, Info, Lost, Selected, as_picks, dims_arg, samples_at

if TYPE_CHECKING:
    from .tracker import BatchTracker


def index_result(index: Any, ndim: int, bd: BatchDim, n: int, tracker: BatchTracker) -> Info:
    """Where the batch lands in ``x[index]``."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(it, Tensor) and it.dtype == torch.bool for it in items):
        return _masked_rows(items, bd, n)
    if any(isinstance(it, Tensor | list | tuple) for it in items):  # (a tuple item: a list)
        return _advanced_index(items, ndim, bd, n, tracker)
    n_consumes = sum(1 for it in items if it is not None and it is not Ellipsis)
    in_dim = out_dim = 0
    for it in items:
        if it is Ellipsis:
            skip = ndim - n_consumes
            if in_dim <= bd.dim < in_dim + skip:
                return BatchDim(out_dim + bd.dim - in_dim, bd.inner)
            in_dim, out_dim = in_dim + skip, out_dim + skip
        elif it is None:
            out_dim += 1
        elif isinstance(it, slice):
            if in_dim == bd.dim:
                positions = range(*it.indices(n * bd.inner))
                if positions != range(n * bd.inner):
                    picks = samples_at(positions, bd.inner)
                    return Selected(
                        "a slice over the batch dimension selects samples", picks, out_dim
                    )
                return BatchDim(out_dim, bd.inner)  # (all of them, in order: x[:N] too)
            in_dim, out_dim = in_dim + 1, out_dim + 1
        else:  # an integer
            if in_dim == bd.dim:
                picks = samples_at(range(n * bd.inner)[int(it) : int(it) + 1 or None], bd.inner)
                return Selected("an index into the batch dimension selects one sample", picks)
            in_dim += 1
    return BatchDim(out_dim + bd.dim - in_dim, bd.inner)


def assigned_result(
    index: Any, dest: Tensor, value: Tensor, info: Info, tracker: BatchTracker
) -> Info:  # fmt: skip
    """Where the batch of ``value`` (at ``info``) lands in ``dest`` by ``dest[index] = value``
    (HF's ``shift_tokens_right``: ``shifted[:, 1:] = ids[:, :-1]`` into
    ``ids.new_zeros(ids.shape)``, the decoder's input ids of BART, T5, Whisper): the dimension
    of ``dest`` that ``dest[index]`` takes whole (every sample's place, as :func:`index_result`
    follows a dimension through the index) as the one the value's batch is in; values summed
    over the samples as they are; else :class:`Lost` (the samples in part of ``dest`` only, or
    an index leanprop does not follow)."""
    if isinstance(info, Combined):
        return info
    if not isinstance(info, BatchDim):
        return Lost(f"values that carry the batch ({info.reason}) assigned into a tensor")
    items = list(index) if isinstance(index, tuple) else [index]
    basic = all(
        it is None or it is Ellipsis or isinstance(it, slice)
        or (isinstance(it, int) and not isinstance(it, bool))
        for it in items
    )  # fmt: skip
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    if not basic or items.count(Ellipsis) > 1 or consumed > dest.dim():
        return Lost("values that carry the batch assigned into a tensor by an advanced index")
    ints = sum(1 for it in items if isinstance(it, int))
    view_dim = info.dim + (dest.dim() - ints + items.count(None)) - value.dim()
    whole = [
        d for d in range(dest.dim())
        if dest.shape[d] == value.shape[info.dim]
        and index_result(index, dest.dim(), BatchDim(d), dest.shape[d], tracker)
        == BatchDim(view_dim)
    ]  # fmt: skip
    if len(whole) != 1:
        return Lost("values that carry the batch assigned into part of a tensor along it")
    return BatchDim(whole[0], info.inner)


def base_result(view: Tensor, base: Tensor, info: Info) -> Info:
    """Where the batch is in ``base``, which carried none, after an op wrote values into
    ``view`` (one of its views) in place, ``view`` now carrying the batch at ``info``
    (``out[:, t].copy_(h)`` into a preallocated ``out``): the one dimension of ``base`` with
    the size and stride of the view's batch dimension (all of it, so every sample's place);
    else :class:`Lost`."""
    if not isinstance(info, BatchDim):
        return Lost("values that carry the batch written into a view of a tensor")
    size, stride = view.shape[info.dim], view.stride(info.dim)
    same = [d for d in range(base.dim()) if base.shape[d] == size and base.stride(d) == stride]
    if size < 2 or len(same) != 1:
        return Lost("values that carry the batch written into part of a tensor along it")
    return BatchDim(same[0], info.inner)


def _masked_rows(items: list[Any], bd: BatchDim, n: int) -> Info:
    """Where the batch lands in ``x[mask]``: a boolean mask over ``x``'s first dimensions, the
    samples' first, gives each sample's selected elements together, in order; the batch
    survives, as N groups of ``c`` rows, where every sample has the same number ``c`` of them
    (HF BART's classification head takes each sample's end-of-sentence tokens so). One host
    synchronisation."""
    mask, rest = items[0], items[1:]
    whole = all(it is Ellipsis or it == slice(None) for it in rest)
    if (
        not (isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.dim() > 0)
        or not whole
        or bd != BatchDim(0)
        or mask.shape[0] != n
        or n == 0
    ):
        return Lost("boolean-mask indexing")
    counts = mask.reshape(n, -1).sum(1)
    c = int(counts[0])
    if c == 0 or not bool((counts == c).all()):
        picks = as_picks(mask.reshape(n, -1).nonzero()[:, 0].tolist())  # (each row's sample)
        return Selected("boolean-mask indexing (not as many elements of every sample)", picks, 0)
    return BatchDim(0, c)


def _advanced_index(
    items: list[Any], ndim: int, bd: BatchDim, n: int, tracker: BatchTracker
) -> Info:
    """``x[..., idx, ...]`` with index tensors: the batch survives where the batch dimension is
    indexed by ``arange(N)`` (checked, one host synchronisation) or by a batched index, and
    lands where that index varies in the broadcast index shape."""
    if any(it is None for it in items) or items.count(Ellipsis) > 1 or bd.inner != 1:
        return Lost("advanced indexing")
    if Ellipsis in items:  # (as many full slices as dimensions the other items leave)
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (ndim - len(items) + 1)
    items = items + [slice(None)] * (ndim - len(items))
    adv = [d for d, it in enumerate(items) if not isinstance(it, slice)]
    for d in adv:  # a list of integers indexes as the tensor of them (``x[..., [-2], :]``)
        if isinstance(items[d], list | tuple):
            try:
                items[d] = torch.tensor(items[d])
            except (TypeError, ValueError, RuntimeError):
                return Lost("advanced indexing with a list")
            if items[d].dtype in (torch.bool, torch.uint8) or items[d].is_floating_point():
                return Lost("advanced indexing with a list")
    if any(not isinstance(items[d], Tensor) for d in adv):
        return Lost("advanced indexing with a list")
    it = items[bd.dim]
    if isinstance(it, slice) and not (
        it.start in (None, 0) and it.stop is None and it.step in (None, 1)
    ):
        return Lost("a slice over the batch dimension selects samples")
    b_shape = torch.broadcast_shapes(*(items[d].shape for d in adv))
    adjacent = adv == list(range(adv[0], adv[-1] + 1))
    front = adv[0] if adjacent else 0  # where the broadcast index dimensions go
    if bd.dim not in adv:
        if any(tracker.info(items[d]) is not None for d in adv):
            return Lost("advanced indexing with a batched index")
        if bd.dim < adv[0] or not adjacent:
            before = sum(1 for d in range(bd.dim) if d not in adv) if not adjacent else bd.dim
            return BatchDim(before + (len(b_shape) if not adjacent else 0))
        return BatchDim(bd.dim - len(adv) + len(b_shape))
    positions = set()
    for d in adv:
        idx = items[d]
        info = tracker.info(idx)
        if isinstance(info, BatchDim) and d == bd.dim:
            return Lost("the batch dimension indexed by a batched index (may reorder samples)")
        if isinstance(info, BatchDim):
            positions.add(len(b_shape) - idx.dim() + info.dim)
        elif info is not None:
            return Lost(info.reason)
        elif d == bd.dim:
            varying = [e for e, size in enumerate(idx.shape) if size != 1]
            if len(varying) != 1 or idx.shape[varying[0]] != n:
                return Lost("advanced indexing selects samples")
            ar = torch.arange(n, device=idx.device).view(idx.shape)
            if not torch.equal(idx, ar):
                return Lost("advanced indexing reorders samples")
            positions.add(len(b_shape) - idx.dim() + varying[0])
    if len(positions) != 1:
        return Lost("advanced indexing")
    return BatchDim(front + positions.pop())


def picks_of(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], size: int, length: int, k: int
) -> Any:
    """Which positions along the batch's dimension (of ``size``) output ``k`` of ``select``,
    ``narrow``, ``split``, ``split_with_sizes``, ``chunk``, ``unbind``, ``tensor_split``,
    ``vsplit``/``hsplit``/``dsplit`` takes (``length`` of them: its size along it), as a
    ``range``; the call itself where leanprop does not compute them."""
    try:
        if name in ("select", "narrow"):  # (x, dim, index), (x, dim, start, length)
            start = int(dims_arg(args, kwargs, 2, "index", "start"))
            start = start + size if start < 0 else start
            return range(start, start + length)
        if name == "unbind":
            return range(k, k + 1)
        if name == "chunk":
            step = -(-size // int(dims_arg(args, kwargs, 1, "chunks")))
            return range(k * step, k * step + length)
        if name in ("split", "split_with_sizes"):
            sizes = dims_arg(args, kwargs, 1, "split_size_or_sections", "split_size", "split_sizes")
            if isinstance(sizes, int):
                return range(k * sizes, k * sizes + length)
            start = sum(int(v) for v in sizes[:k])
            return range(start, start + length)
        if name in ("tensor_split", "vsplit", "hsplit", "dsplit"):
            # (x, sections or indices, dim): sections of sizes differing by one, larger first;
            # or the parts between the indices, as slices take them
            cut = dims_arg(args, kwargs, 1, "sections", "indices", "tensor_indices_or_sections")
            cut = cut.tolist() if isinstance(cut, Tensor) else cut
            if isinstance(cut, int):
                small, extra = divmod(size, cut)
                start = k * small + min(k, extra)
            else:
                start = 0 if k == 0 else range(size)[: int(cut[k - 1])].stop
            return range(start, start + length)
    except (TypeError, ValueError, IndexError):
        pass
    return (name, k, repr(args[1:]), repr(sorted(kwargs.items())))


def rows_at(index: Any, ids: Tensor) -> bool:
    """Whether ``index`` picks the rows at integer ``ids`` alone (``t[ids]``, ``t[ids, :]``,
    ``t[ids, ...]``), as ``ids.shape + t.shape[1:]``."""
    if ids.is_floating_point() or ids.dtype in (torch.bool, torch.uint8):
        return False
    if isinstance(index, tuple) and index and index[0] is ids:
        return all(
            it is Ellipsis or (isinstance(it, slice) and it == slice(None)) for it in index[1:]
        )
    return index is ids


def picks_by_index(name: str, index: Any, x: Tensor, bd: BatchDim, tracker: BatchTracker) -> Info:
    """Where the batch of a vector ``x`` (``[N]``, one value per sample: per-sample losses)
    lands in ``x.gather(0, index)``, ``x.take(index)``, ``x.masked_select(mask)`` (and of a
    table's rows in ``F.embedding(index, x)``): the samples
    at a batch-free 1-D ``index`` (or where ``mask`` is True) as a :class:`Selected`, so that
    two different picks meeting (a pair's halves) are told; the batch itself where that is
    every sample in order. One host synchronisation."""
    size = x.shape[0]
    if not isinstance(index, Tensor) or index.dim() != 1 or tracker.info(index) is not None:
        return Lost(f"{name} along the batch dimension (or with a batched index)")
    if index.dtype == torch.bool:
        if index.shape[0] != size:
            return Lost(f"{name} with a mask not of the samples")
        index = index.nonzero()[:, 0]
    elif index.is_floating_point():
        return Lost(f"{name} along the batch dimension")
    picks = as_picks([j % size for j in index.tolist()]) if size else range(0)
    if picks == range(size):
        return bd
    return Selected(f"{name} along the batch dimension selects samples", picks,
                    0 if bd.inner == 1 else None)  # fmt: skip
