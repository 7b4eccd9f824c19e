"""Where the batch of an op's input lands in its output, op by op (:func:`result_dim`): one
branch per family of ops (layers, views and transposes, picks along the batch, reductions,
products, losses), elementwise ops first (the hot path). Indexing lives in ``indexing.py``,
matrix products and functions of matrices in ``matrices.py``, reordered samples in
``order.py``, ops with no branch of their own (their dimension argument by signature, strided
views) in ``unknown.py``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .indexing import index_result, picks_by_index, picks_of, rows_at
from .infos import (
    COMBINES_ALONG,
    MAX_GROUPED,
    MAY_MIX,
    MAY_REORDER,
    BatchDim,
    Combined,
    Grouped,
    Info,
    Lost,
    Selected,
    dim_or_last,
    dims_arg,
    norm_dim,
    samples_at,
)
from .matrices import (
    OPERAND_NAMES,
    RARE,
    einsum_result,
    kron_result,
    matmul_result,
    positional,
    rare_result,
    tensordot_result,
)
from .unknown import (
    PLACING_SOURCES,
    STRIDED_LOST,
    STRIDED_VIEWS,
    UNKNOWN_ALONG,
    acts_along_batch,
    as_positional,
)

if TYPE_CHECKING:
    from .tracker import BatchTracker


RNN_OPS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
# one step of a cell (input [N, I], hx [N, H], an LSTM's as (h, c), weights) -> [N, H] (an
# LSTM's (h, c)): nn.RNNCell, nn.GRUCell, nn.LSTMCell
RNN_CELL_OPS = frozenset({"lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"})


def is_packed_rnn_op(name: str, args: Sequence[Any]) -> bool:
    """``lstm(data, batch_sizes, hx, ...)``: the PackedSequence variant of an RNN op."""
    return (
        name in RNN_OPS
        and len(args) > 1
        and isinstance(args[1], Tensor)
        and not args[1].is_floating_point()  # batch sizes, not a GRU's hidden state
    )


# ops that copy what a view would show: followed as the view
_VIEW_COPIES = {
    f"{view}_copy": view
    for view in (
        "as_strided", "detach", "diagonal", "expand", "narrow", "permute", "select", "split",
        "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unfold", "unsqueeze", "view",
        "view_as_real", "view_as_complex", "alias",
    )
}  # fmt: skip


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in _VIEW_COPIES:
        return _VIEW_COPIES[name]
    if name == "__get__":  # a property (x.mT, x.T): name of the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name in ("rtruediv", "rmatmul"):  # (2 / x: not linear in x, as x / 2 is; M @ x:
            return name  # its operands in the other order)
        if name[:1] in "ri" and name[1:] in _ARITH:  # __radd__, __iadd__
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]  # in-place variant
    return name


def in_place(func: Any) -> bool:
    """Whether ``func`` changes its first argument in place (``x.add_(y)``, ``x += y``)."""
    raw = getattr(func, "__name__", "")
    return (raw.endswith("_") and not raw.endswith("__")) or raw.startswith("__i")


_ARITH = {"add", "sub", "mul", "truediv", "floordiv", "pow", "matmul", "and", "or", "xor", "mod"}


VIEWS = {
    "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "_unsafe_view", "ravel",
}  # fmt: skip


# ops that reverse or rotate positions along the dimensions they name
REORDERING = frozenset({
    "flip", "roll", "flipud", "fliplr", "rot90", "fft_fftshift", "fft_ifftshift",
})  # fmt: skip


_REORDERED_AT = {"flip": 1, "roll": 2, "rot90": 2, "fft_fftshift": 1, "fft_ifftshift": 1}


def reordered_dims(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    """The dimensions ``flip``, ``roll``, ``fftshift`` and ``ifftshift`` (all of them by default:
    ``[]``), ``flipud``, ``fliplr`` and ``rot90`` reorder."""
    if name in ("flipud", "fliplr"):
        return [0 if name == "flipud" else 1]
    d = dims_arg(args, kwargs, _REORDERED_AT[name], "dims", "dim")
    d = [0, 1] if d is None and name == "rot90" else d
    return [] if d is None else [d] if isinstance(d, int) else list(d)


# ops that take some positions along a dimension (vsplit, hsplit, dsplit: along a fixed one)
_PICKS = frozenset({
    "select", "narrow", "split", "split_with_sizes", "chunk", "unbind", "tensor_split",
    "vsplit", "hsplit", "dsplit",
})  # fmt: skip
_SPLIT_DIMS = {"vsplit": (0,), "hsplit": (0, 1), "dsplit": (2,)}
_DIM_OPS = {  # same shape, acts along one dimension: mixes samples if that is the batch
    "softmax", "log_softmax", "_softmax", "cumsum", "cumprod", "logcumsumexp", "cummax",
    "cummin", "sort", "argsort", "msort", "normalize", "glu", "special_softmax",
    "special_log_softmax",
}  # fmt: skip
_DIM_OPS_DEFAULTS = {"normalize": 1, "msort": 0, "sort": -1, "argsort": -1, "glu": -1}


# the positions of the index ops' tensor arguments passed by keyword
_INDEX_KEYWORDS = {"source": 3, "src": 3, "index": 2}


# ops taking (x, ..., dim at position pos, ...): {name: (pos, default dim)}
_INDEX_OPS = {
    "index_select": (1, None), "gather": (1, None), "scatter": (1, None),
    "scatter_add": (1, None), "scatter_reduce": (1, None), "index_add": (1, None),
    "index_copy": (1, None), "index_fill": (1, None), "take_along_dim": (2, None),
    "topk": (2, -1), "kthvalue": (2, -1), "softmin": (1, None), "index_reduce": (1, None),
    "fft_fft": (2, -1), "fft_ifft": (2, -1), "fft_rfft": (2, -1), "fft_irfft": (2, -1),
    "fft_hfft": (2, -1), "fft_ihfft": (2, -1),
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


CONVOLUTIONS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
})  # fmt: skip
_BATCH_FIRST_OPS = {  # need the batch at dimension 0 (channels at 1); keep it there
    *CONVOLUTIONS, "group_norm", "batch_norm", "instance_norm", "max_pool1d", "max_pool2d",
    "max_pool3d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "interpolate", "upsample", "unfold", "pixel_shuffle", "pixel_unshuffle", "lp_pool1d",
    "lp_pool2d", "lp_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices",
    "max_pool3d_with_indices", "adaptive_max_pool1d_with_indices",
    "adaptive_max_pool2d_with_indices", "adaptive_max_pool3d_with_indices",
    "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
    "fractional_max_pool3d_with_indices", "max_unpool1d", "max_unpool2d", "max_unpool3d",
    "local_response_norm", "fold", "grid_sample", "affine_grid", "channel_shuffle",
}  # fmt: skip
# the rank of a batched input, for those of them that also take an unbatched one (whose first
# dimension is then the channels, which the op mixes: a convolution's output channels, im2col's
# patches, a pixel shuffle's groups of channels); pools act on each channel alone
_BATCHED_RANK = {
    "conv1d": 3, "conv2d": 4, "conv3d": 5, "conv_transpose1d": 3, "conv_transpose2d": 4,
    "conv_transpose3d": 5, "unfold": 4, "fold": 3, "pixel_shuffle": 4, "pixel_unshuffle": 4,
}  # fmt: skip


_LOSSES = {  # (each takes the samples first; with reduction="none" a value per sample)
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
    "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
    "hinge_embedding_loss", "cosine_embedding_loss", "margin_ranking_loss",
    "triplet_margin_loss", "triplet_margin_with_distance_loss", "multi_margin_loss",
    "multilabel_margin_loss",
}  # fmt: skip


# losses of each element of their two operands broadcast together (input, target, ...)
POINTWISE_LOSSES = frozenset({
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss", "gaussian_nll_loss",
    "soft_margin_loss",
})  # fmt: skip
CLASS_LOSSES = {"cross_entropy", "nll_loss"}  # [N, C, ...] scores: the classes' dim goes


SAMPLE_LOSSES = {  # one value per sample [N] (reduction="none")
    "cosine_embedding_loss", "margin_ranking_loss", "triplet_margin_loss",
    "triplet_margin_with_distance_loss", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
}  # fmt: skip


NON_TENSOR = {"size", "dim", "numel", "item", "tolist", "len", "stride", "data_ptr"}


# new tensors whose values do not depend on the input's (only its shape, dtype or device)
FACTORIES = {
    "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "empty_like", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    # sized by a 0-dim tensor read as an int (an RNN's initial state from its batch sizes)
    "zeros", "ones", "empty", "rand", "randn", "eye",
}  # fmt: skip


def reshaped(in_shape: Sequence[int], bd: BatchDim, n: int, out_shape: Sequence[int]) -> Info:
    """Where the batch lands when ``in_shape`` is viewed as ``out_shape`` (row-major)."""
    prefix = math.prod(in_shape[: bd.dim])
    acc = 1
    for e, size in enumerate(out_shape):
        if acc == prefix and (size == 0 if n == 0 else size > 0 and size % n == 0):
            return BatchDim(e, size // n if n else 1)  # (no samples: an empty dimension)
        if acc == prefix and n > 0 and size > 1:  # (the samples spread over this and more)
            return _grouped(math.prod(in_shape[bd.dim :]) // n, n, out_shape, e)
        acc *= size
        if acc > prefix:
            break
    return Lost(SPLIT)


SPLIT = f"a reshape split the batch dimension {MAY_REORDER}"


def _grouped(block: int, n: int, out_shape: Sequence[int], e: int) -> Info:
    """Samples of ``block`` elements each (row-major from dimension ``e`` of ``out_shape``),
    spread over dimensions ``e, e + 1, ...``: :class:`Grouped` where some of them hold
    whole samples' elements, each dimension's positions never straddling two samples."""
    for c in range(2, len(out_shape) - e + 1):
        rest = math.prod(out_shape[e + c :])
        if rest == 0 or block % rest or math.prod(out_shape[e : e + c]) != n * (block // rest):
            continue
        inner = block // rest
        if out_shape[e + c - 1] % inner == 0 and n * inner <= MAX_GROUPED:
            ids = tuple(p // inner for p in range(n * inner))  # (positions row-major)
            return Grouped(SPLIT, tuple(range(e, e + c)), tuple(out_shape[e : e + c]), ids)
        break
    return Lost(SPLIT)


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


# index ops that place their source's slices along one dimension, laid out as the input along
# the others: (x, dim, index, source)
_PLACED_ALONG = frozenset({"index_add", "index_copy", "index_reduce"})
# the index ops that place their source's values at the index's positions: (x, dim, index, src)
_SCATTERED = frozenset({"scatter", "scatter_add", "scatter_reduce"})


_REDUCED_AS = {"sum": "sum", "mean": "sum", "add": "sum", "amax": "pick", "amin": "pick",
               "prod": "product", "multiply": "product"}  # fmt: skip


def _reduced_as(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """How an index op puts the source's values together in the places the index names:
    ``"sum"`` (added up: ``index_add``, a sum or mean), ``"pick"`` (one chosen: amax, amin),
    ``"product"``; None where it only places them (``index_copy``, ``scatter``)."""
    if name in ("index_add", "scatter_add"):
        return "sum"
    if name not in ("scatter_reduce", "index_reduce", "scatter"):
        return None
    return _REDUCED_AS.get(dims_arg(args, kwargs, 4, "reduce"))


# ops that write a source into a slice of their input: (input, src, dim, ...)
_SCATTERS = frozenset({"select_scatter", "slice_scatter", "diagonal_scatter"})


def _scatter_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, bd: BatchDim,
    od: int,
) -> Info:  # fmt: skip
    """Where ``select_scatter``, ``slice_scatter`` and ``diagonal_scatter`` put the batch of
    their input (``which`` 0: kept where they write along other dimensions) or of their
    source (1: ``src`` is the output without the selected dimension, or a slice of it along
    another dimension). A write along the batch dimension puts values in some samples'
    places: lost."""
    if name == "diagonal_scatter":  # (input, src, offset, dim1, dim2)
        d1, d2 = dims_arg(args, kwargs, 3, "dim1"), dims_arg(args, kwargs, 4, "dim2")
        d1, d2 = 0 if d1 is None else int(d1), 1 if d2 is None else int(d2)
        dims = {norm_dim(d1, od), norm_dim(d2, od)}
        if which == 0 and bd.dim not in dims:
            return bd
        return Lost(f"{name} along the batch dimension, or of a batched diagonal {MAY_REORDER}")
    d = dims_arg(args, kwargs, 2, "dim")
    d = norm_dim(0 if d is None else int(d), od)
    if which == 0:
        return bd if d != bd.dim else Lost(f"{name} along the batch dimension {MAY_REORDER}")
    if name == "select_scatter":  # (src: the output without dimension d)
        return BatchDim(bd.dim + (bd.dim >= d), bd.inner)
    return bd if d != bd.dim else Lost(f"{name} of the samples along the batch {MAY_REORDER}")


def _is_tensor_unfold(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """``Tensor.unfold(dimension, size, step)``, by position or keyword (``F.unfold``, im2col,
    takes the batch first)."""
    by_keyword = bool({"dimension", "size", "step"} & set(kwargs))
    return name == "unfold" and (len(args) == 4 or by_keyword)


def result_dim(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, x: Tensor,
    bd: BatchDim, out: Tensor, k: int, n: int, tracker: BatchTracker,
) -> Info:  # fmt: skip
    """Where the batch of input ``x`` lands in output ``k``, ``out``.

    ``which`` is the position of ``x`` in ``args`` (also for an element of a list argument), or
    its keyword."""
    nd, od = x.dim(), out.dim()
    if name in OPERAND_NAMES and kwargs:  # (HF Bloom: alibi.baddbmm(batch1=q, batch2=k, ...))
        args, which = positional(name, args, kwargs, which)
    if name == "scaled_dot_product_attention":  # q, k, v, attn_mask [N, ..., L, S]
        if bd.dim >= nd - 2:
            return Lost("attention over the batch dimension")
        if kwargs.get("enable_gqa") and bd.dim >= nd - 3:  # (k's heads repeated for q's)
            return Lost("grouped-query attention with the samples among the heads")
        return BatchDim(od - (nd - bd.dim), bd.inner)
    if name == "multi_head_attention_forward":
        # query [L, N, E] (dim 1), key_padding_mask [N, S] (dim 0) -> ([L, N, E], [N, L, S])
        if which != "key_padding_mask" and x.dim() == 2:  # (an unbatched [L, E]: the samples
            return Lost("nn.MultiheadAttention of an unbatched input")  # along the sequence)
        expected = 0 if which == "key_padding_mask" else 1
        if bd.dim != expected or bd.inner != 1 or out.dim() < 2:
            return Lost(f"nn.MultiheadAttention with its batch elsewhere than documented {MAY_MIX}")
        return BatchDim(1 if k == 0 else 0)
    if name in RNN_OPS and isinstance(args[-1], bool) and not is_packed_rnn_op(name, args):
        # (input, hx, params, ..., batch_first) -> (output, h_n[, c_n]); hidden states [L, N, H]
        first = 0 if args[-1] else 1
        expected = first if which == 0 else 1
        if bd != BatchDim(expected):
            return Lost(f"{name} with its batch elsewhere than documented {MAY_MIX}")
        return BatchDim(first if k == 0 else 1)
    if name in RNN_CELL_OPS:
        return bd if bd == BatchDim(0) and nd == 2 else Lost(f"{name} needs the batch first")
    if name == "embedding_bag" and which in (2, "offsets"):  # offsets [N]: a bag per sample
        return bd if bd == BatchDim(0) and nd == 1 and k == 0 else Lost("embedding_bag offsets")
    if name == "embedding_bag" and which == "per_sample_weights":  # (laid out as the ids:
        # [N, L] weighs sample n's bag of L ids; with offsets, bags of a flat [B] in no
        # dimension of their own)
        ids = args[0] if args else kwargs.get("input")
        batched_bags = isinstance(ids, Tensor) and ids.dim() == 2 and nd == 2
        if bd.dim == 0 and batched_bags and k == 0:
            return bd
        # (each bag a weighted sum of table rows: of the samples' weights in it)
        return Combined("embedding_bag sums weights of several samples into a bag")
    if isinstance(which, str) and (name in _INDEX_OPS or name == "diff"):
        # (x.index_add(0, g, source=o); diff's prepend and append, laid out as the input)
        which = _INDEX_KEYWORDS.get(which, 3 if which in ("prepend", "append") else which)
    if name in _LAYER_OPERANDS and _is_layer_parameter(name, which):
        return _layer_parameter_result(name, args, kwargs, which, bd, nd, od)
    if which in PLACING_SOURCES.get(name, ()):
        return Lost(f"{name} places its source's values in an order of its own {MAY_REORDER}")
    if name in _SCATTERS:
        return _scatter_result(name, args, kwargs, which, bd, od)
    if name in _ELEMENTWISE:
        return _elementwise(name, args, kwargs, x, bd, out)
    if isinstance(which, str):  # (an operand by keyword: at its position, for the rules below)
        placed = as_positional(name, args, kwargs, which, op_name)
        if placed is None:
            return Lost(
                f"'{name}' with an operand passed by keyword ({which}=) leanprop cannot place: "
                f"it {MAY_MIX}"
            )
        args, which = placed
    # the layers' ops next (each layer's call passes here): no branch below takes their names
    if name in ("linear", "bilinear", "embedding", "embedding_bag"):
        if name in ("linear", "bilinear") and bd.dim == nd - 1:
            other = args[1 - which] if name == "bilinear" and which in (0, 1) else None
            if name == "linear" or tracker.info(other) is None:  # (each output a weighted
                # sum of the samples' values; a bilinear form with a batch-free other side)
                return Combined(f"a {name} layer sums over the batch dimension")
            return Lost(f"a bilinear layer multiplies samples together: it {MAY_MIX}")
        if name == "embedding_bag" and nd == 1:
            return Lost("embedding_bag with offsets")
        if name == "embedding" and which == 1 and bd.dim == 0:  # (rows of a batched table)
            return picks_by_index(name, args[0], x, bd, tracker)
        if name == "embedding" and which == 1:  # (its columns: the rows' last dimension)
            return BatchDim(od - 1, bd.inner)
        return bd
    rare = rare_result(name, args, kwargs, which, bd, nd, od) if name in RARE else None
    if rare is not None:  # (functions of matrices, distances, spectra, norms of matrices)
        return rare
    if name in ("layer_norm", "rms_norm"):
        k = len(args[1]) if isinstance(args[1], Sequence) else 1
        return Lost(f"{name} over the batch dimension") if bd.dim >= nd - k else bd
    if (name in _BATCH_FIRST_OPS and not _is_tensor_unfold(name, args, kwargs)) or name == "pad":
        if name == "pad":  # (x, pad): (before, after) pairs from the last dimension back
            at = 2 * (nd - 1 - bd.dim)
            if any(args[1][at : at + 2]):  # (rows of padding among the samples)
                return Lost("padding the batch dimension (may reorder samples)")
            return bd
        if name in ("pixel_shuffle", "pixel_unshuffle") and bd.dim < nd - 3:
            return bd  # (it acts on the last three dimensions: [*, C, H, W])
        if name in _GROUPABLE and which == 0:
            grouped = _samples_in_groups(name, args, kwargs, x, bd, n, out)
            if grouped is not None:
                return grouped
        if bd.dim != 0:
            return Lost(f"{name} needs the batch first")
        if bd.inner != 1 and not (name == "batch_norm" and _eval_mode(args, kwargs)):
            # (an eval-mode batch norm is an affine map of each row's channels: HF LeViT's
            # on [N*T, C])
            return Lost(f"{name} on samples flattened with another dimension")
        if nd < _BATCHED_RANK.get(name, 0):  # (an unbatched call: the samples are its channels)
            return Lost(f"{name} of an unbatched input, whose channels are the samples")
        return bd
    if name in VIEWS:
        return reshaped(x.shape, bd, n, out.shape)
    if name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = (norm_dim(int(d), nd) for d in (args[1], args[2]))
        return BatchDim({d0: d1, d1: d0}.get(bd.dim, bd.dim), bd.inner)
    if name == "T" and nd != 2:  # reverses every dimension
        return BatchDim(nd - 1 - bd.dim, bd.inner)
    if name in ("t", "mT", "mH", "adjoint", "H") or name == "T":
        swap = {nd - 1: nd - 2, nd - 2: nd - 1}
        return BatchDim(swap.get(bd.dim, bd.dim), bd.inner)
    if name == "permute":
        dims = args[1:] if len(args) > 2 or isinstance(args[1], int) else args[1]
        dims = [norm_dim(int(d), nd) for d in dims]
        return BatchDim(dims.index(bd.dim), bd.inner)
    if name in ("movedim", "moveaxis"):
        src, dst = args[1], args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        order = [None] * nd
        for s, t in zip(src, dst, strict=True):
            order[norm_dim(t, nd)] = norm_dim(s, nd)
        rest = iter(d for d in range(nd) if d not in order)
        order = [next(rest) if o is None else o for o in order]
        return BatchDim(order.index(bd.dim), bd.inner)
    if name == "unsqueeze":
        d = norm_dim(int(dims_arg(args, kwargs, 1, "dim")), od)
        return BatchDim(bd.dim + (d <= bd.dim), bd.inner)
    if name == "view_as_complex":  # [..., k, 2] -> [..., k]: the pairs' dimension goes
        return Lost("view_as_complex of the batch dimension") if bd.dim == nd - 1 else bd
    if name == "view_as_real":  # [..., k] -> [..., k, 2]: a dimension of pairs comes last
        return bd
    if name == "squeeze":
        d = dims_arg(args, kwargs, 1, "dim")
        dims = range(nd) if d is None else [d] if isinstance(d, int) else d
        gone = [norm_dim(k, nd) for k in dims if x.shape[k] == 1]
        if bd.dim in gone:
            return Lost("squeeze removed the batch dimension (a batch of one sample)")
        return BatchDim(bd.dim - sum(k < bd.dim for k in gone), bd.inner)
    if name in _PICKS:
        d = _SPLIT_DIMS.get(name, (0,))
        d = d[0] if len(d) == 1 or nd == 1 else d[1]  # (hsplit: a vector's columns are its 1)
        pos = 1 if name in ("select", "narrow", "unbind") else 2  # (x, dim, ...), (x, size, dim)
        if name not in _SPLIT_DIMS:
            d = norm_dim(int(dims_arg(args, kwargs, pos, "dim") or 0), nd)
        kept = d if name not in ("select", "unbind") else None  # (where the picks are)
        if d == bd.dim and name not in ("select", "unbind") and x.shape[d] == out.shape[d]:
            return bd  # (all of them, in order: x.narrow(0, 0, N), x.split(N))
        if d == bd.dim:
            length = 1 if name in ("select", "unbind") else out.shape[d]
            picks = picks_of(name, args, kwargs, x.shape[d], length, k)
            if isinstance(picks, range):  # (positions it computed: the samples they hold)
                picks = samples_at(picks, bd.inner)
            else:
                kept = None
            return Selected(f"{name} along the batch dimension", picks, kept)
        if name in ("select", "unbind"):
            return BatchDim(bd.dim - (d < bd.dim), bd.inner)
        return bd
    if name == "getitem":
        if which == 1 and rows_at(args[1], x):
            return bd  # (rows of a tensor at the samples' indices, codebook[ids]: [*ids, ...])
        return index_result(args[1], nd, bd, n, tracker)
    if name in _AT_LEAST:
        return _at_least(name, nd, bd)[1]  # (several inputs: ONE_OUTPUT_EACH)
    if name in _STACKED_AT_LEAST:
        return _stacked_result(name, nd, bd)
    if name in _LEGACY_SOFTMAX and dims_arg(args, kwargs, 1, "dim") is None:
        # (F.softmax(x) without a dimension: torch's legacy choice, the first of a 0-, 1- or
        # 3-d input, else the second)
        d = 0 if nd in (0, 1, 3) else 1
        return Lost(f"{name} along the batch dimension mixes samples") if d == bd.dim else bd
    if name in ("cat", "concat", "concatenate"):
        d = norm_dim(int(dims_arg(args, kwargs, 1, "dim", "axis") or 0), nd)
        return Lost(CONCATENATED) if d == bd.dim else bd
    if name == "stack":
        d = norm_dim(int(dims_arg(args, kwargs, 1, "dim") or 0), od)
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
        d = dims_arg(args, kwargs, pos, "dim", "axis")
        d = default if d is None else d
        along = d is not None and norm_dim(int(d), nd) == bd.dim
        reduced = _reduced_as(name, args, kwargs) if which == 3 and along else None
        if reduced == "product":  # (the source's samples put together: into groups)
            return Lost(f"{name} of the source {COMBINES_ALONG}")
        if reduced is not None:
            return Combined(f"{name} puts samples together", summed=reduced == "sum")
        if which == 3 and along:  # (placed: what meets them tells)
            return Lost(f"{name} places the source's samples along the batch {MAY_REORDER}")
        if which == 3 and d is not None and name in _PLACED_ALONG:  # (along another dimension)
            return bd
        if which in (2, 3) and d is not None and not along and name in _SCATTERED:  # (along
            # another dimension than the batch's:
            # each row of the output from the index's and source's same row, where the index
            # covers every row: a mixture of experts' gates, zeros.scatter(1, top, weights))
            index, rows = dims_arg(args, kwargs, 2, "index"), x.shape[bd.dim]
            laid_out = isinstance(index, Tensor) and index.dim() == nd == od
            # (an empty index places nothing: the output holds none of the operand's rows)
            if laid_out and index.numel() and index.shape[bd.dim] == rows:
                return bd if out.shape[bd.dim] == rows else Lost(f"{name} of some rows")
        if name == "index_select" and which == 2 and nd == 1 and d is not None:  # (rows at ids)
            return BatchDim(norm_dim(int(d), od), bd.inner)
        picks_at = 1 if name == "take_along_dim" else 2  # (input, indices, dim), (x, dim, index)
        if name in ("gather", "take_along_dim") and which == picks_at and d is not None:
            if along:
                return Lost(f"{name} along the batch dimension (or with a batched index)")
            return bd  # (the output is laid out as the index: each sample's picks its own)
        if name in ("gather", "take_along_dim") and which == 0 and along and nd == 1:
            return picks_by_index(name, dims_arg(args, kwargs, picks_at, "index"), x, bd, tracker)
        if which != 0 or d is None or norm_dim(int(d), nd) == bd.dim:
            return Lost(f"{name} along the batch dimension (or with a batched index)")
        return BatchDim(bd.dim, bd.inner) if name != "unfold" else bd
    if name == "renorm":  # (x, p, dim, maxnorm): each sub-tensor along dim scaled on its own
        d = dims_arg(args, kwargs, 2, "dim")
        if which != 0 or d is None or norm_dim(int(d), nd) != bd.dim:
            return Lost("renorm of sub-tensors that span the samples")
        return bd
    if name in STRIDED_VIEWS and which == 0:  # (its replay on the samples' ids, spread.py)
        return Lost(STRIDED_LOST)
    if _is_tensor_unfold(name, args, kwargs):
        along = norm_dim(int(dims_arg(args, kwargs, 1, "dimension")), nd)
        return Lost("unfold along the batch dimension") if along == bd.dim else bd
    if name in ("outer", "ger"):
        return BatchDim(which, bd.inner)
    if name == "diag_embed":
        placed = [dims_arg(args, kwargs, i, k) for i, k in ((2, "dim1"), (3, "dim2"))]
        if placed not in ([None, None], [-2, -1], [od - 2, od - 1]):
            return Lost("diag_embed into dimensions of its own choosing")
        return bd if bd.dim < nd - 1 else Lost("diag_embed of the batch dimension")
    if name == "repeat_interleave" and which == 0:  # (x, repeats, dim): each sample's rows
        d, reps = dims_arg(args, kwargs, 2, "dim"), dims_arg(args, kwargs, 1, "repeats")
        if d is None or norm_dim(int(d), nd) != bd.dim:
            return bd if d is not None else Lost("repeat_interleave of every element")
        if isinstance(reps, int) and not isinstance(reps, bool):
            return BatchDim(bd.dim, bd.inner * reps)
        return Lost("repeat_interleave along the batch dimension by counts")
    if name in ("quantile", "nanquantile"):  # (x, q, dim): between two values along dim
        d = dims_arg(args, kwargs, 2, "dim")
        if d is None or norm_dim(int(d), nd) == bd.dim:
            return Combined(f"{name} over the batch dimension", summed=False)
        dims = 0 if dims_arg(args, kwargs, 3, "keepdim") else 1
        q = dims_arg(args, kwargs, 1, "q")
        front = 1 if isinstance(q, Tensor) and q.dim() == 1 else 0  # (a quantile per q first)
        return BatchDim(front + bd.dim - dims * (norm_dim(int(d), nd) < bd.dim), bd.inner)
    if name == "gumbel_softmax":  # (logits, tau, hard, eps, dim=-1)
        if dim_or_last(args, kwargs, 4, nd) == bd.dim:
            return Lost("gumbel_softmax along the batch dimension mixes samples")
        return bd
    if name in _DIM_OPS:
        d = None if name == "msort" else dims_arg(args, kwargs, 1, "dim")
        d = _DIM_OPS_DEFAULTS.get(name) if d is None else d
        if d is None or norm_dim(int(d), nd) == bd.dim:
            return Lost(f"{name} along the batch dimension mixes samples")
        return bd
    if name in REORDERING:
        dims = reordered_dims(name, args, kwargs)
        if not dims or any(norm_dim(k, nd) == bd.dim for k in dims):
            return Lost(f"{name} along the batch dimension mixes samples")
        return bd
    if name in ("max", "min") and len(args) > 1 and isinstance(args[1], Tensor):
        return _elementwise(name, args, kwargs, x, bd, out)  # torch.max(a, b): elementwise
    if name in _REDUCTIONS:
        d = _reduced_dims(name, args, kwargs)
        summed = name not in _SELECTIONS
        if d is None:
            return Combined(f"{name} over all elements sums samples", summed)
        dims = [norm_dim(k, nd) for k in ([d] if isinstance(d, int) else d)]
        if bd.dim in dims:
            return Combined(f"{name} over the batch dimension sums samples", summed)
        if od == nd:  # keepdim
            return bd
        return BatchDim(bd.dim - sum(k < bd.dim for k in dims), bd.inner)
    if name in ("matmul", "mm", "bmm", "dot", "vdot", "mv", "linalg_matmul"):
        return matmul_result(args[0], args[1], which, bd, od)
    if name == "rmatmul":  # x.__rmatmul__(m) = m @ x
        return matmul_result(args[1], args[0], 1 - which, bd, od)
    if name == "addmv":
        if which == 0:
            return BatchDim(od - (nd - bd.dim), bd.inner)
        return matmul_result(args[1], args[2], which - 1, bd, od)
    if name in ("inner", "linalg_vecdot"):
        return _contraction_result(name, args, kwargs, which, nd, bd)
    if name in ("trapezoid", "trapz") and which == 0:  # (y, x or dx, dim=-1): a weighted sum
        d = dim_or_last(args, kwargs, 2, nd)
        if d == bd.dim:
            return Combined(f"{name} sums over the batch dimension")
        return BatchDim(bd.dim - (d < bd.dim), bd.inner)
    if name == "cumulative_trapezoid" and which == 0:  # (y, x or dx, dim=-1): running sums
        along = dim_or_last(args, kwargs, 2, nd) == bd.dim
        return Lost(f"'{name}' {UNKNOWN_ALONG}") if along else bd
    if name == "sum_to_size" and which == 0:  # (each dimension summed to 1, or dropped)
        size = list(args[1:]) if len(args) > 2 or isinstance(args[1], int) else list(args[1])
        lead = nd - len(size)
        if bd.dim < lead or (size[bd.dim - lead] == 1 and x.shape[bd.dim] != 1):
            return Combined("sum_to_size sums over the batch dimension")
        return BatchDim(bd.dim - lead, bd.inner)
    if name in ("stft", "istft") and which == 0:  # (signals [N, L] -> [N, F, T]; and back)
        batched_rank = 2 if name == "stft" else 3
        if nd == batched_rank and bd.dim == 0:
            return bd
        return Lost(f"{name} along the samples {MAY_MIX}")
    if name in ("linalg_multi_dot", "chain_matmul"):
        return _chain_result(args, which, nd, bd, od)
    if name == "addbmm" and which in (1, 2) and bd.dim == 0:
        return Combined("addbmm sums over the batch dimension")
    if name in ("addmm", "baddbmm", "addbmm"):
        if which == 0:
            return BatchDim(od - (nd - bd.dim), bd.inner)
        return matmul_result(args[1], args[2], which - 1, bd, od)
    if name == "einsum":
        return einsum_result(args, which - 1, bd)
    if name == "chunked_linear_cross_entropy":  # (h [*R, D], weight [V, D], target [*R])
        if which not in (0, 2, "target") or (which == 0 and bd.dim == nd - 1):
            return Lost(
                f"the LM head's loss of values that carry the batch in its features: it {MAY_MIX}"
            )
        if kwargs.get("reduction", "mean") != "none":
            return Combined("a loss reduces over samples")
        rows = x.shape[:-1] if which == 0 else x.shape  # (a loss per row, shaped as target)
        return reshaped(rows, bd, n, out.shape)
    if name in _LOSSES:
        if kwargs.get("distance_function") is not None:  # (a user's function: ops not seen)
            return Lost(f"{name} with a distance_function (its ops are not followed)")
        if name in SAMPLE_LOSSES and bd.dim != 0:  # (over each sample's features [N, ...])
            return Lost(f"{name} with the batch not first")
        if name in SAMPLE_LOSSES and nd == 1 and name != "margin_ranking_loss":
            # (an unbatched call, one sample's scores or features [C]: the samples' values)
            return Lost(f"{name} of an unbatched input, whose features are the samples")
        if name in CLASS_LOSSES and which == 0 and bd.dim == (1 if nd > 1 else 0):
            # (the classes' dimension: [N, C, ...] -> [N, ...]; a vector's only one)
            return Lost(f"{name} over the batch dimension (taken as the classes')")
        if name in POINTWISE_LOSSES and _batches_apart(name, args, kwargs, which, bd, tracker):
            return Lost(f"'{name}' of operands broadcast with their batches apart: it {MAY_MIX}")
        if kwargs.get("reduction", "mean") != "none":
            return Combined("a loss reduces over samples")
        if name in SAMPLE_LOSSES:  # [N, ...] -> [N]
            return bd
        if name not in CLASS_LOSSES or which == 1:  # elementwise, or the targets [N, ...]
            return bd
        if which != 0:
            return Lost(f"{name}'s argument {which}")
        return BatchDim(bd.dim - (bd.dim > 1), bd.inner)
    if name == "take" and which == 0 and nd > 1:  # (flat positions: laid out as the index)
        return Lost(f"take of a tensor of several dimensions (flat positions) {MAY_REORDER}")
    if name == "masked_select" and (which in (1, "mask") or nd > 1):  # (flat positions
        # across samples, whichever operand carries them: each value one sample's, a masked
        # token loss)
        return Lost(
            f"masked_select of a tensor of several dimensions (flat positions) {MAY_REORDER}"
        )
    if name in ("take", "masked_select") and which == 0 and nd == 1:  # (losses [N] picked)
        return picks_by_index(name, dims_arg(args, kwargs, 1, "index", "mask"), x, bd, tracker)
    if name in ("index_put", "put") and which == 2:
        # (x, indices, values, accumulate): the values put in x's places, or added into them
        if dims_arg(args, kwargs, 3, "accumulate"):
            return Combined(f"{name} with accumulate=True adds samples together")
        return Lost(f"{name} puts the samples' values in other places (may reorder samples)")
    if name == "tensordot":
        return tensordot_result(args, kwargs, which, bd)
    if name == "kron":
        return kron_result(args, which, x, bd, out)
    if name in ("one_hot", "vander", "linalg_vander"):  # [*S] -> [*S, K]: one comes last
        return bd
    if name == "addr" and which in (1, 2):  # (M, u, v) -> M + u v^T: u's
        # entries along the rows, v's along the columns (M: as elementwise, below)
        return BatchDim(0 if which == 1 else 1, bd.inner)
    if name == "ctc_loss":
        return _ctc_result(args, kwargs, which, bd, nd)
    if name == "conv_tbc":  # (time, batch, channels): a convolution over time
        if which != 0 or bd.dim != 1 or nd != 3:
            return Lost("conv_tbc with its batch elsewhere than its input's dim 1")
        return bd
    if name == "cross" and dims_arg(args, kwargs, 2, "dim") is None:
        # (torch.cross without a dimension, deprecated: along the first dimension of size 3
        # of its first operand, which a batch of three may be; both have the same rank)
        along = next((d for d, size in enumerate(args[0].shape) if size == 3), None)
        if along is None or along == bd.dim:
            return Lost(
                f"torch.cross without a dimension, along the batch's (of size 3), {MAY_MIX}"
            )
        return _elementwise(name, args, kwargs, x, bd, out)
    if acts_along_batch(name, args, kwargs, nd, bd, op_name):  # (torch.cross(a, b, 0))
        return Lost(f"'{name}' {UNKNOWN_ALONG}")
    if od > max(t.dim() for t in tensors_in(args, kwargs)):  # (not broadcast from the right:
        # no operand has the output's dimensions; torch.vander appends one)
        return Lost(f"'{name}' (an op leanprop does not know) added dimensions: it {MAY_MIX}")
    return _elementwise(name, args, kwargs, x, bd, out)


# layer ops' operands other than the data (parameters, or tensors in their place), by position
# and keyword: (x, weight, bias), bilinear's (x1, x2, weight, bias), the norms' (x, running
# mean, running var, weight, bias), group_norm's (x, groups, weight, bias), prelu's (x, weight)
_LAYER_OPERANDS = {
    **{name: (1, 2) for name in ("linear", *CONVOLUTIONS)},
    "bilinear": (2, 3), "batch_norm": (1, 2, 3, 4), "instance_norm": (1, 2, 3, 4),
    "group_norm": (2, 3), "prelu": (1,), "embedding_bag": (1,),
}  # fmt: skip
_PARAMETER_KEYWORDS = frozenset({"weight", "bias", "running_mean", "running_var"})


def _is_layer_parameter(name: str, which: int | str) -> bool:
    return which in _PARAMETER_KEYWORDS or which in _LAYER_OPERANDS[name]


def _layer_parameter_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, bd: BatchDim,
    nd: int, od: int,
) -> Info:  # fmt: skip
    """Where the batch of a layer's weight or bias computed from the batch lands: a linear
    layer's output features (its weight's rows ``[O, I]``; its bias broadcast from the
    right), a convolution's output channels (its weight's ``[O, C/G, *K]`` first dimension,
    a transposed one's second without groups; its bias ``[O]``), a norm's or prelu's
    channels (dimension 1). Where the layer contracts it (a linear layer's input features, a
    convolution's input channels or kernel offsets), the samples are summed together;
    embedding_bag's table rows are picked and pooled into bags: lost. (Such a parameter is
    not the module's: the per-sample rules see only the data's batch.)"""
    is_bias = which == "bias" or (
        name in ("linear", "bilinear", *CONVOLUTIONS) and which == _LAYER_OPERANDS[name][-1]
    )
    summed = Combined(f"{name} contracts its weight's batch dimension: sums samples together")
    if name in ("linear", "bilinear"):
        if is_bias:
            return BatchDim(od - (nd - bd.dim), bd.inner)
        return BatchDim(od - 1, bd.inner) if bd.dim == 0 and nd >= 2 else summed
    if name in CONVOLUTIONS:  # (output [N, O, *S] or unbatched [O, *S])
        channels = od - 1 - int(name[-2])
        if is_bias:
            return BatchDim(channels, bd.inner)
        if "transpose" not in name:
            out_dim = 0  # (weight [O, C/G, *K])
        else:  # (weight [C, O/G, *K]: with groups, each group's own output channels)
            out_dim = 1 if dims_arg(args, kwargs, 6, "groups") in (None, 1) else None
        return BatchDim(channels, bd.inner) if bd.dim == out_dim else summed
    if name in ("batch_norm", "instance_norm", "group_norm", "prelu"):
        return BatchDim(1 if od >= 2 else 0, bd.inner)  # (per channel [C])
    return Lost(f"{name} with a table computed from the batch: its rows pooled into bags")


CONCATENATED = "concatenation along the batch dimension"


def _chain_result(args: Sequence[Any], which: int, nd: int, bd: BatchDim, od: int) -> Info:
    """``multi_dot([A, B, ..., Z])`` / ``chain_matmul``: a product of matrices (the first and
    last may be vectors): a batch in the first's rows or the last's columns stays (first or
    last output dimension); any other is summed over by a neighbour's product."""
    mats = args[0] if len(args) == 1 and isinstance(args[0], list | tuple) else args
    last = len(mats) - 1
    if which == 0 and nd == 2 and bd.dim == 0:
        return BatchDim(0, bd.inner)
    if which == last and nd == 2 and bd.dim == 1:
        return BatchDim(od - 1, bd.inner)
    return Combined("a product of matrices sums over the batch dimension")


