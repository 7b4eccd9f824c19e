"""Which tensors carry the batch, and in which dimension.

The model's input tensors carry the batch at ``batch_dim``. Every op run inside the model's
forward is seen by the op interception (``fused.py``), which calls :meth:`BatchTracker.propagate`
to say where the batch went in the op's outputs. So a rule knows which dimension of its input is
the batch, and a dimension of the same size (sequence length T == batch size N) is never taken
for it. Tensors derived from parameters only (position embeddings looked up with
``arange(T)``) carry no batch: they are *parameter-derived* and ``broadcast.py`` takes their
per-sample contributions where they meet the batch.

A batch dimension may hold the samples as the outer factor of a flattened dimension:
``x.view(-1, D)`` of ``[N, T, D]`` gives ``[N*T, D]`` with ``BatchDim(0, inner=T)``.

Where the batch goes cannot be told (an op this module does not know changed the shape), or
samples were mixed (a reduction or a slice over the batch), the tensor is :class:`Lost`; a rule
that meets such a tensor raises an error instead of guessing.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from .._torch_compat import (
    current_graph_task_id,
    detaching_checkpoint_inputs,
    saved_tensor_hooks_in_effect,
)
from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class BatchDim:
    """The batch is dimension ``dim``, of size ``N * inner`` with the sample as outer factor."""

    dim: int
    inner: int = 1


@dataclass(frozen=True)
class Lost:
    """The tensor depends on the batch, but no single dimension holds the samples."""

    reason: str


@dataclass(frozen=True)
class Combined(Lost):
    """The samples were summed or averaged together (a reduction over the batch, a loss, a
    product contracting the batch), or one sample's value was chosen for each element
    (``x.amax(0)``; ``summed`` False): a batch-free value joined with this one afterwards
    reaches the loss in no sample's part."""

    summed: bool = True
    of_pick: bool = False  # (summed over some samples only: x[i].sum(), a part's loss)


@dataclass(frozen=True, eq=False)
class Selected(Lost):
    """Some of the samples, picked along the batch dimension (``o[:k]``, ``o.chunk(2)[1]``,
    ``o[labels == 1]``): ``picks`` says which (positions along it, a ``range`` where they are
    evenly spaced; equal for the same pick, however spelled), so that values of two different
    picks meeting later (a pair's halves, ``o[:k] - o[k:]``) are told as different samples
    meeting."""

    picks: Any = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selected) and self.picks == other.picks

    def __hash__(self) -> int:
        return hash((Selected, self.picks))


def _as_picks(positions: Sequence[int]) -> range | tuple[int, ...]:
    """``positions`` as a ``range`` where they are evenly spaced and increasing."""
    if len(positions) < 2:
        return range(positions[0], positions[0] + 1) if positions else range(0)
    step = positions[1] - positions[0]
    spaced = range(positions[0], positions[-1] + 1, step) if step > 0 else range(0)
    return spaced if list(spaced) == list(positions) else tuple(positions)


@dataclass(frozen=True)
class Reordered(Lost):
    """Dimension ``dim`` holds the samples in another order: position ``j`` holds sample
    ``order[j]`` (a packed sequence sorts its samples by length). A :class:`Lost` to every
    consumer but the ops that restore the order or pack the samples."""

    dim: int
    order: tuple[int, ...]


@dataclass(frozen=True)
class Packed(Lost):
    """The data of a ``PackedSequence``: rows are time steps of samples, sorted by length as
    ``order`` says (its ``sorted_indices``). A :class:`Lost` to every consumer but the RNN
    that takes it, elementwise ops, and ``pad_packed_sequence``."""

    order: tuple[int, ...]


Info = BatchDim | Lost

_RNN_OPS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


def is_packed_rnn_op(name: str, args: Sequence[Any]) -> bool:
    """``lstm(data, batch_sizes, hx, ...)``: the PackedSequence variant of an RNN op."""
    return (
        name in _RNN_OPS
        and len(args) > 1
        and isinstance(args[1], Tensor)
        and not args[1].is_floating_point()  # batch sizes, not a GRU's hidden state
    )


def _permutation(index: Any, n: int) -> tuple[int, ...] | None:
    """``index`` as a permutation of ``range(n)``; None if it is not one."""
    if not isinstance(index, Tensor) or index.dim() != 1 or index.numel() != n:
        return None
    order = tuple(index.tolist())
    return order if sorted(order) == list(range(n)) else None


def _ordered_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    info: Reordered | Packed, out: Tensor, k: int, n: int, tracker: BatchTracker,
) -> Info:  # fmt: skip
    """Where samples held in another order (:class:`Reordered`, :class:`Packed`) land. Each
    input's result is merged with the others' (:func:`_merge`): inputs in different orders
    give a plain :class:`Lost`."""
    if is_packed_rnn_op(name, args):  # (data, sizes, hx, ...) -> (data, h_n[, c_n])
        if which != 0 and not (isinstance(info, Reordered) and info.dim == 1):
            return Lost(f"{name} with its hidden state's batch elsewhere than documented")
        return Packed(_PACKED, info.order) if k == 0 else _in_order(1, info.order)
    if isinstance(info, Packed):
        if name == "_pad_packed_sequence" and which == 0:  # (data, sizes, batch_first, ...)
            # -> (padded [N, T, ...] or [T, N, ...], lengths [N]), both sorted as the data
            return _in_order(0 if k == 1 or args[2] else 1, info.order)
        rows = result_dim(name, args, kwargs, which, x, BatchDim(0), out, k, n, tracker)
        if rows == BatchDim(0):  # rows kept (elementwise, or along the features)
            return info
        return Lost(rows.reason if isinstance(rows, Lost) else _PACKED)
    index = _reorder_index(name, args, kwargs, which, x, info.dim)
    if index is not None:  # x.index_select(batch dim, index), x[index]
        size = x.shape[info.dim]
        perm = _permutation(index, size)
        if perm is None:  # (some samples: which ones, so that pairs of picks are told)
            picks = _as_picks([info.order[j % size] for j in index.tolist()])
            return Selected(f"{name} along the batch dimension selects samples", picks)
        return _in_order(info.dim, tuple(info.order[j] for j in perm))
    if name == "_pack_padded_sequence" and which == 0:  # (input, lengths, batch_first)
        if info.dim != (0 if args[2] else 1):
            return Lost("pack_padded_sequence with its batch elsewhere than batch_first says")
        return Packed(_PACKED, info.order) if k == 0 else Lost("batch sizes of a packed sequence")
    res = result_dim(name, args, kwargs, which, x, BatchDim(info.dim), out, k, n, tracker)
    if isinstance(res, BatchDim):
        if info.order == tuple(range(len(info.order))):  # (in their order: as they are)
            return res
        if res.inner != 1:
            return Lost(f"{_REORDERED}, flattened with another dimension")
        return _in_order(res.dim, info.order)
    return res


def _reorder_index(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor, dim: int
) -> Tensor | None:
    """The index of ``x.index_select(dim, index)`` or ``x[index]`` (a 1-D integer tensor
    along the batch dimension ``dim``), where ``x`` is input ``which``; else None."""
    if which != 0:
        return None
    if name == "index_select":
        d, index = _dims_arg(args, kwargs, 1, "dim"), _dims_arg(args, kwargs, 2, "index")
        return index if _norm_dim(int(d), x.dim()) == dim else None
    if name == "getitem" and dim == 0 and len(args) > 1 and isinstance(args[1], Tensor):
        index = args[1]
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


_ORDER_OPS = {"index_select", "getitem", "_pack_padded_sequence"}
# ops with an index argument _index_arg may find (with the packed RNN ops)
_READS_INDEX = frozenset({*_ORDER_OPS, "_pad_packed_sequence"})
_REORDERED = "samples in another order (an index_select, or sorted by length for a packed sequence)"
_PACKED = (
    "the samples packed into a PackedSequence's data (run the RNN on it, or "
    "pad_packed_sequence it first)"
)


def packed_data(order: tuple[int, ...]) -> Packed:
    """Where the batch is in a PackedSequence's data whose ``sorted_indices`` are ``order``."""
    return Packed(_PACKED, order)


def _in_order(dim: int, order: tuple[int, ...]) -> Info:
    if order == tuple(range(len(order))):
        return BatchDim(dim)
    return Reordered(_REORDERED, dim, order)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property (x.mT, x.T): name of the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name == "rtruediv":  # (2 / x: not linear in x, as x / 2 is)
            return name
        if name[:1] in "ri" and name[1:] in _ARITH:  # __radd__, __iadd__
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]  # in-place variant
    return name


