"""Samples held in another order (an ``index_select`` by a permutation, a packed sequence
sorted by length): which ops restore the order, pack the samples or pick some of them, and
which index arguments an op reads by value (their own batch does not reach the output)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .infos import (
    MAY_MIX,
    MAY_REORDER,
    PACKED,
    REORDERED,
    BatchDim,
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
from .rules import RNN_OPS, is_packed_rnn_op, reordered_dims, result_dim

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
            return Lost(f"{name} with its hidden state's batch elsewhere than documented {MAY_MIX}")
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
    if index is None and name in _REORDERS and which == 0:
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
    if type(res) is Selected:  # (positions along the reordered dimension: their samples)
        if not isinstance(res.picks, range | tuple):
            return Selected(res.reason, ("of", info.order, res.picks))
        return Selected(res.reason, as_picks([info.order[j] for j in res.picks]), res.dim)
    if isinstance(res, BatchDim):
        if info.order == tuple(range(len(info.order))):  # (in their order: as they are)
            return res
        if res.inner != 1:
            return Lost(f"{REORDERED}, flattened with another dimension {MAY_REORDER}")
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


_REORDERS = frozenset({"flip", "roll", "flipud", "fliplr"})
ORDER_OPS = frozenset({"index_select", "getitem", "_pack_padded_sequence", *_REORDERS})


# ops with an index argument _index_arg may find (with the packed RNN ops)
_READS_INDEX = frozenset({*ORDER_OPS - _REORDERS, "_pad_packed_sequence"})


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


def _moved(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], x: Tensor, dim: int
) -> Tensor | None:
    """Which position of ``x`` each position along ``dim`` of ``x.flip(dim)`` (``flipud``,
    ``fliplr``) or ``x.roll(shifts, dim)`` holds (flipped or rolled along ``dim`` alone);
    else None."""
    size = x.shape[dim]
    dims = reordered_dims(name, args, kwargs)
    if len(dims) != 1 or norm_dim(int(dims[0]), x.dim()) != dim:
        return None
    if name != "roll":
        return torch.arange(size - 1, -1, -1)
    shifts = dims_arg(args, kwargs, 1, "shifts")
    shift = shifts[0] if isinstance(shifts, list | tuple) and len(shifts) == 1 else shifts
    if not isinstance(shift, int):
        return None
    return (torch.arange(size) - shift) % size


def reorders(name: str, args: Sequence[Any], kwargs: dict[str, Any], x: Tensor, dim: int) -> bool:
    """Whether an op may reorder or pick the samples of ``x`` along ``dim`` by an index
    (``index_select``, ``x[index]``), pack them, or flip or roll them along ``dim``: followed
    as samples in an order (:func:`ordered_result`)."""
    if name not in ORDER_OPS:
        return False
    if name not in _REORDERS:
        return True
    return [norm_dim(int(d), x.dim()) for d in reordered_dims(name, args, kwargs)] == [dim]