def batch_norm_training(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The ``training`` argument of a ``batch_norm`` call (torch's or ``F``'s: sixth in
    both; False where not given)."""
    return kwargs.get("training", args[5] if len(args) > 5 else False)


def _eval_mode(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a ``batch_norm`` call uses its running statistics only, without updating
    them."""
    training = batch_norm_training(args, kwargs)
    return isinstance(training, bool) and not training


def _batches_apart(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, bd: BatchDim,
    tracker: BatchTracker,
) -> bool:  # fmt: skip
    """Whether a pointwise loss's operands that carry the batch (input, target, and the
    weights broadcast with them) hold it in different dimensions of their broadcast shape
    (``mse_loss(p [N, 1], y [N])``: each sample's prediction against every sample's target;
    ``binary_cross_entropy_with_logits(h [N, C], y, weight=w [N])``: every sample's weight
    on each sample's classes)."""
    operands = _pointwise_loss_operands(name, args, kwargs)
    own = operands.get(which)
    if own is None:
        return False
    rank = max(t.dim() for t in operands.values())
    here = rank - (own.dim() - bd.dim)
    for key, other in operands.items():
        info = tracker.info(other) if key != which else None
        if isinstance(info, BatchDim) and rank - (other.dim() - info.dim) != here:
            return True
    return False


def _pointwise_loss_operands(
    name: str, args: Sequence[Any], kwargs: dict[str, Any]
) -> dict[int | str, Tensor]:
    """A pointwise loss's tensors broadcast together, by position or keyword (as the batch
    tracker numbers them): input and target; ``weight`` and ``pos_weight`` of the binary
    cross-entropies (``gaussian_nll_loss``'s ``var`` broadcasts its own way: not read)."""
    found: dict[int | str, Tensor] = {}
    places: tuple[tuple[int, str], ...] = ((0, "input"), (1, "target"))
    if name == "binary_cross_entropy":
        places += ((2, "weight"),)
    elif name == "binary_cross_entropy_with_logits":
        # (pos_weight: torch's by position at 3, torch.nn.functional's at 6)
        places += ((2, "weight"), (3, "pos_weight"), (6, "pos_weight"))
    for i, key in places:
        t = args[i] if i < len(args) else kwargs.get(key)
        if isinstance(t, Tensor):
            found[i if i < len(args) else (0 if key == "input" else key)] = t
    return found


_GROUPABLE = frozenset({"conv1d", "conv2d", "conv3d"})


def _samples_in_groups(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], x: Tensor, bd: BatchDim, n: int,
    out: Tensor,
) -> Info | None:  # fmt: skip
    """A convolution whose groups each hold channels of one sample: the samples flattened
    into the channels (``[B, N*C, *S]``, or unbatched ``[N*C, *S]``) with ``groups`` a
    multiple of N (StyleGAN2's modulated convolution with a weight per sample, a depthwise
    one over samples as channels). Each sample's output channels are its own groups':
    ``BatchDim(channels, O / N)``. None for any other layout."""
    channels = x.dim() - int(name[-2]) - 1
    groups = dims_arg(args, kwargs, 6, "groups")
    groups = 1 if groups is None else int(groups)
    if bd.dim != channels or not n or x.shape[channels] % groups:
        return None
    per_group = x.shape[channels] // groups
    if bd.inner % per_group or out.shape[channels] % n:  # (a group across two samples)
        return None
    return BatchDim(channels, out.shape[channels] // n)


def _contraction_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int, nd: int, bd: BatchDim
) -> Info:  # fmt: skip
    """``inner(a, b)`` (``[*A, K] x [*B, K] -> [*A, *B]``; a scalar operand: a product) and
    ``linalg.vecdot(a, b, dim=-1)`` (broadcast, then summed along ``dim``): a batch in the
    dimension summed over gives a sum of the samples' terms; elsewhere it stays."""
    a, b = args[0], args[1]
    if name == "inner":
        if a.dim() == 0 or b.dim() == 0:  # (a product: each value its own sample's)
            return BatchDim(bd.dim + (b.dim() if which == 0 and b.dim() == 0 else 0), bd.inner)
        if bd.dim == nd - 1:
            return Combined("inner sums over the batch dimension")
        return BatchDim(bd.dim + (a.dim() - 1 if which == 1 else 0), bd.inner)
    rank = max(a.dim(), b.dim())
    at = rank - (nd - bd.dim)  # (the batch's dimension in the broadcast shape)
    summed = dim_or_last(args, kwargs, 2, rank)
    if at == summed:
        return Combined("vecdot sums over the batch dimension")
    return BatchDim(at - (summed < at), bd.inner)


