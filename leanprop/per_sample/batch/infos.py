"""What a tracker says of a tensor: where its batch is (:class:`BatchDim`), or why no single
dimension holds the samples (:class:`Lost` and its kinds: summed together, some samples picked,
samples in another order, packed into a ``PackedSequence``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class BatchDim:
    """The batch is dimension ``dim``, of size ``N * inner`` with the sample as outer factor."""

    dim: int
    inner: int = 1


# the end of a reason where an op combines the samples along the batch other than by a sum
# or a pick (a product of them: scatter_reduce's "prod"): its result mixes them
COMBINES_ALONG = "combines samples along the batch dimension"

# the end of a reason where leanprop cannot tell what an op did with the samples (an op it
# does not know changed the shape, arguments it cannot read): its result is taken to mix them
MAY_MIX = "may mix samples"

# the end of a reason where the samples are moved to places leanprop cannot tell (their
# meeting with each other, or with other samples, may mix them: mixing.holds_samples)
MAY_REORDER = "(may reorder samples)"


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
    ``o[labels == 1]``): ``picks`` says which (the sample each position of dimension ``dim``
    holds, a ``range`` where they are evenly spaced; equal for the same pick, however
    spelled; of samples flattened with another dimension, each sample as often as it has
    positions there), so that values of two different picks meeting later (a pair's
    halves, ``o[:k] - o[k:]``) are told as different samples meeting. Ops on a pick are
    followed as on a batch of its samples (``o[:4][:2]`` picks ``range(2)``), where ``dim``
    holds them. ``dim`` is None where no dimension does (one sample picked by an integer;
    positions of samples flattened with another dimension; a pick leanprop does not follow
    further): the picks stay as they are."""

    picks: Any = None
    dim: int | None = None

    def __post_init__(self) -> None:  # (one sample, however often: in no dimension)
        p = self.picks
        if isinstance(p, range | tuple) and len(set(p)) == 1:
            object.__setattr__(self, "picks", range(p[0], p[0] + 1))
            object.__setattr__(self, "dim", None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selected) and self.picks == other.picks and self.dim == other.dim

    def __hash__(self) -> int:
        return hash((Selected, self.picks, self.dim))


def samples_at(positions: Sequence[int], inner: int) -> range | tuple[int, ...]:
    """The sample each of ``positions`` along a batch dimension of ``N * inner`` holds (as
    :func:`as_picks`)."""
    return as_picks(positions if inner == 1 else [p // inner for p in positions])


def as_picks(positions: Sequence[int]) -> range | tuple[int, ...]:
    """``positions`` as a ``range`` where they are evenly spaced and increasing."""
    if len(positions) < 2:
        return range(positions[0], positions[0] + 1) if positions else range(0)
    step = positions[1] - positions[0]
    spaced = range(positions[0], positions[-1] + 1, step) if step > 0 else range(0)
    return spaced if list(spaced) == list(positions) else tuple(positions)


MAX_GROUPED = 4096  # (samples spread over more positions than that: not followed)


@dataclass(frozen=True)
class Grouped(Lost):
    """The samples spread over several dimensions: split into groups by a reshape
    (``o.view(G, N // G, ...)``), or picks of them put side by side (a pair's halves
    ``stack([l[:k], l[k:]], 1)``). ``ids`` says which sample each position holds (row-major
    over the dimensions ``dims``, of ``sizes``; constant along the others). Followed dimension
    by dimension (``spread.py``), so that a function of each group's sum, or a softmax or a
    cross-entropy within each group or pair, is told as mixing; a pick along them says
    which samples it holds."""

    dims: tuple[int, ...]
    sizes: tuple[int, ...]
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Reordered(Lost):
    """Dimension ``dim`` holds the samples in another order: position ``j`` holds sample
    ``order[j]`` (a packed sequence sorts its samples by length; ``flip``, ``roll``). A
    :class:`Lost` to every consumer but the ops that restore the order or pack the samples."""

    dim: int
    order: tuple[int, ...]


@dataclass(frozen=True)
class Packed(Lost):
    """The data of a ``PackedSequence``: rows are time steps of samples, sorted by length as
    ``order`` says (its ``sorted_indices``). A :class:`Lost` to every consumer but the RNN
    that takes it, elementwise ops, and ``pad_packed_sequence``."""

    order: tuple[int, ...]


Info = BatchDim | Lost


REORDERED = (
    "samples in another order (an index_select, a flip or roll along the batch, or sorted by "
    "length for a packed sequence)"
)


PACKED = (
    "the samples packed into a PackedSequence's data (run the RNN on it, or "
    "pad_packed_sequence it first)"
)


def packed_data(order: tuple[int, ...]) -> Packed:
    """Where the batch is in a PackedSequence's data whose ``sorted_indices`` are ``order``."""
    return Packed(PACKED, order)


def in_order(dim: int, order: tuple[int, ...]) -> Info:
    if order == tuple(range(len(order))):
        return BatchDim(dim)
    return Reordered(REORDERED, dim, order)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def dims_arg(args: Sequence[Any], kwargs: dict[str, Any], pos: int, *names: str) -> Any:
    for k in names:
        if k in kwargs:
            return kwargs[k]
    return args[pos] if len(args) > pos else None


def dim_or_last(args: Sequence[Any], kwargs: dict[str, Any], pos: int, ndim: int) -> int:
    """An op's ``dim`` argument (at position ``pos``, or by keyword), the last dimension where
    it is not given, as a non-negative index of ``ndim`` dimensions."""
    d = dims_arg(args, kwargs, pos, "dim")
    return norm_dim(-1 if d is None else int(d), ndim)


def to_front(t: Tensor, info: BatchDim, n: int) -> Tensor:
    """``t`` with its batch moved to dimension 0 as ``[N, ...]`` (``inner`` split off)."""
    if info.dim != 0:
        t = t.movedim(info.dim, 0)
    if info.inner != 1:
        t = t.reshape(n, info.inner, *t.shape[1:])
    return t


def how_to_keep(info: Lost) -> str:
    """What a user can do where a layer gets ``info``'s input (no dimension holding the
    batch in order), as a sentence."""
    if isinstance(info, Selected):
        return (
            "Only some of the samples reach it, and a layer run on part of the batch has no "
            "per-sample rule yet: run it on the whole batch and pick from its output (e.g. "
            "torch.where(mask[:, None], head_a(h), head_b(h)) instead of head_a(h[mask]))."
        )
    if isinstance(info, Reordered):
        return "Apply it before the samples are reordered, or put them back in order first."
    if isinstance(info, Grouped):
        return "Reshape the samples back into one dimension ([N, ...]) before this module."
    return (
        "Make the batch a dimension of its own before this module (e.g. keep [N, T, D] "
        "instead of flattening samples together), or report the op that lost it."
    )
