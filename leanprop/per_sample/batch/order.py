"""Samples held in another order (an ``index_select`` by a permutation, a packed sequence
sorted by length): which ops restore the order, pack the samples or pick some of them, and
which index arguments an op reads by value (their own batch does not reach the output)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .infos import (
    PACKED,
    REORDERED,
    BatchDim,
    Combined,
    Grouped,
    Info,
    Lost,
    Packed,
    Reordered,
    Selected,
    as_picks,
    dims_arg,
    in_order,
    norm_dim,
)
from .rules import RNN_OPS, VIEWS, is_packed_rnn_op, reshaped, result_dim

if TYPE_CHECKING:
    from .tracker import BatchTracker


def _permutation(index: Any, n: int) -> tuple[int, ...] | None:
    """``index`` as a permutation of ``range(n)``; None if it is not one."""
    if not isinstance(index, Tensor) or index.dim() != 1 or index.numel() != n:
        return None
    order = tuple(index.tolist())
    return order if sorted(order) == list(range(n)) else None


def ordered_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    info: Reordered | Packed, out: Tensor, k: int, n: int, tracker: BatchTracker,
) -> Info:  # fmt: skip
    """Where samples held in another order (:class:`Reordered`, :class:`Packed`) land. Each
    input's result is merged with the others' (:func:`merge_infos`): inputs in different orders
    give a plain :class:`Lost`."""
    if is_packed_rnn_op(name, args):  # (data, sizes, hx, ...) -> (data, h_n[, c_n])
        if which != 0 and not (isinstance(info, Reordered) and info.dim == 1):
            return Lost(f"{name} with its hidden state's batch elsewhere than documented")
        return Packed(PACKED, info.order) if k == 0 else in_order(1, info.order)
    if isinstance(info, Packed):
        if name == "_pad_packed_sequence" and which == 0:  # (data, sizes, batch_first, ...)
            # -> (padded [N, T, ...] or [T, N, ...], lengths [N]), both sorted as the data
            return in_order(0 if k == 1 or args[2] else 1, info.order)
        rows = result_dim(name, args, kwargs, which, x, BatchDim(0), out, k, n, tracker)
        if rows == BatchDim(0):  # rows kept (elementwise, or along the features)
            return info
        return Lost(rows.reason if isinstance(rows, Lost) else PACKED)
    index = _reorder_index(name, args, kwargs, which, x, info.dim)
    if index is None and name in ("flip", "roll") and which == 0:
        index = _moved(name, args, kwargs, x, info.dim)
    if index is not None:  # x.index_select(batch dim, index), x[index], x.flip(batch dim)
        size = x.shape[info.dim]
        perm = _permutation(index, size)
        if perm is None:  # (some samples: which ones, so that pairs of picks are told)
            picks = as_picks([info.order[j % size] for j in index.tolist()])
            return Selected(f"{name} along the batch dimension selects samples", picks, info.dim)
        return in_order(info.dim, tuple(info.order[j] for j in perm))
    if name == "_pack_padded_sequence" and which == 0:  # (input, lengths, batch_first)
        if info.dim != (0 if args[2] else 1):
            return Lost("pack_padded_sequence with its batch elsewhere than batch_first says")
        return Packed(PACKED, info.order) if k == 0 else Lost("batch sizes of a packed sequence")
    res = result_dim(name, args, kwargs, which, x, BatchDim(info.dim), out, k, n, tracker)
    if isinstance(res, BatchDim):
        if info.order == tuple(range(len(info.order))):  # (in their order: as they are)
            return res
        if res.inner != 1:
            return Lost(f"{REORDERED}, flattened with another dimension")
        return in_order(res.dim, info.order)
    return res


def _reorder_index(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor, dim: int
) -> Tensor | None:
    """The index of ``x.index_select(dim, index)`` or ``x[index]`` (a 1-D integer tensor, or
    a list of integers, along the batch dimension ``dim``), where ``x`` is input ``which``;
    else None."""
    if which != 0:
        return None
    if name == "index_select":
        d, index = dims_arg(args, kwargs, 1, "dim"), dims_arg(args, kwargs, 2, "index")
        return index if norm_dim(int(d), x.dim()) == dim else None
    if name == "getitem" and dim == 0 and len(args) > 1:
        index = args[1]
        if isinstance(index, list) and index and all(type(j) is int for j in index):
            index = torch.tensor(index)  # (x[[0, 1]]: as the tensor of them)
        if not isinstance(index, Tensor):
            return None
        if index.dim() == 1 and not index.is_floating_point() and index.dtype != torch.bool:
            return index
    return None


def _index_arg(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], batched: list[tuple[Any, Tensor, Info]]
) -> int | str | None:
    """Position of an index argument read by value (a permutation, lengths, batch sizes: often
    computed from batched lengths) where the op reorders or packs the samples of ``args[0]``;
    None if there is none."""
    first = next(((t, info) for w, t, info in batched if w == 0), None)
    if first is None:  # rows of a batch-free tensor at indices computed from the samples
        return _index_of_batch_free(name, args, kwargs, batched)
    x, info = first
    if name in ("index_select", "getitem"):
        dim = info.dim if isinstance(info, BatchDim | Reordered) else None
        if dim is None or (isinstance(info, BatchDim) and info.inner != 1):
            return None
        if _reorder_index(name, args, kwargs, 0, x, dim) is None:
            return None
        return 1 if name == "getitem" else 2 if len(args) > 2 else "index"
    if name in ("_pack_padded_sequence", "_pad_packed_sequence") or is_packed_rnn_op(name, args):
        return 1
    return None


def _index_of_batch_free(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], batched: list[tuple[Any, Tensor, Info]]
) -> int | str | None:
    """``x.index_select(d, index)`` / ``x[index]`` of a constant batch-free ``x`` (e.g. an
    RNN's zero initial state put in a packed sequence's order) at an integer ``index`` whose
    samples are mixed or reordered (a :class:`Lost`, e.g. sorted lengths): the index is read
    by value and no gradient flows, so the result is batch-free like ``x``. Returns the index's
    position; None for other calls (indices that hold the batch in a dimension give a result
    with the batch there; rows of a tensor that requires grad stay :class:`Lost`)."""
    if name == "index_select":
        at: int | str = 2 if len(args) > 2 else "index"
    elif name == "getitem":
        at = 1
    else:
        return None
    info = next((info for w, _, info in batched if w == at), None)
    index = args[at] if isinstance(at, int) else kwargs.get(at)
    if not isinstance(info, Lost) or len(batched) != 1 or args[0].requires_grad:
        return None  # (rows of parameters would need their per-sample parts: not followed)
    if not isinstance(index, Tensor) or index.is_floating_point():
        return None
    return at


ORDER_OPS = {"index_select", "getitem", "_pack_padded_sequence", "flip", "roll"}


# ops with an index argument _index_arg may find (with the packed RNN ops)
_READS_INDEX = frozenset(
    {"index_select", "getitem", "_pack_padded_sequence", "_pad_packed_sequence"}
)


def by_value(
    name: str, args: Sequence[Any], kwargs: dict[str, Any],
    batched: list[tuple[int | str, Tensor, Info]],
) -> list[tuple[int | str, Tensor, Info]]:  # fmt: skip
    """``batched`` without an index argument the op reads by value (see ``_index_arg``), nor
    the tensor ``x.type_as(other)`` and ``x.to(other)`` take their dtype and device from: its
    own batch does not reach the outputs."""
    if name in ("type_as", "to"):
        return [b for b in batched if b[0] == 0]
    if name not in _READS_INDEX and name not in RNN_OPS:  # (the ops _index_arg knows)
        return batched
    try:
        index = _index_arg(name, args, kwargs, batched)
    except (IndexError, TypeError, ValueError, KeyError):
        index = None
    return batched if index is None else [b for b in batched if b[0] != index]


def selected_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    info: Selected, out: Tensor, k: int, tracker: BatchTracker,
) -> Info:  # fmt: skip
    """Where the picked samples of input ``x`` (``info``: which ones, in which dimension) land
    in output ``k``, ``out``: followed as a batch of them, so that a pick of the pick says
    which samples it holds (``o[:4][:2]`` picks what ``o[:2]`` does) and a reordering of them
    reorders the picks (``o[:2].flip(0)`` holds samples 1 and 0). As they are where no
    dimension holds them (``info.dim`` None), or concatenated along it (what the others
    concatenated say: :func:`rejoined`)."""
    picks = info.picks
    if info.dim is None or not isinstance(picks, range | tuple) or info.dim >= x.dim():
        return info
    size = x.shape[info.dim]
    if size != len(picks):
        return info
    index = _reorder_index(name, args, kwargs, which, x, info.dim)
    if index is None and name in ("flip", "roll") and which == 0:
        index = _moved(name, args, kwargs, x, info.dim)
    if index is not None:  # (some of them, or all in another order)
        return Selected(info.reason, as_picks([picks[j % size] for j in index.tolist()]), info.dim)
    if name in CONCATENATIONS and concatenated_along(args, kwargs) == info.dim:
        return info
    r = result_dim(name, args, kwargs, which, x, BatchDim(info.dim), out, k, size, tracker)
    if type(r) is BatchDim:
        return Selected(info.reason, picks, r.dim if r.inner == 1 else None)
    if type(r) is Selected:  # (a pick of the pick: positions among the picked)
        within = r.picks if isinstance(r.picks, range | tuple) else None
        if within is None:
            return Selected(r.reason, ("of", picks, r.picks), None)
        return Selected(r.reason, as_picks([picks[j] for j in within]), r.dim)
    if type(r) is Combined:  # (a sum over some samples: x[:2].sum(0), a part's loss)
        return Combined(r.reason, r.summed, of_pick=True)
    return r


def _moved(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], x: Tensor, dim: int
) -> Tensor | None:
    """Which position of ``x`` each position along ``dim`` of ``x.flip(dim)`` or
    ``x.roll(shifts, dim)`` holds (flipped or rolled along ``dim`` alone); else None."""
    size = x.shape[dim]
    d = dims_arg(args, kwargs, 1 if name == "flip" else 2, "dims")
    dims = [] if d is None else [d] if isinstance(d, int) else list(d)
    if len(dims) != 1 or norm_dim(int(dims[0]), x.dim()) != dim:
        return None
    if name == "flip":
        return torch.arange(size - 1, -1, -1)
    shifts = dims_arg(args, kwargs, 1, "shifts")
    shift = shifts[0] if isinstance(shifts, list | tuple) and len(shifts) == 1 else shifts
    if not isinstance(shift, int):
        return None
    return (torch.arange(size) - shift) % size


def rejoined(
    name: str, args: Sequence[Any], kwargs: dict[str, Any],
    batched: list[tuple[int | str, Tensor, Info]], n: int,
) -> Info | None:  # fmt: skip
    """``cat([x[:2], x[2:]])``: picks of the samples concatenated along their dimension,
    every part one (``batched``: the op's batched operands), are the samples they hold, in
    order: the batch itself where they are all of it, in order (``n`` samples). None for any
    other call."""
    parts = args[0] if args and isinstance(args[0], list | tuple) else None
    if name not in CONCATENATIONS or not parts or len(batched) != len(parts):
        return None
    infos = [info for _, _, info in batched]
    first = infos[0]
    if not all(
        isinstance(i, Selected) and isinstance(i.picks, range | tuple) and i.dim is not None
        for i in infos
    ) or any(t is not p for (_, t, _), p in zip(batched, parts, strict=True)):
        return None
    d = concatenated_along(args, kwargs)
    if any(i.dim != d for i in infos):
        return None
    picks = [p for i in infos for p in i.picks]
    if picks == list(range(n)):
        return BatchDim(d)
    return Selected(first.reason, as_picks(picks), d)


CONCATENATIONS = frozenset({"cat", "concat", "concatenate"})


def concatenated_along(args: Sequence[Any], kwargs: dict[str, Any]) -> int | None:
    """The dimension ``cat(tensors, dim)`` concatenates along (as a dimension of the first of
    its tensors, counted from 0); None where leanprop cannot read it."""
    parts = args[0] if args and isinstance(args[0], list | tuple) else kwargs.get("tensors")
    if not parts or not isinstance(parts[0], Tensor):
        return None
    return norm_dim(int(dims_arg(args, kwargs, 1, "dim", "axis") or 0), parts[0].dim())


def grouped_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    info: Grouped, out: Tensor, k: int, tracker: BatchTracker,
) -> tuple[Info, list[tuple[BatchDim, Info]]]:  # fmt: skip
    """Where the samples of input ``x``, split over several dimensions (``info``), land in
    output ``k``, ``out``; and what became of each of those dimensions (each followed as if
    it held the samples: a reduction over one sums within the groups, a softmax along one
    mixes them), for the mixing rules. A reshape that puts them back together gives the
    batch again."""
    dims = range(info.first, info.first + info.count)
    sizes = [x.shape[d] for d in dims]
    n = math.prod(sizes) // info.inner
    if name in VIEWS:  # (as the batch they make, flattened)
        merged = [*x.shape[: info.first], n * info.inner, *x.shape[info.first + info.count :]]
        return reshaped(merged, BatchDim(info.first, info.inner), n, out.shape), []
    each = []
    for d, size in zip(dims, sizes, strict=True):
        last = d == dims[-1]
        bd = BatchDim(d, info.inner if last else 1)
        m = size // info.inner if last else size
        each.append((bd, result_dim(name, args, kwargs, which, x, bd, out, k, m, tracker)))
    results = [r for _, r in each]
    if all(type(r) is BatchDim for r in results):
        new = [r.dim for r in results]
        if new == list(range(new[0], new[0] + info.count)) and results[-1].inner == info.inner:
            return Grouped(info.reason, new[0], info.count, info.inner), each
        return Lost(info.reason), each
    summed = [r for r in results if type(r) is Combined]
    if summed:  # (within the groups, or over all of them)
        return Combined(f"'{name}' over samples in groups ({summed[0].reason})"), each
    return next((r for r in results if type(r) is Lost), Lost(info.reason)), each
