"""Samples spread over a tensor's positions other than as one batch dimension: picks of them
(:class:`Selected`) and samples over several dimensions (:class:`Grouped`).

Ops that only move values (indexing, transposes, flips, views, concatenation) are replayed on
a small integer tensor holding each position's sample (:func:`ids_of`): what it holds after
the op says exactly which sample each position of the output holds (:func:`read`), so that a
pick of a pick, a reordered pick, and parts put back together say which samples they hold.
Any other op on samples spread over several dimensions is followed dimension by dimension
(:func:`grouped_result`): each taken for the batch, so that a reduction over one of them, or a
softmax along one, is told as summing or mixing the samples there."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .infos import (
    MAX_GROUPED,
    REORDERED,
    BatchDim,
    Combined,
    Grouped,
    Info,
    Lost,
    Reordered,
    Selected,
    as_picks,
    dims_arg,
    norm_dim,
)
from .mixing import SIDE_BY_SIDE, holds_samples
from .rules import VIEWS, reshaped, result_dim
from .unknown import STRIDED_VIEWS

if TYPE_CHECKING:
    from .tracker import BatchTracker

# ops that only move (or repeat) values: replayed on the samples' ids
MOVES = frozenset({
    "getitem", "select", "narrow", "split", "split_with_sizes", "chunk", "unbind",
    "tensor_split", "vsplit", "hsplit", "dsplit", "index_select", "transpose", "swapaxes",
    "swapdims", "permute", "movedim", "moveaxis", "t", "T", "mT", "flip", "fliplr", "flipud",
    "roll", "rot90", "unsqueeze", "squeeze", "expand", "expand_as", "repeat", "tile",
    "contiguous", "clone", "diagonal", *VIEWS,
})  # fmt: skip
_PROPERTIES = frozenset({"T", "mT"})
_ALONG_ONE = frozenset({"cat", "concat", "concatenate", "stack"})

_MAX_IDS = 1 << 16  # (an op's output with more positions: not replayed)
SPREAD = "samples spread over several dimensions"
# (held samples that no longer say where they are: meeting others is told as mixing)
SPREAD_LOST = (
    "an op leanprop does not follow on samples spread over several dimensions (may reorder samples)"
)


def ids_of(x: Tensor, info: Info, keep: Sequence[int] | None = None) -> Tensor | None:
    """Which sample each position of ``x`` holds (an integer tensor of ``x``'s shape, a view
    of a small one), for a batch at :class:`BatchDim`, a :class:`Selected` pick in a
    dimension or of one sample, or :class:`Grouped` samples; None for any other, or too many
    positions. With ``keep``: of size 1 along the other dimensions than those and the
    samples' (for ops that act along those alone: a concatenation)."""
    if isinstance(info, BatchDim):
        n = x.shape[info.dim] // max(info.inner, 1)
        table, dims = torch.arange(n).repeat_interleave(info.inner), (info.dim,)
    elif type(info) is Selected and isinstance(info.picks, range) and len(info.picks) == 1:
        table, dims = torch.tensor(info.picks[0]), ()
    elif type(info) is Selected and info.dim is not None and isinstance(info.picks, range | tuple):
        table, dims = torch.tensor(list(info.picks), dtype=torch.long), (info.dim,)
    elif type(info) is Grouped:
        table, dims = torch.tensor(info.ids, dtype=torch.long).view(info.sizes), info.dims
    else:
        return None
    if any(d >= x.dim() for d in dims) or tuple(x.shape[d] for d in dims) != table.shape:
        return None
    kept = range(x.dim()) if keep is None else {*keep, *dims}
    size = [x.shape[e] if e in kept else 1 for e in range(x.dim())]
    if math.prod(size) > _MAX_IDS:
        return None
    order = sorted(range(len(dims)), key=lambda a: dims[a])  # (table axes as x's dims go)
    shape = [1] * x.dim()
    for a in order:
        shape[dims[a]] = table.shape[a]
    return table.permute(order).reshape(shape).expand(size).to(x.device)