_ARITH = {"add", "sub", "mul", "truediv", "floordiv", "pow", "matmul", "and", "or", "xor", "mod"}
_VIEWS = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "_unsafe_view"}
_DIM_OPS = {  # same shape, acts along one dimension: mixes samples if that is the batch
    "softmax", "log_softmax", "_softmax", "cumsum", "cumprod", "logcumsumexp", "cummax",
    "cummin", "sort", "argsort", "normalize", "glu", "special_softmax", "special_log_softmax",
}  # fmt: skip
# the positions of the index ops' tensor arguments passed by keyword
_INDEX_KEYWORDS = {"source": 3, "src": 3, "index": 2}
# ops taking (x, ..., dim at position pos, ...): {name: (pos, default dim)}
_INDEX_OPS = {
    "index_select": (1, None), "gather": (1, None), "scatter": (1, None),
    "scatter_add": (1, None), "scatter_reduce": (1, None), "index_add": (1, None),
    "index_copy": (1, None), "index_fill": (1, None), "take_along_dim": (2, None),
    "topk": (2, -1), "kthvalue": (2, -1), "renorm": (2, None), "softmin": (1, None),
    "fft_fft": (2, -1), "fft_ifft": (2, -1), "fft_rfft": (2, -1), "fft_irfft": (2, -1),
}  # fmt: skip
_REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "prod", "std", "var", "norm", "logsumexp",
    "all", "any", "argmax", "argmin", "nansum", "nanmean", "median", "var_mean", "std_mean",
    "count_nonzero", "linalg_vector_norm", "linalg_norm", "special_logsumexp", "aminmax",
    "nanmedian", "mode",
}  # fmt: skip
_SELECTIONS = {
    "amax", "amin", "max", "min", "aminmax", "median", "nanmedian", "mode", "argmax", "argmin"
}  # fmt: skip
_BATCH_FIRST_OPS = {  # need the batch at dimension 0 (channels at 1); keep it there
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "group_norm", "batch_norm", "instance_norm", "max_pool1d", "max_pool2d", "max_pool3d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "interpolate", "upsample", "unfold", "pixel_shuffle", "pixel_unshuffle", "lp_pool2d",
    "max_pool2d_with_indices", "local_response_norm",
}  # fmt: skip
_LOSSES = {  # (each takes the samples first; with reduction="none" a value per sample)
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
    "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
    "hinge_embedding_loss", "cosine_embedding_loss", "margin_ranking_loss",
    "triplet_margin_loss", "triplet_margin_with_distance_loss", "multi_margin_loss",
    "multilabel_margin_loss",
}  # fmt: skip
_CLASS_LOSSES = {"cross_entropy", "nll_loss"}  # [N, C, ...] scores: the classes' dim goes
_SAMPLE_LOSSES = {  # one value per sample [N] (reduction="none")
    "cosine_embedding_loss", "margin_ranking_loss", "triplet_margin_loss",
    "triplet_margin_with_distance_loss", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
}  # fmt: skip
_NON_TENSOR = {"size", "dim", "numel", "item", "tolist", "len", "stride", "data_ptr"}
# new tensors whose values do not depend on the input's (only its shape, dtype or device)
_FACTORIES = {
    "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "empty_like", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    # sized by a 0-dim tensor read as an int (an RNN's initial state from its batch sizes)
    "zeros", "ones", "empty", "rand", "randn", "eye",
}  # fmt: skip


def _dims_arg(args: Sequence[Any], kwargs: dict[str, Any], pos: int, *names: str) -> Any:
    for k in names:
        if k in kwargs:
            return kwargs[k]
    return args[pos] if len(args) > pos else None


def _reshaped(in_shape: Sequence[int], bd: BatchDim, n: int, out_shape: Sequence[int]) -> Info:
    """Where the batch lands when ``in_shape`` is viewed as ``out_shape`` (row-major)."""
    prefix = math.prod(in_shape[: bd.dim])
    acc = 1
    for e, size in enumerate(out_shape):
        if acc == prefix and (size == 0 if n == 0 else size > 0 and size % n == 0):
            return BatchDim(e, size // n if n else 1)  # (no samples: an empty dimension)
        acc *= size
        if acc > prefix:
            break
    return Lost("a reshape split the batch dimension")


def _index_result(index: Any, ndim: int, bd: BatchDim, n: int, tracker: BatchTracker) -> Info:
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
                full = it.start in (None, 0) and it.stop is None and it.step in (None, 1)
                if not full:
                    picks = range(*it.indices(n * bd.inner))
                    return Selected("a slice over the batch dimension selects samples", picks)
                return BatchDim(out_dim, bd.inner)
            in_dim, out_dim = in_dim + 1, out_dim + 1
        else:  # an integer
            if in_dim == bd.dim:
                picks = range(n * bd.inner)[int(it) : int(it) + 1 or None]
                return Selected("an index into the batch dimension selects one sample", picks)
            in_dim += 1
    return BatchDim(out_dim + bd.dim - in_dim, bd.inner)


# the tensor arguments of the matrix products, by position
_MATMUL_ARGS = {
    "matmul": ("input", "other"), "mm": ("input", "mat2"), "bmm": ("input", "mat2"),
    "addmm": ("input", "mat1", "mat2"), "baddbmm": ("input", "batch1", "batch2"),
    "addbmm": ("input", "batch1", "batch2"),
}  # fmt: skip


def _matmul_positional(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str
) -> tuple[Sequence[Any], int | str]:
    """A matrix product's tensors passed by keyword, as positional ones (and ``which``, the
    operand asked about, as its position)."""
    names = _MATMUL_ARGS[name]
    full = list(args) + [kwargs.get(k) for k in names[len(args) :]]
    return full, names.index(which) if which in names else which


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
        picks = _as_picks(mask.reshape(n, -1).nonzero()[:, 0].tolist())  # (each row's sample)
        return Selected("boolean-mask indexing (not as many elements of every sample)", picks)
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


# functions of each matrix of their first argument [*, m, n]
_MATRIX_FUNCTIONS = frozenset({
    "det", "linalg_det", "logdet", "slogdet", "linalg_slogdet", "inverse", "linalg_inv",
    "linalg_solve", "linalg_svdvals", "linalg_svd", "svd", "linalg_cholesky", "cholesky",
    "linalg_qr", "linalg_eigh", "linalg_eigvalsh", "linalg_eig", "linalg_eigvals",
    "matrix_exp", "linalg_matrix_exp", "linalg_pinv", "linalg_matrix_power", "nuclear_norm",
    "linalg_cond", "linalg_inv_ex", "pinverse", "linalg_cholesky_ex", "linalg_lu_factor",
    "linalg_lu_factor_ex", "linalg_lu", "lu", "linalg_ldl_factor",
    "matrix_power", "linalg_matrix_rank", "linalg_solve_ex",
})  # fmt: skip


def _pairs(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, bd: BatchDim,
    nd: int, od: int,
) -> Info:  # fmt: skip
    """Distances between rows (``cdist(x1 [*, P, M], x2 [*, R, M]) -> [*, P, R]``, ``pdist``),
    covariances between rows (``cov``, ``corrcoef``), differences of neighbours (``diff``):
    where the batch of operand ``which`` goes, or why its samples are mixed."""
    if name == "diff":  # (x, n, dim)
        d = _dims_arg(args, kwargs, 2, "dim")
        if _norm_dim(-1 if d is None else int(d), nd) == bd.dim:
            return Lost("diff along the batch dimension mixes samples")
        return bd  # (prepend and append are laid out as the input)
    if name == "cdist" and bd.dim < nd - 2:
        return BatchDim(od - (nd - bd.dim), bd.inner)
    if name == "cdist" and bd.dim == nd - 2 and which in (0, 1):  # x1's rows, or x2's
        return BatchDim(od - 2 + which, bd.inner)
    return Lost(f"'{name}' over the batch dimension mixes samples")


def _rare_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, bd: BatchDim,
    nd: int, od: int,
) -> Info | None:  # fmt: skip
    """:func:`result_dim` for the ops of :data:`_RARE` (operand ``which``, its batch at ``bd``
    of its ``nd`` dimensions; the output has ``od``); None for ``linalg.norm`` of vectors (a
    reduction)."""
    if name in _MATRIX_FUNCTIONS:  # of each matrix [*, m, n] (a solve's A)
        if which != 0 and bd.dim >= nd - 2:  # (a solve's B, whose columns may be samples)
            return Lost(f"'{name}' with its argument {which} batched")
        if bd.dim >= nd - 2:
            return Lost(f"'{name}' of a matrix made of samples mixes samples")
        return BatchDim(bd.dim, bd.inner)
    # (A, ord="fro", dim=(-2, -1), keepdim=False); linalg.norm with two dims alike
    d = _dims_arg(args, kwargs, 2, "dim") if name in ("linalg_norm", "linalg_matrix_norm") else None
    if name == "linalg_matrix_norm" or (isinstance(d, list | tuple) and len(d) == 2):
        dims = [-2, -1] if d is None else [_norm_dim(int(k), nd) - nd for k in d]
        if bd.dim - nd not in dims:
            return BatchDim(bd.dim - sum(nd + k < bd.dim for k in dims if od < nd), bd.inner)
        if _dims_arg(args, kwargs, 1, "ord") in (None, "fro"):  # (a vector norm of the matrix)
            return Combined("a matrix norm over the batch dimension sums samples")
        return Lost(f"'{name}' of a matrix made of samples mixes samples")
    if name == "linalg_norm":
        return None
    if name in ("cosine_similarity", "pairwise_distance"):
        return _similarity(name, args, kwargs, bd, nd)
    if name in _FFTS:  # (x, s, dim, norm): over the last two dimensions, or all
        d = _dims_arg(args, kwargs, 2, "dim")
        dims = range(nd) if d is None and name.endswith("n") else [-2, -1] if d is None else d
        if bd.dim in [_norm_dim(int(k), nd) for k in dims]:
            return Lost(f"{name} over the batch dimension mixes samples")
        return bd
    return _pairs(name, args, kwargs, which, bd, nd, od)