_LEGACY_SOFTMAX = frozenset({"softmax", "log_softmax", "softmin"})
# ops whose output k is their input k's alone, where they take several
ONE_OUTPUT_EACH = frozenset({"atleast_1d", "atleast_2d", "atleast_3d"})
# the rank each makes its inputs at least: a vector [K] becomes [1, K], or [1, K, 1]; a matrix
# [A, B] becomes [A, B, 1] for atleast_3d
_AT_LEAST = {"atleast_1d": 1, "atleast_2d": 2, "atleast_3d": 3}
# the ops concatenating their inputs so made (column_stack: vectors as columns [K, 1]), and the
# dimension along which (hstack: a vector's only one, else the second)
_STACKED_AT_LEAST = {"hstack": 1, "vstack": 2, "row_stack": 2, "dstack": 3, "column_stack": 2}


def _at_least(name: str, nd: int, bd: BatchDim) -> tuple[int, BatchDim]:
    """The rank of an input ``[...]`` of ``nd`` dimensions made at least ``name``'s, and
    where its batch ``bd`` is then."""
    least = _AT_LEAST.get(name, _STACKED_AT_LEAST.get(name))
    if name == "column_stack":  # (vectors and scalars as columns [K, 1]; the rest as they are)
        return max(nd, 2), bd
    if nd >= least:
        return nd, bd
    return least, BatchDim(bd.dim + (nd == 1), bd.inner)  # (a vector's entries go second)