def ids_for(name: str, x: Tensor, info: Info) -> Tensor | None:
    """The ids :func:`replay` runs the moving op ``name`` on: of ``x``'s shape, or of size 1
    along the dimensions that hold no samples where ``x`` is large (not for a view, which
    reads every dimension's size); None for any other op."""
    if name not in MOVES:
        return None
    ids = ids_of(x, info)
    return ids if ids is not None or name in VIEWS else ids_of(x, info, keep=())


def replay(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, ids: Tensor,
    out: Tensor, k: int,
) -> Tensor | None:  # fmt: skip
    """Output ``k`` (``out``) of the moving op ``name`` run on ``ids`` (from :func:`ids_for`,
    which gives them for moving ops only) in place of its operand ``which`` (the first); None
    where it cannot be (another operand, arguments it does not take as they are)."""
    if which != 0:
        return None
    try:
        if name == "getitem":
            moved = ids[args[1]]
        elif name in _PROPERTIES:
            moved = getattr(ids, name)
        else:
            moved = getattr(ids, name)(*args[1:], **kwargs)
    except (TypeError, ValueError, IndexError, RuntimeError):
        return None
    if isinstance(moved, list | tuple):  # (split, unbind: one output each)
        moved = moved[k] if k < len(moved) else None
    if not isinstance(moved, Tensor) or moved.dim() != out.dim():
        return None
    if any(m not in (s, 1) for m, s in zip(moved.shape, out.shape, strict=True)):
        return None  # (1: a dimension the ids hold no samples along, kept at size 1)
    return moved


def joined(
    name: str, args: Sequence[Any], kwargs: dict[str, Any],
    batched: list[tuple[int | str, Tensor, Info]],
) -> Tensor | None:  # fmt: skip
    """``cat``, ``stack`` and the like replayed on their operands' ids, where every operand is
    a batched one whose samples' positions are known (``batched``); else None."""
    parts = args[0] if args and isinstance(args[0], list | tuple) else None
    if name not in SIDE_BY_SIDE or not parts or len(batched) != len(parts):
        return None
    keep = None  # (cat and stack act along one dimension: the others' size needs no ids)
    if name in _ALONG_ONE:
        d = norm_dim(int(dims_arg(args, kwargs, 1, "dim", "axis") or 0), parts[0].dim())
        held_at = [_sample_dims(info) for _, _, info in batched]
        keep = [*([d] if name != "stack" else []), *(e for dims in held_at for e in dims)]
    ids = []
    for (_, t, info), p in zip(batched, parts, strict=True):
        held = ids_of(t, info, keep) if t is p else None
        if held is None:
            return None
        ids.append(held)
    try:
        return getattr(torch, name)(ids, *args[1:], **kwargs)
    except (TypeError, ValueError, IndexError, RuntimeError):
        return None