def _similarity(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], bd: BatchDim, nd: int
) -> Info:
    """``cosine_similarity(x1, x2, dim=1)``, ``pairwise_distance(x1, x2, p, eps, keepdim)``
    (over the last dimension): where an operand's batch (at ``bd`` of its ``nd`` dimensions)
    lands, its operands broadcast from the right; mixing where they reduce over it."""
    full = max(t.dim() for t in args[:2] if isinstance(t, Tensor))
    pos = full - (nd - bd.dim)  # (the batch's place among the broadcast dimensions)
    if name == "cosine_similarity":
        d, keep = _dims_arg(args, kwargs, 2, "dim"), False
        d = 1 if d is None else d
    else:
        d, keep = -1, bool(_dims_arg(args, kwargs, 4, "keepdim"))
    dd = _norm_dim(int(d), full)
    if dd == pos:
        return Lost(f"'{name}' over the batch dimension mixes samples")
    return BatchDim(pos - (dd < pos and not keep), bd.inner)


_FFTS = frozenset({
    "fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2", "fft_fftn", "fft_ifftn", "fft_rfftn",
    "fft_irfftn", "fft_hfft2", "fft_ihfft2", "fft_hfftn", "fft_ihfftn",
})  # fmt: skip


# the ops :func:`_rare_result` reads (one test on the hot path for all of them)
_RARE = frozenset({
    *_MATRIX_FUNCTIONS, *_FFTS, "linalg_norm", "linalg_matrix_norm", "cdist", "pdist", "cov",
    "corrcoef", "diff", "cosine_similarity", "pairwise_distance",
})  # fmt: skip


def _einsum(args: Sequence[Any], which: int, bd: BatchDim) -> Info:
    """Where ``einsum``'s operand ``which`` (its batch at ``bd``) puts the samples: the output
    dimension of the batch's letter, or summed where the output lacks it (an ellipsis spelled
    out as letters of its own; an implicit output: the letters met once, in order)."""
    ins, _, out = args[0].replace(" ", "").partition("->")
    operands = args[1] if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:]
    terms = ins.split(",")
    if len(terms) != len(operands) or "." in ins.replace("...", ""):
        return Lost("einsum with an equation leanprop cannot read")
    if "->" not in args[0]:
        out = "..." * ("..." in ins) + "".join(
            sorted(c for c in set(ins) if c.isalpha() and ins.count(c) == 1)
        )
    spare = [chr(c) for c in range(0x100, 0x100 + 64)]  # (letters no equation uses)
    widths = [
        t.dim() - len(term.replace("...", "")) for t, term in zip(operands, terms, strict=True)
    ]
    wide = max(widths, default=0)
    dims = "".join(spare[:wide])  # (ellipses broadcast from the right)
    terms = [term.replace("...", dims[wide - w :]) for term, w in zip(terms, widths, strict=True)]
    out = out.replace("...", dims)
    letter = terms[which][bd.dim]
    if letter not in out:
        return Combined("einsum sums samples")
    return BatchDim(out.index(letter), bd.inner)


def _matmul(a: Tensor, b: Tensor, which: int, bd: BatchDim, out_ndim: int) -> Info:
    x = a if which == 0 else b
    if x.dim() == 1:  # (its one dimension is the batch's, contracted)
        return Combined("matrix product over the batch")
    last = x.dim() - 1
    contracted = last if which == 0 else last - 1
    if bd.dim == contracted:
        return Combined("a matrix product sums over the batch dimension")
    if which == 0 and b.dim() == 1:  # [..., K] @ [K] -> [...]: only the last dim goes
        return BatchDim(bd.dim, bd.inner)
    if which == 1 and a.dim() == 1:  # [K] @ [..., K, M] -> [..., M]
        return BatchDim(bd.dim if bd.dim < last - 1 else out_ndim - 1, bd.inner)
    if which == 1 and bd.dim == last:
        return BatchDim(out_ndim - 1, bd.inner)
    return BatchDim(out_ndim - (x.dim() - bd.dim), bd.inner)


# elementwise ops with a second derivative (the Hessian's residual terms), by op name
CURVED_ELEMENTWISE = frozenset({
    "tanh", "sigmoid", "exp", "gelu", "silu", "softplus", "elu", "selu", "celu",
    "log_sigmoid", "mish", "sin", "cos", "log", "sqrt", "pow", "square", "hardswish", "expit",
    "special_expit",
})  # fmt: skip


# ops that act on each element alone (or broadcast), by name: no branch of result_dim takes
# them, so they go to _elementwise first (most ops of a forward are such; the test
# test_elementwise_names_are_taken_by_no_branch keeps this true)
_ELEMENTWISE = frozenset({
    "relu", "gelu", "silu", "tanh", "sigmoid", "dropout", "add", "sub", "rsub", "mul",
    "truediv", "rtruediv", "div", "neg", "exp", "log", "sqrt", "rsqrt", "pow", "square", "abs",
    "clamp", "clip", "where", "masked_fill", "contiguous", "to", "float", "half", "bfloat16",
    "double", "type_as", "erf", "softplus", "elu", "leaky_relu", "hardtanh", "relu6", "hardswish",
    "mish", "log_sigmoid", "cos", "sin", "minimum", "maximum", "clone", "sign", "reciprocal",
})  # fmt: skip