def _stacked_result(name: str, nd: int, bd: BatchDim) -> Info:
    """``hstack``, ``vstack``/``row_stack``, ``dstack``, ``column_stack``: their inputs made
    at least 1-, 2-, 3-d (``_at_least``), concatenated along the second dimension (hstack:
    along a vector's only one), the first, the third, the second."""
    rank, placed = _at_least(name, nd, bd)
    along = {"vstack": 0, "row_stack": 0, "dstack": 2}.get(name, 0 if rank == 1 else 1)
    return Lost(CONCATENATED) if placed.dim == along else placed


REJOINED = "parts of the batch put together"


def _ctc_result(
    args: Sequence[Any], kwargs: dict[str, Any], which: int, bd: BatchDim, nd: int
) -> Info:
    """``ctc_loss(log_probs [T, N, C], targets [N, S], input_lengths [N], target_lengths [N],
    blank, reduction)``: a loss per sample ``[N]`` (``reduction="none"``), else their sum."""
    expected = (3, 1) if which == 0 else (2, 0) if which == 1 else (1, 0)
    if (nd, bd.dim) != expected or bd.inner != 1:
        return Lost(
            f"ctc_loss with its batch elsewhere than documented ([T, N, C], [N, S], [N]) {MAY_MIX}"
        )
    if kwargs.get("reduction", args[5] if len(args) > 5 else "mean") != "none":
        return Combined("a loss reduces over samples")
    return BatchDim(0)


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
    return Lost(f"'{name}' (an op leanprop does not know) changed the shape: it {MAY_MIX}")


def tensors_in(args: Iterable[Any], kwargs: dict[str, Any]) -> list[Tensor]:
    out: list[Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out.extend(t for t in a if isinstance(t, Tensor))
    return out


def combines(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """A loss with a reduction, or a reduction over every element: whatever dimension held the
    samples, they are summed together."""
    if name in _LOSSES:
        return kwargs.get("reduction", "mean") != "none"
    return name in _REDUCTIONS and _reduced_dims(name, args, kwargs) is None


def _reduced_dims(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The dimensions a reduction's call names; None where it reduces every element."""
    # (torch.linalg.vector_norm(x, ord, dim, keepdim): the order first)
    at = 2 if name in ("linalg_vector_norm", "linalg_norm") else 1
    d = dims_arg(args, kwargs, at, "dim", "axis")
    d = None if isinstance(d, bool) or d == [] or d == () else d  # std(x, True): unbiased
    if name in ("norm", "std", "var") and not isinstance(d, int | list | tuple):
        return None  # (norm(x, 2): the order, not a dimension)
    return d
