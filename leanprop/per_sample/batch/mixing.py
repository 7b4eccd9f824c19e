"""Whether an op's output mixes the samples, so that no loss computed from it has per-sample
parts: an op acting along the batch (a softmax over it, a variance, a distance between
samples), a non-linear function of a value summed over the samples, or operands that hold
the samples differently meeting (``o @ o.T``, ``o * o.flip(0)``, a pair's halves)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from .infos import COMBINES_ALONG, MAY_MIX, MAY_REORDER, BatchDim, Combined, Info, Lost, Selected
from .matrices import FFTS, MATRIX_FUNCTIONS
from .rules import CLASS_LOSSES, CONVOLUTIONS, SAMPLE_LOSSES, VIEWS

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
    "linalg_norm", "cosine_similarity", "pairwise_distance", *FFTS,
    "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft", "renorm",
    *MATRIX_FUNCTIONS,
    # (losses over the classes, or over each sample's features, taking the samples for them;
    # windows of neighbouring samples: x.unfold(0, 2, 1))
    *CLASS_LOSSES, *SAMPLE_LOSSES, "unfold",
})  # fmt: skip


# ops taking the batch first whose results mix the samples where it is elsewhere: with the
# samples as channels (a convolution sums over channels, a group norm normalises groups of
# them), or as positions (a pool averages neighbours, an interpolation weighs them)
_MIXES_AS_CHANNELS = frozenset({*CONVOLUTIONS, "local_response_norm", "group_norm"})


_MIXES_AS_POSITIONS = frozenset({
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
    "adaptive_avg_pool3d", "interpolate", "upsample", "lp_pool1d", "lp_pool2d", "lp_pool3d",
    *_MIXES_AS_CHANNELS,
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
    "max", "min", "amax", "amin", "sort", "msort", "topk", "kthvalue", "median", "nanmedian",
    "cummax", "cummin", "pad", "sum_to_size", "relu", "relu6", "leaky_relu", "hardtanh",
    "clamp", "clip", "abs", "maximum", "minimum", "fmax", "fmin", *VIEWS,
})  # fmt: skip


_MULTILINEAR = frozenset({
    "mul", "matmul", "mm", "bmm", "mv", "dot", "vdot", "inner", "outer", "ger", "einsum",
    "linear", "addmm", "baddbmm", "addbmm", "tensordot", "kron", "truediv", "div",
})  # fmt: skip


def _spatial_rank(name: str, nd: int) -> int:
    """The dimensions a convolution, pool or interpolation acts across: its name's (``1d``,
    ``2d``, ``3d``), else all after the batch and channels."""
    for k in (1, 2, 3):
        if f"{k}d" in name:
            return k
    return max(nd - 2, 1)


def _samples_off_front(name: str, which: int | str, bd: BatchDim, nd: int) -> bool:
    """Whether an op taking the batch first (``[N, C, *S]``, or unbatched ``[C, *S]``; ``nd``
    dimensions, as its output's) has the samples where it combines values: in its channels
    (a convolution sums over them, a group norm normalises them together), or among the
    positions it pools or interpolates."""
    if which != 0 or not (name in _MIXES_AS_CHANNELS or name in _MIXES_AS_POSITIONS):
        return False
    k = _spatial_rank(name, nd)
    if name in _MIXES_AS_CHANNELS:  # (only the batch of a batched input is kept apart)
        return not (bd.dim == 0 and nd == k + 2)
    return bd.dim >= nd - k


def mixes_itself(name: str, which: int | str, bd: BatchDim, r: Info, out: Tensor) -> str | None:
    """Why an op mixes the samples of its operand ``which`` (batch at ``bd``; its result's
    ``r``, in ``out``) by acting along the batch (None where it does not): a softmax or a
    normalisation over the samples, a convolution taking them for channels, a variance over
    them, a norm over them that is not one value for the batch (the norm of everything is a
    function of the summed squares, as any function of the summed loss)."""
    where_lost = (  # (an operand by keyword: the shape-only rule's Lost, no mixing told)
        name in _MIXES_WHERE_LOST
        and isinstance(which, int)
        and (which == 0 or name not in MATRIX_FUNCTIONS)
    )
    off_front = _samples_off_front(name, which, bd, out.dim())
    if type(r) is Lost and (
        name in _MIXES or where_lost or off_front or r.reason.endswith((MAY_MIX, COMBINES_ALONG))
    ):
        return r.reason
    if type(r) is Combined and (
        name in _CENTRING or (name in _CURVED_REDUCTIONS and out.numel() > 1)
    ):
        return f"'{name}' over the batch dimension mixes samples"
    return None


def reads_summed(
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
SIDE_BY_SIDE = frozenset(
    {"cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack",
     "row_stack"}
)  # fmt: skip


_DIFFERENT_PLACES = "inputs of one op carry the batch in different places or orders"


def holds_samples(info: Info) -> bool:
    """Whether ``info`` says where the samples are, or how they were moved (reordered, or
    put in different places): not where leanprop cannot tell (an op it does not know, a
    selection), whose meeting with others says nothing of mixing."""
    if type(info) is not Lost:
        return not isinstance(info, Combined)
    return info.reason == _DIFFERENT_PLACES or info.reason.endswith(
        ("mixes samples", "reorders samples", MAY_REORDER)
    )


def mixing_by_joining(
    name: str, batched: list[tuple[int | str, Tensor, Info]], res: Info, held: set[Info],
    live: Callable[[Tensor], bool] = lambda t: t.requires_grad,
) -> str | None:  # fmt: skip
    """Why an op's output (which requires grad; ``res``: where its batch is) mixes samples
    by joining its operands ``batched`` (none of which does already): a value over all
    samples that requires grad is joined with one that carries the batch (``o - o.mean(0)``);
    or operands that require grad reach the output holding the samples differently
    (``held``: where each one's batch went; ``o @ o.T``, ``o * o.flip(0)``: each sample's
    values with another's). None where it does not. ``live``: whether an operand's values
    reach the loss with gradients (it requires grad, or autograd does not record)."""
    over_all = [i for _, t, i in batched if isinstance(i, Combined) and live(t)]
    per_sample = [i for _, _, i in batched if type(i) not in (Lost, Combined)]
    if over_all and per_sample:
        return (
            f"'{name}' joins each sample's values with a value over all samples "
            f"({over_all[0].reason})"
        )
    if name in SIDE_BY_SIDE:  # (each sample's values stay its own: mixing where a sample's
        # values are put beside another's, stack([s, s.flip(0)], 1), not where parts of the
        # batch are put back together, cat([o[:k], o[k:]]))
        moved = [h for h in held if not isinstance(h, BatchDim | Selected)]
        if moved and any(isinstance(h, BatchDim) for h in held):
            return f"'{name}' puts each sample's values beside another's ({moved[0].reason})"
        return None
    if type(res) not in (Lost, Combined):
        return None
    given = {i for _, t, i in batched if holds_samples(i) and live(t)}
    if len(held) > 1 or (len(given) > 1 and type(res) is Lost):  # (an op it cannot follow)
        return f"'{name}': {_DIFFERENT_PLACES} (each sample's values with another's)"
    return None


def merge_infos(results: set[Info]) -> Info:
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


def mixes_unplaced(name: str, info: Lost, numel: int) -> str | None:
    """Why an op acting along a dimension mixes samples held in no known place (``info``,
    a plain :class:`Lost` that holds them: ``o.repeat(...)``, ``kron(ones, o)``), where it
    is one that mixes them along the batch: leanprop cannot tell the batch is not that
    dimension. Also values chosen from different samples (``o.amax(0)``, ``numel`` of them)
    weighed against each other (a softmax over them: each value's weight reads the others').
    None for any other."""
    across = name in _MIXES or name in _MIXES_WHERE_LOST or name in _CENTRING
    if type(info) is Combined and not info.summed and numel > 1:
        if across or name in ("logsumexp", "special_logsumexp"):
            return f"'{name}' across values chosen from different samples ({info.reason})"
        return None
    if type(info) is not Lost or not holds_samples(info):
        return None
    if across:
        return f"'{name}' on samples in places leanprop cannot tell ({info.reason})"
    return None