def _adds(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """``index_add``, ``scatter_add``, ``scatter_reduce`` by sum or mean: the source's values
    added up into the places the index names."""
    if name == "scatter_reduce":
        return _dims_arg(args, kwargs, 4, "reduce") in ("sum", "mean")
    return name in ("index_add", "scatter_add")


def _picked(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], size: int, length: int, k: int
) -> Any:
    """Which positions along the batch's dimension (of ``size``) output ``k`` of ``select``,
    ``narrow``, ``split``, ``chunk``, ``unbind`` takes (``length`` of them: its size along
    it), as a ``range``; the call itself where leanprop does not compute them."""
    try:
        if name in ("select", "narrow"):  # (x, dim, index), (x, dim, start, length)
            start = int(_dims_arg(args, kwargs, 2, "index", "start"))
            start = start + size if start < 0 else start
            return range(start, start + length)
        if name == "unbind":
            return range(k, k + 1)
        if name == "chunk":
            step = -(-size // int(_dims_arg(args, kwargs, 1, "chunks")))
            return range(k * step, k * step + length)
        if name == "split":
            sizes = _dims_arg(args, kwargs, 1, "split_size_or_sections", "split_size")
            if isinstance(sizes, int):
                return range(k * sizes, k * sizes + length)
            start = sum(int(v) for v in sizes[:k])
            return range(start, start + length)
    except (TypeError, ValueError, IndexError):
        pass
    return (name, k, repr(args[1:]), repr(sorted(kwargs.items())))


def _rows_at(index: Any, ids: Tensor) -> bool:
    """Whether ``index`` picks the rows at integer ``ids`` alone (``t[ids]``, ``t[ids, :]``,
    ``t[ids, ...]``), as ``ids.shape + t.shape[1:]``."""
    if ids.is_floating_point() or ids.dtype in (torch.bool, torch.uint8):
        return False
    if isinstance(index, tuple) and index and index[0] is ids:
        return all(
            it is Ellipsis or (isinstance(it, slice) and it == slice(None)) for it in index[1:]
        )
    return index is ids


def _is_tensor_unfold(name: str, args: Sequence[Any]) -> bool:
    """``Tensor.unfold(dim, size, step)`` (``F.unfold``, im2col, takes the batch first)."""
    return name == "unfold" and len(args) == 4


def result_dim(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    bd: BatchDim, out: Tensor, k: int, n: int, tracker: BatchTracker,
) -> Info:  # fmt: skip
    """Where the batch of input ``x`` lands in output ``k``, ``out``.

    ``which`` is the position of ``x`` in ``args`` (also for an element of a list argument), or
    its keyword."""
    nd, od = x.dim(), out.dim()
    if name in _MATMUL_ARGS and kwargs:  # (HF Bloom: alibi.baddbmm(batch1=q, batch2=k, ...))
        args, which = _matmul_positional(name, args, kwargs, which)
    if name == "scaled_dot_product_attention":  # q, k, v, attn_mask [N, ..., L, S]
        if bd.dim >= nd - 2:
            return Lost("attention over the batch dimension")
        return BatchDim(od - (nd - bd.dim), bd.inner)
    if name == "multi_head_attention_forward":
        # query [L, N, E] (dim 1), key_padding_mask [N, S] (dim 0) -> ([L, N, E], [N, L, S])
        expected = 0 if which == "key_padding_mask" or x.dim() == 2 else 1
        if bd.dim != expected or bd.inner != 1 or out.dim() < 2:
            return Lost("nn.MultiheadAttention with its batch elsewhere than documented")
        return BatchDim(1 if k == 0 else 0)
    if name in _RNN_OPS and isinstance(args[-1], bool) and not is_packed_rnn_op(name, args):
        # (input, hx, params, ..., batch_first) -> (output, h_n[, c_n]); hidden states [L, N, H]
        first = 0 if args[-1] else 1
        expected = first if which == 0 else 1
        if bd != BatchDim(expected):
            return Lost(f"{name} with its batch elsewhere than documented")
        return BatchDim(first if k == 0 else 1)
    if name == "embedding_bag" and which in (2, "offsets"):  # offsets [N]: a bag per sample
        return bd if bd == BatchDim(0) and nd == 1 and k == 0 else Lost("embedding_bag offsets")
    if isinstance(which, str) and (name in _INDEX_OPS or name == "diff"):
        # (x.index_add(0, g, source=o); diff's prepend and append, laid out as the input)
        which = _INDEX_KEYWORDS.get(which, 3 if which in ("prepend", "append") else which)
    if isinstance(which, str) or name in _ELEMENTWISE:
        return _elementwise(name, args, kwargs, x, bd, out)
    # the layers' ops next (each layer's call passes here): no branch below takes their names
    if name in ("linear", "embedding", "embedding_bag"):
        if name == "linear" and bd.dim == nd - 1:
            return Lost("a linear layer sums over the batch dimension")
        if name == "embedding_bag" and nd == 1:
            return Lost("embedding_bag with offsets")
        return bd
    rare = _rare_result(name, args, kwargs, which, bd, nd, od) if name in _RARE else None
    if rare is not None:  # (functions of matrices, distances, spectra, norms of matrices)
        return rare
    if name in ("layer_norm", "rms_norm"):
        k = len(args[1]) if isinstance(args[1], Sequence) else 1
        return Lost(f"{name} over the batch dimension") if bd.dim >= nd - k else bd
    if (name in _BATCH_FIRST_OPS and not _is_tensor_unfold(name, args)) or name == "pad":
        if name == "pad":
            k = len(args[1]) // 2
            return Lost("padding the batch dimension") if bd.dim >= nd - k else bd
        if bd.dim != 0:
            return Lost(f"{name} needs the batch first")
        if bd.inner != 1:
            return Lost(f"{name} on samples flattened with another dimension")
        return bd
    if name in _VIEWS:
        return _reshaped(x.shape, bd, n, out.shape)
    if name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = (_norm_dim(int(d), nd) for d in (args[1], args[2]))
        return BatchDim({d0: d1, d1: d0}.get(bd.dim, bd.dim), bd.inner)
    if name == "T" and nd != 2:  # reverses every dimension
        return BatchDim(nd - 1 - bd.dim, bd.inner)
    if name in ("t", "mT", "mH", "adjoint") or name == "T":
        swap = {nd - 1: nd - 2, nd - 2: nd - 1}
        return BatchDim(swap.get(bd.dim, bd.dim), bd.inner)
    if name == "permute":
        dims = args[1:] if len(args) > 2 or isinstance(args[1], int) else args[1]
        dims = [_norm_dim(int(d), nd) for d in dims]
        return BatchDim(dims.index(bd.dim), bd.inner)
    if name in ("movedim", "moveaxis"):
        src, dst = args[1], args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        order = [None] * nd
        for s, t in zip(src, dst, strict=True):
            order[_norm_dim(t, nd)] = _norm_dim(s, nd)
        rest = iter(d for d in range(nd) if d not in order)
        order = [next(rest) if o is None else o for o in order]
        return BatchDim(order.index(bd.dim), bd.inner)
    if name == "unsqueeze":
        d = _norm_dim(int(_dims_arg(args, kwargs, 1, "dim")), od)
        return BatchDim(bd.dim + (d <= bd.dim), bd.inner)
    if name == "squeeze":
        d = _dims_arg(args, kwargs, 1, "dim")
        dims = range(nd) if d is None else [d] if isinstance(d, int) else d
        gone = [_norm_dim(k, nd) for k in dims if x.shape[k] == 1]
        if bd.dim in gone:
            return Lost("squeeze removed the batch dimension (a batch of one sample)")
        return BatchDim(bd.dim - sum(k < bd.dim for k in gone), bd.inner)
    if name in ("select", "narrow", "split", "chunk", "unbind", "tensor_split"):
        pos = 2 if name in ("split", "chunk", "tensor_split") else 1  # (x, size, dim), (x, dim)
        d = _norm_dim(int(_dims_arg(args, kwargs, pos, "dim") or 0), nd)
        if name == "narrow" and x.shape[d] == out.shape[d] and d == bd.dim:
            return bd
        if d == bd.dim:
            picks = _picked(
                name,
                args,
                kwargs,
                x.shape[d],
                out.shape[d] if name in ("narrow", "split", "chunk") else 1,
                k,
            )
            return Selected(f"{name} along the batch dimension", picks)
        if name in ("select", "unbind"):
            return BatchDim(bd.dim - (d < bd.dim), bd.inner)
        return bd
    if name == "getitem":
        if which == 1 and _rows_at(args[1], x):
            return bd  # (rows of a tensor at the samples' indices, codebook[ids]: [*ids, ...])
        return _index_result(args[1], nd, bd, n, tracker)
    if name in ("cat", "concat", "concatenate"):
        d = _norm_dim(int(_dims_arg(args, kwargs, 1, "dim", "axis") or 0), nd)
        return Lost(_CONCATENATED) if d == bd.dim else bd
    if name == "stack":
        d = _norm_dim(int(_dims_arg(args, kwargs, 1, "dim") or 0), od)
        return BatchDim(bd.dim + (d <= bd.dim), bd.inner)
    if name in ("expand", "expand_as", "broadcast_to"):  # new dimensions go in front
        if out.shape[od - (nd - bd.dim)] != x.shape[bd.dim]:
            return Lost("expand along the batch dimension")
        return BatchDim(od - (nd - bd.dim), bd.inner)
    if name in ("repeat", "tile"):
        reps = list(args[1:]) if len(args) > 2 or isinstance(args[1], int) else list(args[1])
        if reps[len(reps) - (nd - bd.dim)] != 1:
            return Lost("repeat along the batch dimension")
        return BatchDim(od - (nd - bd.dim), bd.inner)
    if name in _INDEX_OPS:  # (x, dim, index, ...): picks or places entries along dim
        pos, default = _INDEX_OPS[name]
        d = _dims_arg(args, kwargs, pos, "dim", "axis")
        d = default if d is None else d
        along = d is not None and _norm_dim(int(d), nd) == bd.dim
        if which == 3 and along and _adds(name, args, kwargs):
            return Combined(f"{name} adds samples together")  # (into groups: index_add)
        if name == "index_select" and which == 2 and nd == 1 and d is not None:  # (rows at ids)
            return BatchDim(_norm_dim(int(d), od), bd.inner)
        picks_at = 1 if name == "take_along_dim" else 2  # (input, indices, dim), (x, dim, index)
        if name in ("gather", "take_along_dim") and which == picks_at and d is not None:
            if along:
                return Lost(f"{name} along the batch dimension (or with a batched index)")
            return bd  # (the output is laid out as the index: each sample's picks its own)
        if which != 0 or d is None or _norm_dim(int(d), nd) == bd.dim:
            return Lost(f"{name} along the batch dimension (or with a batched index)")
        return BatchDim(bd.dim, bd.inner) if name != "unfold" else bd
    if _is_tensor_unfold(name, args):
        return Lost("unfold along the batch dimension") if _norm_dim(args[1], nd) == bd.dim else bd
    if name in ("outer", "ger"):
        return BatchDim(which, bd.inner)
    if name == "diag_embed":
        return bd if bd.dim < nd - 1 else Lost("diag_embed of the batch dimension")
    if name == "repeat_interleave" and which == 0:  # (x, repeats, dim): each sample's rows
        d, reps = _dims_arg(args, kwargs, 2, "dim"), _dims_arg(args, kwargs, 1, "repeats")
        if d is None or _norm_dim(int(d), nd) != bd.dim:
            return bd if d is not None else Lost("repeat_interleave of every element")
        if isinstance(reps, int) and not isinstance(reps, bool):
            return BatchDim(bd.dim, bd.inner * reps)
        return Lost("repeat_interleave along the batch dimension by counts")
    if name in ("quantile", "nanquantile"):  # (x, q, dim): between two values along dim
        d = _dims_arg(args, kwargs, 2, "dim")
        if d is None or _norm_dim(int(d), nd) == bd.dim:
            return Combined(f"{name} over the batch dimension", summed=False)
        dims = 0 if _dims_arg(args, kwargs, 3, "keepdim") else 1
        q = _dims_arg(args, kwargs, 1, "q")
        front = 1 if isinstance(q, Tensor) and q.dim() == 1 else 0  # (a quantile per q first)
        return BatchDim(front + bd.dim - dims * (_norm_dim(int(d), nd) < bd.dim), bd.inner)
    if name == "gumbel_softmax":  # (logits, tau, hard, eps, dim=-1)
        d = _dims_arg(args, kwargs, 4, "dim")
        if _norm_dim(-1 if d is None else int(d), nd) == bd.dim:
            return Lost("gumbel_softmax along the batch dimension mixes samples")
        return bd
    if name in _DIM_OPS:
        d = _dims_arg(args, kwargs, 1, "dim")
        d = 1 if name == "normalize" and d is None else d
        if d is None or _norm_dim(int(d), nd) == bd.dim:
            return Lost(f"{name} along the batch dimension mixes samples")
        return bd
    if name in ("flip", "roll"):
        d = _dims_arg(args, kwargs, 1 if name == "flip" else 2, "dims")
        dims = [] if d is None else [d] if isinstance(d, int) else list(d)
        if not dims or any(_norm_dim(k, nd) == bd.dim for k in dims):
            return Lost(f"{name} along the batch dimension mixes samples")
        return bd
    if name in ("max", "min") and len(args) > 1 and isinstance(args[1], Tensor):
        return _elementwise(name, args, kwargs, x, bd, out)  # torch.max(a, b): elementwise
    if name in _REDUCTIONS:
        d = _reduced_dims(name, args, kwargs)
        summed = name not in _SELECTIONS
        if d is None:
            return Combined(f"{name} over all elements sums samples", summed)
        dims = [_norm_dim(k, nd) for k in ([d] if isinstance(d, int) else d)]
        if bd.dim in dims:
            return Combined(f"{name} over the batch dimension sums samples", summed)
        if od == nd:  # keepdim
            return bd
        return BatchDim(bd.dim - sum(k < bd.dim for k in dims), bd.inner)
    if name in ("matmul", "mm", "bmm", "dot", "vdot"):
        return _matmul(args[0], args[1], which, bd, od)
    if name == "addbmm" and which in (1, 2) and bd.dim == 0:
        return Lost("addbmm sums over the batch dimension")
    if name in ("addmm", "baddbmm", "addbmm"):
        if which == 0:
            return BatchDim(od - (nd - bd.dim), bd.inner)
        return _matmul(args[1], args[2], which - 1, bd, od)
    if name == "einsum":
        return _einsum(args, which - 1, bd)
    if name in _LOSSES:
        if kwargs.get("reduction", "mean") != "none":
            return Combined("a loss reduces over samples")
        if name in _SAMPLE_LOSSES:  # [N, ...] -> [N]
            return bd if bd.dim == 0 else Lost(f"{name} with the batch not first")
        if name not in _CLASS_LOSSES or which == 1:  # elementwise, or the targets [N, ...]
            return bd
        if which != 0:
            return Lost(f"{name}'s argument {which}")
        if bd.dim == 1:  # (the classes' dimension: [N, C, ...] -> [N, ...])
            return Lost(f"{name} over the batch dimension (taken as the classes')")
        return BatchDim(bd.dim - (bd.dim > 1), bd.inner)
    d = kwargs.get("dim", kwargs.get("axis")) if kwargs else None
    dims = d if isinstance(d, list | tuple) else [d]
    if d is not None and any(isinstance(k, int) and _norm_dim(k, nd) == bd.dim for k in dims):
        return Lost(f"'{name}' {_UNKNOWN_ALONG}")  # (torch.cumulative_trapezoid(x, dim=0))
    return _elementwise(name, args, kwargs, x, bd, out)


_UNKNOWN_ALONG = "(an op leanprop does not know) along the batch dimension may mix samples"
_CONCATENATED = "concatenation along the batch dimension"
_REJOINED = "parts of the batch put together"


def _elementwise(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], x: Tensor, bd: BatchDim, out: Tensor
) -> Info:
    """Anything else: elementwise (broadcast from the right) if the shapes say so."""
    nd, od = x.dim(), out.dim()
    if od >= nd - bd.dim and tuple(out.shape[od - nd :]) == tuple(x.shape):
        return BatchDim(od - (nd - bd.dim), bd.inner)
    if od >= nd - bd.dim and out.shape[od - (nd - bd.dim)] == x.shape[bd.dim]:
        bc = torch.broadcast_shapes
        try:
            shapes = [t.shape for t in tensors_in(args, kwargs)]
            if tuple(bc(*shapes)) == tuple(out.shape):
                return BatchDim(od - (nd - bd.dim), bd.inner)
        except RuntimeError:
            pass
    return Lost(f"'{name}' (an op leanprop does not know changed the shape)")