def _merged_back(name: str, x: Tensor, info: Grouped, out: Tensor, n: int) -> Info | None:
    """Where a view of ``x`` puts samples in groups over consecutive dimensions, row-major
    (as a reshape split them: ``info``), taken as the batch they make flattened (for
    tensors too large to replay it on their ids); None for any other."""
    first, count = info.dims[0], len(info.dims)
    inner = len(info.ids) // n if n else 0
    if name not in VIEWS or not inner or info.dims != tuple(range(first, first + count)):
        return None
    if list(info.ids) != [p // inner for p in range(len(info.ids))]:
        return None
    merged = [*x.shape[:first], len(info.ids), *x.shape[first + count :]]
    return reshaped(merged, BatchDim(first, inner), n, out.shape)


def _sample_dims(info: Info) -> tuple[int, ...]:
    """The dimensions that hold the samples (as :func:`ids_of` lays them out)."""
    if isinstance(info, BatchDim):
        return (info.dim,)
    if type(info) is Selected and info.dim is not None:
        return (info.dim,)
    return info.dims if type(info) is Grouped else ()


def read(ids: Tensor, reason: str, n: int) -> Info:
    """Where the samples are, from which one each position holds (``ids``; ``n`` samples in
    the batch): the batch where one dimension holds all of them in order (each ``inner``
    times), :class:`Reordered` where in another order, :class:`Selected` where some of them;
    :class:`Grouped` over several dimensions."""
    if ids.numel() == 0:  # (no positions: no sample in them)
        return Lost(reason)
    varying = []
    for e in range(ids.dim()):
        if ids.shape[e] > 1 and not bool((ids == ids.narrow(e, 0, 1)).all()):
            varying.append(e)
    index = tuple(slice(None) if e in varying else 0 for e in range(ids.dim()))
    table = ids[index] if ids.dim() else ids
    if len(varying) > 1:
        if table.numel() > MAX_GROUPED:
            return Lost(SPREAD_LOST)
        sizes = tuple(table.shape)
        return Grouped(SPREAD, tuple(varying), sizes, tuple(table.reshape(-1).tolist()))
    picks = table.reshape(-1).tolist()
    if not varying:
        return Selected(reason, as_picks(picks[:1]))
    e, size = varying[0], len(picks)
    inner = size // n if n and size % n == 0 else 0
    if inner and picks == [p // inner for p in range(size)]:
        return BatchDim(e, inner)
    if inner == 1 and sorted(picks) == list(range(n)):
        return Reordered(REORDERED, e, tuple(picks))
    return Selected(reason, as_picks(picks), e)


def grouped_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    info: Grouped, out: Tensor, k: int, tracker: BatchTracker,
) -> tuple[Info, list[tuple[BatchDim, Info]]]:  # fmt: skip
    """Where the samples of input ``x``, spread over several dimensions (``info``), land in
    output ``k``, ``out``; and what became of each of those dimensions, each followed as if
    it held the samples (for the mixing rules: a reduction over one sums within the groups,
    a softmax along one mixes them). A moving op is replayed on the samples' ids."""
    moved = replayed(name, args, kwargs, which, x, info, out, k, info.reason, tracker.n or 0)
    if moved is not None:
        return moved, []
    each = []
    for d, size in zip(info.dims, info.sizes, strict=True):
        bd = BatchDim(d)
        each.append((bd, result_dim(name, args, kwargs, which, x, bd, out, k, size, tracker)))
    results = [r for _, r in each]
    if all(type(r) is BatchDim for r in results):
        dims = tuple(r.dim for r in results)
        kept = all(out.shape[e] == s for e, s in zip(dims, info.sizes, strict=True))
        if len(set(dims)) == len(dims) and kept:
            return Grouped(info.reason, dims, info.sizes, info.ids), each
    summed = [r for r in results if type(r) is Combined]
    if summed:  # (within the groups, or over all of them; by a sum, or choosing: amax)
        reason = f"'{name}' over {info.reason} ({summed[0].reason})"
        return Combined(reason, any(r.summed for r in summed), any(r.of_pick for r in summed)), each
    merged = _merged_back(name, x, info, out, tracker.n or 0)
    return (merged or Lost(SPREAD_LOST)), each


def selected_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    info: Selected, out: Tensor, k: int, tracker: BatchTracker,
) -> tuple[Info, Info | None]:  # fmt: skip
    """Where the picked samples of input ``x`` (``info``: which ones, in dimension
    ``info.dim``) land in output ``k``, ``out``: a moving op replayed on their ids (a pick of
    the pick, a reordering of it, a view); any other op followed as on a batch of them. Also
    what that op does to such a batch (for the mixing rules; None for a moving op). A pick
    whose dimension an op loses stays the pick it is, in no dimension."""
    picks = info.picks
    if info.dim >= x.dim() or x.shape[info.dim] != len(picks):
        return Selected(info.reason, picks), None  # (not its size there: cat([o[:2], zeros]))
    moved = replayed(name, args, kwargs, which, x, info, out, k, info.reason, tracker.n or 0)
    if moved is not None:
        return moved, None
    bd, size = BatchDim(info.dim), x.shape[info.dim]
    r = result_dim(name, args, kwargs, which, x, bd, out, k, size, tracker)
    if type(r) is BatchDim:
        return Selected(info.reason, picks, r.dim if r.inner == 1 else None), r
    if type(r) is Selected:  # (positions among the picked: x[:2].gather(0, ...))
        within = r.picks if isinstance(r.picks, range | tuple) else None
        if within is None:
            return Selected(r.reason, ("of", picks, r.picks)), r
        return Selected(r.reason, as_picks([picks[j] for j in within]), r.dim), r
    if type(r) is Combined:  # (a sum over some samples: x[:2].sum(0), a part's loss)
        return Combined(r.reason, r.summed, of_pick=True), r
    if holds_samples(r):  # (moved so that meeting others says they mix: kron(s, s))
        return r, r
    return Selected(info.reason, picks), r