def tensors_in(args: Iterable[Any], kwargs: dict[str, Any]) -> list[Tensor]:
    out: list[Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out.extend(t for t in a if isinstance(t, Tensor))
    return out


class _ByTensor:
    """A dict keyed by tensor identity that holds its tensors weakly.

    Looked up on every op of the forward, so lighter than ``torch.utils.weak``'s dictionary
    (which builds a weak reference per lookup): the id finds the entry, and the entry's weak
    reference confirms it is still the same tensor (an id reused after a tensor died never
    matches a dead reference)."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, Any]] = {}

    def __setitem__(self, t: Tensor, value: Any) -> None:
        key, d = id(t), self._d

        def drop(ref: weakref.ref, key: int = key) -> None:
            entry = d.get(key)
            if entry is not None and entry[0] is ref:
                del d[key]

        d[key] = (weakref.ref(t, drop), value)

    def get(self, t: Any, default: Any = None) -> Any:
        entry = self._d.get(id(t))
        if entry is None or entry[0]() is not t:
            return default
        return entry[1]

    def __contains__(self, t: Any) -> bool:
        entry = self._d.get(id(t))
        return entry is not None and entry[0]() is t

    def __bool__(self) -> bool:
        return bool(self._d)

    @property
    def ids(self) -> Mapping[int, Any]:
        """The ids of the tensors held (an id of a tensor that died may linger until its
        weak reference's callback runs)."""
        return self._d


class BatchTracker:
    """Where the batch is in each tensor of the current forward, and which tensors derive from
    tracked parameters without carrying the batch.

    Owned by one :class:`~leanprop.per_sample.capture.PerSample`; tensors are held weakly.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = set(params)
        self._param_ids = frozenset(map(id, self.params))  # (held in ``params``: ids stay theirs)
        self.n: int | None = None
        self._info = _ByTensor()  # tensor -> Info
        # tensor -> why its values mix samples, where it requires grad: one sample's values
        # through another's (softmax or flip along the batch, o @ o.T) or joined with a value
        # over all samples (o - o.mean(0)); a loss from one has no per-sample parts
        self._mixed = _ByTensor()
        self._derived = _ByTensor()  # tensor -> the tracked parameters it derives from
        self._lookups = _ByTensor()  # derived tensor -> Lookup, where it is one
        # derived tensor -> the tensor it was detached from by a reentrant checkpoint's
        # recomputation, or a parameter whose copy it is (see vjp_root); derived tensors
        # computed from such detached copies -> True
        self._sources = _ByTensor()
        self._detached = _ByTensor()
        self._from_detached = _ByTensor()
        # kept in the autograd nodes' own metadata (gone with the graph, never held here):
        # where the batch is in each tensor followed while saved-tensor hooks were in effect
        # (see _recover), and in each curved elementwise op's output (the Hessian's residual
        # terms: the output itself is gone by then, its node is not); each under this
        # forward's token
        self._forward = object()
        self._edges_kept = False
        self._ref = weakref.ref(self)
        self._accumulators: dict[nn.Parameter, Any] = {}  # (held for one forward)

    def clear(self) -> None:
        """Forget where the batch is in every tensor (another batch's forward). Tensors
        computed from the parameters alone stay what they are: made before this forward (a
        weight prepared outside the model, a penalty), they are still batch-free."""
        self.n = None
        self._info = _ByTensor()
        self._mixed = _ByTensor()
        self._forward = object()
        self._edges_kept = False
        self._accumulators = {}

    def curved(self, node: Any) -> Info | None:
        """Where the batch is in the output of ``node``, the autograd node of a curved
        elementwise op of this forward (None for other nodes)."""
        return self._kept(node, _CURVED).get(0)

    def _kept(self, node: Any, kind: str) -> dict[int, Any]:
        """What this forward keeps of kind ``kind`` in ``node``'s metadata: ``{output_nr:
        value}`` (empty where it keeps nothing)."""
        slot = node.metadata.get(kind, {}).get(id(self))
        return slot[2] if slot is not None and slot[1] is self._forward else {}

    def _keep(self, node: Any, kind: str, output_nr: int, value: Any) -> None:
        """Keep ``value`` in ``node``'s metadata for this forward. One slot per live tracker
        (nested contexts), each holding its latest forward's values only: a node that outlives
        its forward (a parameter's gradient accumulator, held across steps by DDP) keeps no
        more than that."""
        slots = node.metadata.get(kind)
        if slots is None:
            slots = node.metadata[kind] = {}
        slot = slots.get(id(self))
        if slot is None or slot[1] is not self._forward or slot[0]() is not self:
            for key in [k for k, (ref, _, _) in slots.items() if ref() is None]:
                del slots[key]  # (a tracker gone: its context's exit)
            slot = slots[id(self)] = (self._ref, self._forward, {})
        slot[2][output_nr] = value

    def vjp_root(self, t: Tensor) -> Tensor:
        """Where a vector-Jacobian product from the derived tensor ``t`` to its parameters
        starts: ``t``, or, for a copy that a reentrant checkpoint's recomputation detached
        from the forward's (its input), that tensor, which leads to them.

        Raises:
            UnsupportedModelError: ``t`` was computed from such a copy inside the checkpointed
                function (its graph ends at the copy: no product reaches the parameters)."""
        if self._from_detached and t in self._from_detached:
            raise UnsupportedModelError(
                "per_sample: a tensor computed from parameters alone is passed to "
                "checkpoint(use_reentrant=True) and changed inside the checkpointed function "
                "before it meets the batch. The recomputation detaches the checkpoint's inputs, "
                "so leanprop cannot take its parameters' per-sample gradients back through that "
                "change. Change it before the checkpoint (pass the result), read the parameters "
                "inside the function instead of passing them, or use use_reentrant=False."
            )
        return self._sources.get(t, t)

    def lookup(self, t: Any) -> Lookup | None:
        """How ``t`` was computed, if it is rows of one tracked parameter looked up with
        batch-free indices (a position embedding)."""
        return self._lookups.get(t) if isinstance(t, Tensor) else None

    def mark(self, t: Tensor, info: Info) -> None:
        self._info[t] = info

    def mixed(self, t: Any) -> str | None:
        """Why ``t``'s values mix samples (see ``_record``), or None: a loss computed from such
        values is no sum of per-sample terms."""
        return self._mixed.get(t) if isinstance(t, Tensor) else None

    def info(self, t: Any) -> Info | None:
        """Where ``t`` carries the batch; None if it does not (or is not a tensor)."""
        if not isinstance(t, Tensor):
            return None
        info = self._info.get(t)
        if info is None and self._edges_kept and self._may_recover(t):
            info = self._info.get(t)
        return info

    def _may_recover(self, t: Tensor) -> bool:
        """:meth:`_recover` ``t``, unless it is known to carry no batch (a parameter, or a
        tensor computed from parameters alone)."""
        return t not in self.params and t not in self._derived and self._recover(t)

    def _recover(self, t: Tensor) -> bool:
        """Follow ``t``, a tensor that a checkpoint's recomputation got from its saved inputs,
        as the tensor of the recorded forward that was saved: True where it is one.

        Saved-tensor hooks that copy what they save (``save_on_cpu``, activation offloading)
        hand a checkpoint's recomputation copies of its inputs, not the tensors followed in
        the forward. A copy keeps the original's place in the graph (its autograd node and
        output number; a leaf's gradient accumulator), by which it is found here: only inside
        a backward, where the recomputations run."""
        if not t.requires_grad or current_graph_task_id() == -1:
            return False
        node = self._edge_node(t)
        found = None if node is None else self._kept(node, _EDGES).get(t.output_nr)
        if found is None:
            return False
        if isinstance(found, frozenset):
            self._derived[t] = found
            p = next(iter(found))
            if len(found) == 1 and p.requires_grad and self._edge_node(p) is node:
                self._sources[t] = p  # (a parameter's copy: its individual gradients are its
                # own; not a leaf the model detached from it, which leads to no parameter)
        else:
            self._info[t] = found
        return True

    def _is_detached(self, t: Tensor) -> bool:
        """``t`` is a reentrant checkpoint's detached copy, or computed from one."""
        return t in self._detached or t in self._from_detached

    def _edge_node(self, t: Tensor) -> Any:
        """The autograd node where ``t``'s gradient goes: its ``grad_fn``, or a leaf's gradient
        accumulator (a tracked parameter's looked up once per forward; None for a view made
        without autograd, which has neither of its own)."""
        if t.grad_fn is not None:
            return t.grad_fn
        if not t.requires_grad or t._is_view():
            return None
        if t in self.params:
            node = self._accumulators.get(t)
            if node is None:
                node = self._accumulators[t] = get_gradient_edge(t).node
            return node
        return get_gradient_edge(t).node

    def _derived_input(self, t: Tensor, by_edge: bool) -> frozenset[nn.Parameter]:
        params = self.derived_params(t)
        if by_edge and params:
            self._remember_edge(t, params)
        return params

    def _remember_edge(self, t: Tensor, found: Info | frozenset[nn.Parameter]) -> None:
        """Keep where ``t``'s batch is in its autograd node, for :meth:`_recover` (while
        saved-tensor hooks are in effect)."""
        node = self._edge_node(t)
        if node is not None:
            self._keep(node, _EDGES, t.output_nr, found)
            self._edges_kept = True

    def derived_params(self, t: Any) -> frozenset[nn.Parameter]:
        """Tracked parameters a batch-free tensor derives from (empty if none or batched)."""
        if not isinstance(t, Tensor):
            return frozenset()
        if t in self.params:
            return frozenset({t})
        found = self._derived.get(t)
        if found is None and self._edges_kept and self._recover(t):
            found = self._derived.get(t)
        return frozenset() if found is None else found

    def mark_derived(self, t: Tensor, params: frozenset[nn.Parameter]) -> None:
        self._derived[t] = params

    def involved(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether any input may be tracked (a fast check before the op runs, on every op of
        the forward: by ids alone, so a dead tensor's id reused may answer yes, and the op
        then takes the careful way)."""
        info, derived, params = self._info.ids, self._derived.ids, self._param_ids
        for a in (*args, *kwargs.values()) if kwargs else args:
            for t in a if isinstance(a, list | tuple) else (a,):
                if not isinstance(t, Tensor):
                    continue
                i = id(t)
                if i in info or i in derived or i in params:
                    return True
                if self._edges_kept and self._may_recover(t):
                    return True
        return False

    def escaping(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> list[tuple[tuple[int | str, ...], frozenset[nn.Parameter]]]:
        """The operands of an op computed from tracked parameters alone, needing gradients,
        that it joins with values in which the samples were combined (every batched operand
        :class:`Combined`; see ``escapes.py``), with their parameters. Each is named by its
        place: ``(position,)``, ``(keyword,)``, or ``(position, index)`` in a list argument
        (``torch.stack([loss, penalty])``)."""
        batch_free: list[tuple[tuple[int | str, ...], Tensor]] = []
        combined = False
        for key, v in (*enumerate(args), *kwargs.items()):
            if isinstance(v, Tensor):
                items: Iterable[tuple[tuple[int | str, ...], Any]] = (((key,), v),)
            elif isinstance(v, list | tuple):
                items = (((key, j), t) for j, t in enumerate(v))
            else:
                continue
            for place, t in items:
                if not isinstance(t, Tensor):
                    continue
                info = self._info.get(t)
                if info is None:
                    batch_free.append((place, t))
                elif not isinstance(info, Combined):  # (the op meets the batch itself: on
                    return []  # the hot path of every forward, left at the first one)
                else:
                    combined = True
        if not combined:
            return []
        return [
            (place, params)
            for place, t in batch_free
            if t.requires_grad and (params := self.derived_params(t))
        ]

    def propagate(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, replay: bool = False
    ) -> None:
        """Record where the batch went in the outputs of ``func(*args, **kwargs) -> out``.

        ``replay``: the op runs again in a non-reentrant checkpoint's recomputation, whose
        graph no backward goes through: nothing is kept in its nodes."""
        name = op_name(func)
        if name in _NON_TENSOR or name in _FACTORIES:
            return
        outs = _tensor_outputs(out)
        if not outs:
            return
        batched: list[tuple[int | str, Tensor, Info]] = []
        derived: set[nn.Parameter] = set()
        detached = False  # (a derived input is a reentrant checkpoint's detached copy)
        # (a checkpoint's saved inputs may come back as copies: see _recover(). Kept while
        # saved-tensor hooks other than a checkpoint's own are in effect, for the op's tensors
        # too: such a hook that copies what it saves reads the tensor with an op. Not inside a
        # checkpointed block, where they would cost every checkpointed model and serve a
        # checkpoint nested in it only; nor in a replay, whose graph no backward frees)
        by_edge = not replay and saved_tensor_hooks_in_effect() == "other"
        for i, a in enumerate(args):
            for j, t in enumerate(a if isinstance(a, list | tuple) else (a,)):
                if not isinstance(t, Tensor):
                    continue
                info = self.info(t)
                if info is not None:  # a list's j-th tensor counts as argument i + j (einsum)
                    batched.append((i + j, t, info))
                else:
                    derived |= self._derived_input(t, by_edge)
                    detached = detached or (bool(self._detached) and self._is_detached(t))
                    continue
                if by_edge:
                    self._remember_edge(t, info)
        for key, v in kwargs.items():
            if isinstance(v, Tensor):
                info = self.info(v)
                if info is not None:
                    batched.append((key, v, info))
                    if by_edge:
                        self._remember_edge(v, info)
                else:
                    derived |= self._derived_input(v, by_edge)
                    detached = detached or (bool(self._detached) and self._is_detached(v))
        batched = _by_value(name, args, kwargs, batched)
        if not batched:
            if derived:
                params = frozenset(derived)
                for o in outs:
                    self._derived[o] = params
                    if by_edge:
                        self._remember_edge(o, params)
                if name == "detach" and detaching_checkpoint_inputs():
                    self._sources[outs[0]] = self.vjp_root(args[0])
                    self._detached[outs[0]] = True
                elif detached:  # (one that carries no gradient is a constant: a mask)
                    for o in outs:
                        if o.requires_grad:
                            self._from_detached[o] = True
                if name == "embedding" and len(outs) == 1:
                    found = _lookup(args, kwargs, self.params)
                    if found is not None:
                        self._lookups[outs[0]] = found
            return
        self._record(name, args, kwargs, outs, batched, by_edge, replay)

    def batched_only(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> list[tuple[int | str, Tensor, Info]] | None:
        """The operands of an op that carry the batch, numbered as :meth:`propagate` numbers
        them, where none of its tensors is a tracked parameter or derives from one (the op
        then uses no parameter: nothing to capture or watch, only where the batch goes, by
        :meth:`propagate_batched`); None where one may (by id: a dead tensor's id reused
        answers None too), or while edges are kept (see :meth:`_recover`): the careful way.

        On every op of the forward: one pass over the operands, by ids first."""
        if self._edges_kept:
            return None
        info_ids, derived, params = self._info.ids, self._derived.ids, self._param_ids
        batched: list[tuple[int | str, Tensor, Info]] = []
        for i, a in enumerate(args):
            for j, t in enumerate(a) if isinstance(a, list | tuple) else ((0, a),):
                if not isinstance(t, Tensor):
                    continue
                key = id(t)
                if key in derived or key in params:
                    return None
                if key in info_ids:
                    info = self._info.get(t)
                    if info is not None:  # (a list's j-th tensor counts as argument i + j)
                        batched.append((i + j, t, info))
        for key, v in kwargs.items():
            for t in v if isinstance(v, list | tuple) else (v,):
                if isinstance(t, Tensor) and (id(t) in derived or id(t) in params):
                    return None
            if isinstance(v, Tensor) and id(v) in info_ids:
                info = self._info.get(v)
                if info is not None:
                    batched.append((key, v, info))
        return batched

    def propagate_batched(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any,
        batched: list[tuple[int | str, Tensor, Info]], replay: bool,
    ) -> None:  # fmt: skip
        """:meth:`propagate` for an op whose operands carrying the batch are ``batched`` (from
        :meth:`batched_only`: no operand derives from a parameter): the same result, without
        looking at the operands again. Where saved-tensor hooks other than a checkpoint's are
        in effect (edges are kept for the tensors): :meth:`propagate`."""
        if not replay and saved_tensor_hooks_in_effect() == "other":
            self.propagate(func, args, kwargs, out, replay)
            return
        name = op_name(func)
        if name in _NON_TENSOR or name in _FACTORIES:
            return
        outs = _tensor_outputs(out)
        batched = _by_value(name, args, kwargs, batched) if outs else []
        if batched:
            self._record(name, args, kwargs, outs, batched, False, replay)

    def _record(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], outs: list[Tensor],
        batched: list[tuple[int | str, Tensor, Info]], by_edge: bool, replay: bool,
    ) -> None:  # fmt: skip
        """Where the batch of the operands ``batched`` (position or keyword, tensor, info)
        went in each of the op's tensor outputs ``outs``: recorded."""
        n = self.n if self.n is not None else 0
        for k, o in enumerate(outs):
            results, constants = set(), None  # (constants: batch statistics without grad)
            held = set()  # (what became of the operands that require grad: held differently,
            # their samples meet; and why the output mixes them: an operand's history first)
            mixing = self._mixed_before(batched) if self._mixed else None
            # (joined: an operand that requires grad concatenated with others along the batch)
            joined = False
            for i, t, info in batched:
                if name in _ORDER_OPS and isinstance(info, BatchDim) and info.inner == 1:
                    info = Reordered(_REORDERED, info.dim, tuple(range(t.shape[info.dim])))
                if isinstance(info, Reordered | Packed):
                    try:
                        r = _ordered_result(name, args, kwargs, i, t, info, o, k, n, self)
                    except (IndexError, TypeError, ValueError, KeyError):
                        r = Lost(f"'{name}' with arguments leanprop cannot read")
                elif isinstance(info, Lost):
                    combined = _combines(name, args, kwargs) and not isinstance(info, Combined)
                    picked = isinstance(info, Selected) or getattr(info, "of_pick", False)
                    r = (
                        Combined(f"'{name}' over {info.reason}", of_pick=picked)
                        if combined
                        else info
                    )
                    if type(r) is Combined and r.summed and not r.of_pick and t.numel() == 1:
                        r = Combined(r.reason, summed=False)  # (made of totals: stack([l1, l2]))
                    if type(info) is Combined and info.summed and t.requires_grad and t.numel() > 1:
                        mixing = mixing or _reads_summed(name, i, info, batched)
                else:
                    try:
                        r = result_dim(name, args, kwargs, i, t, info, o, k, n, self)
                    except (IndexError, TypeError, ValueError, KeyError):
                        r = Lost(f"'{name}' with arguments leanprop cannot read")
                    if t.requires_grad and type(r) is not BatchDim:
                        mixing = mixing or _mixes_itself(name, i, info, r, o)
                        joined = joined or (type(r) is Lost and r.reason == _CONCATENATED)
                if type(r) is Combined and not t.requires_grad and o.requires_grad:
                    constants = {r}  # (o - o.mean(0).detach(): still each sample's values)
                else:
                    results.add(r)
                at = info if isinstance(r, Combined) else r  # (a reduction: as they came)
                if t.requires_grad and _holds_samples(at):
                    held.add(at)
            results = results or constants
            if (
                name in _SIDE_BY_SIDE
                and len(results) > 1
                and all(type(r) is Selected for r in results)
            ):  # (cat([o[:k], o[k:]]): each value still one sample's, in no known place)
                results = {Lost(_REJOINED)}
            res = results.pop() if len(results) == 1 else _merge(results)
            self._info[o] = res
            if o.requires_grad:
                # (one operand mixes nothing by meeting: only an op of its own or its history)
                if mixing is None and len(batched) > 1:
                    mixing = _mixing(name, batched, res, held)
                if mixing is None and joined:  # (SimCLR's cat([z1, z2]), then z @ z.T)
                    mixing = (
                        "rows of the batch concatenated with other rows along it: what "
                        "follows would take them for samples of one batch"
                    )
                if mixing is not None:
                    self._mixed[o] = mixing
            if by_edge:
                self._remember_edge(o, res)
            if name in CURVED_ELEMENTWISE and o.grad_fn is not None and not replay:
                self._keep(o.grad_fn, _CURVED, 0, res)

    def _mixed_before(self, batched: list[tuple[int | str, Tensor, Info]]) -> str | None:
        """Why one of the operands ``batched`` mixes samples already (None where none does)."""
        for _, t, _ in batched:
            reason = self._mixed.get(t)
            if reason is not None:
                return reason
        return None

    def propagate_layer(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Tensor, replay: bool
    ) -> Info | None:
        """:meth:`propagate` for a layer's op whose one batched operand is its input
        ``args[0]`` (a replaced op's: ``fused.py``; its other operands are the layer's
        parameters): the same result, without going through every operand (a few µs per layer
        and step). Anything else (another batched operand, saved-tensor hooks that copy):
        :meth:`propagate`. Returns where the batch is in ``out``."""
        x, info = args[0], self._info.get(args[0]) if isinstance(args[0], Tensor) else None
        others = (*args[1:], *kwargs.values())
        if (
            not isinstance(info, BatchDim)
            or any(self._info.get(t) is not None for t in others if isinstance(t, Tensor))
            or (not replay and saved_tensor_hooks_in_effect() == "other")
        ):
            self.propagate(func, args, kwargs, out, replay)
            return self.info(out)
        name = op_name(func)
        try:
            res = result_dim(name, args, kwargs, 0, x, info, out, 0, self.n or 0, self)
        except (IndexError, TypeError, ValueError, KeyError):
            res = Lost(f"'{name}' with arguments leanprop cannot read")
        self._info[out] = res
        return res


# the keys of what a tracker keeps in an autograd node's metadata (see BatchTracker._keep)
_EDGES, _CURVED = "leanprop.batch_of_outputs", "leanprop.curved_output"


def _by_value(
    name: str, args: Sequence[Any], kwargs: dict[str, Any],
    batched: list[tuple[int | str, Tensor, Info]],
) -> list[tuple[int | str, Tensor, Info]]:  # fmt: skip
    """``batched`` without an index argument the op reads by value (see ``_index_arg``), nor
    the tensor ``x.type_as(other)`` and ``x.to(other)`` take their dtype and device from: its
    own batch does not reach the outputs."""
    if name in ("type_as", "to"):
        return [b for b in batched if b[0] == 0]
    if name not in _READS_INDEX and name not in _RNN_OPS:  # (the ops _index_arg knows)
        return batched
    try:
        index = _index_arg(name, args, kwargs, batched)
    except (IndexError, TypeError, ValueError, KeyError):
        index = None
    return batched if index is None else [b for b in batched if b[0] != index]


def _combines(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """A loss with a reduction, or a reduction over every element: whatever dimension held the
    samples, they are summed together."""
    if name in _LOSSES:
        return kwargs.get("reduction", "mean") != "none"
    return name in _REDUCTIONS and _reduced_dims(name, args, kwargs) is None


def _reduced_dims(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The dimensions a reduction's call names; None where it reduces every element."""
    # (torch.linalg.vector_norm(x, ord, dim, keepdim): the order first)
    at = 2 if name in ("linalg_vector_norm", "linalg_norm") else 1
    d = _dims_arg(args, kwargs, at, "dim", "axis")
    d = None if isinstance(d, bool) or d == [] or d == () else d  # std(x, True): unbiased
    if name in ("norm", "std", "var") and not isinstance(d, int | list | tuple):
        return None  # (norm(x, 2): the order, not a dimension)
    return d


@dataclass(frozen=True, eq=False)
class Lookup:
    """``F.embedding(ids, weight, padding_idx)``: rows of a parameter at batch-free ``ids``."""

    ids: Tensor
    weight: nn.Parameter
    padding_idx: int | None


def _lookup(args: Sequence[Any], kwargs: dict[str, Any], params: set) -> Lookup | None:
    """``F.embedding``'s call as a :class:`Lookup` (None where its gradient is not a plain
    scatter of rows: scaled by frequency, or sparse)."""
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq")
    bound = dict(zip(names, args, strict=False)) | kwargs
    ids, weight = bound.get("input"), bound.get("weight")
    if not isinstance(ids, Tensor) or weight not in params or ids.is_floating_point():
        return None
    if bound.get("scale_grad_by_freq") or bound.get("sparse") or weight.dim() != 2:
        return None
    padding = bound.get("padding_idx")
    if padding is not None and padding < 0:
        padding += weight.shape[0]
    return Lookup(ids, weight, padding)


# ops that mix the samples themselves where they act along the batch (a reordering keeps each
# value one sample's: what it meets next tells)
_MIXES = frozenset(
    {"softmax", "log_softmax", "_softmax", "softmin", "logcumsumexp", "cumsum", "cumprod",
     "normalize", "glu", "scaled_dot_product_attention", "special_softmax",
     "special_log_softmax", "gumbel_softmax"}
)  # fmt: skip
# (where they act along the batch: ops whose results are Lost only then)
_MIXES_WHERE_LOST = frozenset({
    "layer_norm", "rms_norm", "cdist", "pdist", "cov", "corrcoef", "diff", "linalg_matrix_norm",
    "linalg_norm", "cosine_similarity", "pairwise_distance", *_FFTS,
    "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", *_MATRIX_FUNCTIONS,
})  # fmt: skip
# ops taking the batch first whose results mix the samples where it is elsewhere: with the
# samples as channels (a convolution sums over channels, a group norm normalises groups of
# them), or as positions (a pool averages neighbours, an interpolation weighs them)
_MIXES_AS_CHANNELS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "local_response_norm", "group_norm",
})  # fmt: skip
_MIXES_AS_POSITIONS = frozenset({
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "interpolate", "upsample", "lp_pool2d", *_MIXES_AS_CHANNELS,
})  # fmt: skip
# reductions that centre the values they reduce; reductions not linear in them
_CENTRING = frozenset({"std", "var", "std_mean", "var_mean"})
_CURVED_REDUCTIONS = frozenset({
    "norm", "linalg_vector_norm", "linalg_norm", "linalg_matrix_norm", "logsumexp",
    "special_logsumexp", "prod",
})  # fmt: skip
# ops linear in each tensor operand, or choosing among its values, or piecewise linear (a
# clamp's gradient is 0 or 1 at each element, a selection: each sample's term kept or not, as
# in hard-example mining); ops linear in each operand where the others are fixed (an operand
# of a division: the dividend)
_LINEAR = frozenset({
    "add", "sub", "rsub", "neg", "sum", "mean", "nansum", "nanmean", "clone", "contiguous",
    "to", "float", "double", "half", "bfloat16", "type_as", "where", "masked_fill",
    "cat", "concat", "concatenate", "stack", "hstack", "vstack", "expand", "expand_as",
    "broadcast_to", "repeat", "tile", "permute", "transpose", "swapaxes", "swapdims", "t", "T",
    "mT", "movedim", "moveaxis", "squeeze", "unsqueeze", "select", "narrow", "split", "chunk",
    "unbind", "tensor_split", "getitem", "flip", "roll", "index_select", "gather",
    "take_along_dim", "diagonal", "diag", "diag_embed", "trace", "cumsum", "tril", "triu",
    "max", "min", "amax", "amin", "sort", "topk", "kthvalue", "median", "nanmedian", "cummax",
    "cummin", "pad", "sum_to_size", "relu", "relu6", "leaky_relu", "hardtanh", "clamp", "clip",
    "abs", "maximum", "minimum", "fmax", "fmin", *_VIEWS,
})  # fmt: skip
_MULTILINEAR = frozenset({
    "mul", "matmul", "mm", "bmm", "mv", "dot", "vdot", "inner", "outer", "ger", "einsum",
    "linear", "addmm", "baddbmm", "addbmm", "tensordot", "kron", "truediv", "div",
})  # fmt: skip


def _mixes_itself(name: str, which: int | str, bd: BatchDim, r: Info, out: Tensor) -> str | None:
    """Why an op mixes the samples of its operand ``which`` (batch at ``bd``; its result's
    ``r``, in ``out``) by acting along the batch (None where it does not): a softmax or a
    normalisation over the samples, a convolution taking them for channels, a variance over
    them, a norm over them that is not one value for the batch (the norm of everything is a
    function of the summed squares, as any function of the summed loss)."""
    where_lost = (  # (an operand by keyword: the shape-only rule's Lost, no mixing told)
        name in _MIXES_WHERE_LOST
        and isinstance(which, int)
        and (which == 0 or name not in _MATRIX_FUNCTIONS)
    )
    off_front = (name in _MIXES_AS_CHANNELS and bd.dim != 0) or (
        name in _MIXES_AS_POSITIONS and bd.dim >= 2
    )
    if type(r) is Lost and (
        name in _MIXES or where_lost or off_front or r.reason.endswith(_UNKNOWN_ALONG)
    ):
        return r.reason
    if type(r) is Combined and (
        name in _CENTRING or (name in _CURVED_REDUCTIONS and out.numel() > 1)
    ):
        return f"'{name}' over the batch dimension mixes samples"
    return None


def _reads_summed(
    name: str, i: int | str, info: Combined, batched: list[tuple[int | str, Tensor, Info]]
) -> str | None:
    """Why an op mixes samples through its operand ``i``, a value summed over the samples
    that is not one value for the batch and requires grad (``x.sum(0)``; ``info``: how it was
    summed): the op is not linear in it (``x.sum(0).square()``: each sample's term reads the
    others' values). None where it is: a weighted sum of such values, a selection among
    them (the worst group's loss), a product with values that do not depend on the samples."""
    if name in _LINEAR:
        return None
    alone = all(j == i or not t.requires_grad for j, t, _ in batched)
    if name in _MULTILINEAR and alone and (i == 0 or name not in ("truediv", "div")):
        return None
    return f"'{name}' of a value summed over the samples ({info.reason}), not linear in it"


# ops that put their operands side by side (their samples stay each one's)
_SIDE_BY_SIDE = frozenset(
    {"cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack",
     "row_stack"}
)  # fmt: skip
_DIFFERENT_PLACES = "inputs of one op carry the batch in different places or orders"


def _holds_samples(info: Info) -> bool:
    """Whether ``info`` says where the samples are, or how they were moved (reordered, or
    put in different places): not where leanprop cannot tell (an op it does not know, a
    selection), whose meeting with others says nothing of mixing."""
    if type(info) is not Lost:
        return not isinstance(info, Combined)
    return info.reason == _DIFFERENT_PLACES or info.reason.endswith(
        ("mixes samples", "reorders samples", "(may reorder samples)")
    )


def _mixing(
    name: str, batched: list[tuple[int | str, Tensor, Info]], res: Info, held: set[Info]
) -> str | None:
    """Why an op's output (which requires grad; ``res``: where its batch is) mixes samples
    by joining its operands ``batched`` (none of which does already): a value over all
    samples that requires grad is joined with one that carries the batch (``o - o.mean(0)``);
    or operands that require grad reach the output holding the samples differently
    (``held``: where each one's batch went; ``o @ o.T``, ``o * o.flip(0)``: each sample's
    values with another's). None where it does not."""
    over_all = [i for _, t, i in batched if isinstance(i, Combined) and t.requires_grad]
    per_sample = [i for _, _, i in batched if type(i) not in (Lost, Combined)]
    if over_all and per_sample:
        return (
            f"'{name}' joins each sample's values with a value over all samples "
            f"({over_all[0].reason})"
        )
    if name in _SIDE_BY_SIDE:  # (each sample's values stay its own: mixing where a sample's
        # values are put beside another's, stack([s, s.flip(0)], 1), not where parts of the
        # batch are put back together, cat([o[:k], o[k:]]))
        moved = [h for h in held if not isinstance(h, BatchDim | Selected)]
        if moved and any(isinstance(h, BatchDim) for h in held):
            return f"'{name}' puts each sample's values beside another's ({moved[0].reason})"
        return None
    if type(res) not in (Lost, Combined):
        return None
    given = {i for _, t, i in batched if _holds_samples(i) and t.requires_grad}
    if len(held) > 1 or (len(given) > 1 and type(res) is Lost):  # (an op it cannot follow)
        return f"'{name}': {_DIFFERENT_PLACES} (each sample's values with another's)"
    return None


def _merge(results: set[Info]) -> Info:
    """Inputs whose batch lands differently: plain :class:`Lost` (never one that a later op
    could put back in order)."""
    # (sums of samples first: a value joined with one later reaches the loss in no sample's
    # part; in a fixed order, so that the outcome never depends on the set's)
    plain = sorted(
        (r for r in results if type(r) in (Lost, Combined)),
        key=lambda r: (not isinstance(r, Combined), not getattr(r, "summed", False), r.reason),
    )
    if plain:
        return plain[0]
    return Lost(_DIFFERENT_PLACES)


def _tensor_outputs(out: Any) -> list[Tensor]:
    """An op's tensor outputs, flattened."""
    return [out] if isinstance(out, Tensor) else [o for o in _flat(out) if isinstance(o, Tensor)]


def _flat(out: Any) -> list[Any]:
    if isinstance(out, list | tuple):
        return [y for x in out for y in _flat(x)]
    return [out]


def to_front(t: Tensor, info: BatchDim, n: int) -> Tensor:
    """``t`` with its batch moved to dimension 0 as ``[N, ...]`` (``inner`` split off)."""
    if info.dim != 0:
        t = t.movedim(info.dim, 0)
    if info.inner != 1:
        t = t.reshape(n, info.inner, *t.shape[1:])
    return t