Layout = tuple[tuple[int, ...], tuple[int, ...], int]  # (size, stride, storage offset)


def strided_layout(args: Sequence[Any], kwargs: dict[str, Any], x: Tensor) -> Layout:
    """The layout ``as_strided(x, size, stride, storage_offset=None)`` reads ``x``'s storage
    by (the offset: ``x``'s own by default), from its arguments (``as_strided_copy``'s output
    is a fresh tensor: its own layout says nothing)."""
    offset = dims_arg(args, kwargs, 3, "storage_offset")
    size, stride = dims_arg(args, kwargs, 1, "size"), dims_arg(args, kwargs, 2, "stride")
    offset = x.storage_offset() if offset is None else int(offset)
    return tuple(int(s) for s in size), tuple(int(s) for s in stride), offset


def _span(layout: Layout) -> tuple[int, int]:
    """The first storage element a layout reaches and one past its last (``(0, 0)``: none)."""
    size, stride, offset = layout
    if 0 in size:
        return 0, 0
    return offset, offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1


def strided_replay(ids: Tensor, x: Tensor, layout: Layout) -> Tensor | None:
    """``x.as_strided(*layout)`` replayed on the samples' ids (``ids``, of ``x``'s shape):
    the ids written where ``x``'s elements lie in a storage of their own, read back through
    the layout. None where it reads storage ``x`` does not hold (another tensor's elements: a
    view's base), ``x``'s elements share storage, or the span is too long to replay."""
    own: Layout = (tuple(x.shape), tuple(x.stride()), x.storage_offset())
    if any(s < 0 for s in (*own[1], *layout[1])) or len(layout[0]) != len(layout[1]):
        return None
    spans = [_span(own), _span(layout)]
    start = min(first for first, end in spans if end > first) if x.numel() else 0
    end = max(end for _, end in spans)
    if end - start > _MAX_IDS:
        return None
    store = torch.full((max(end - start, 0),), -1, dtype=ids.dtype, device=ids.device)
    laid = store.as_strided(own[0], own[1], max(own[2] - start, 0))
    try:
        laid.copy_(ids)
    except RuntimeError:  # (elements that share storage: written to by several)
        return None
    if not bool((laid == ids).all()):
        return None
    size, stride, offset = layout
    if offset < start:
        return None
    moved = store.as_strided(size, stride, offset - start)
    return None if bool((moved < 0).any()) else moved


def replayed(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    info: Info, out: Tensor, k: int, reason: str, n: int,
) -> Info | None:  # fmt: skip
    """Where a moving op puts the samples of ``x`` (``info``) in output ``k``, ``out``, from
    its replay on their ids (``reason``: why they are no batch there, if they are not; ``n``
    samples in the batch): a pick of a pick, a reordered pick, a moving op that loses the
    batch (``o.repeat(2, 1)``, a squeeze of a batch of one); None where the op does not only
    move values, or cannot be replayed (or its arguments cannot be read so)."""
    try:
        if name in STRIDED_VIEWS:  # (not in place: x is already the view then)
            ids = ids_of(x, info) if which == 0 and out is not x else None
            layout = strided_layout(args, kwargs, x) if ids is not None else None
            moved = strided_replay(ids, x, layout) if ids is not None else None
        else:
            ids = ids_for(name, x, info)
            moved = replay(name, args, kwargs, which, ids, out, k) if ids is not None else None
        return read(moved, reason, n) if moved is not None else None
    except (IndexError, TypeError, ValueError, KeyError, RuntimeError):
        return None


MOVED = "samples moved along the batch dimension (repeated, picked or reordered)"
