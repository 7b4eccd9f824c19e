"""What can be requested from :func:`leanprop.per_sample`.

Notation: N is the batch size, ``c_n`` the *contribution* of sample ``n`` to the
batch gradient ``p.grad`` of a parameter ``p``, so that ``sum_n c_n == p.grad``.

* For a loss reduced with ``reduction="sum"``, ``c_n = grad f_n`` (the gradient of sample n's loss).
* For ``reduction="mean"``, ``c_n = grad f_n / N``.

This is BackPACK's definition, so results can be compared with it directly. Multiply by N
to get the gradients of the per-sample losses from a mean-reduced loss.

Each quantity is stored on the parameter under the attribute named by ``attr``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..errors import LeanpropValueError


@dataclass(frozen=True)
class Quantity:
    """Base of the requestable quantities; use one of the subclasses."""

    attr: ClassVar[str] = ""

    @property
    def savefield(self) -> str:
        """The attribute the results are stored under (BackPACK's name for it)."""
        return self.attr


def check_subsampling(owner: str, subsampling: object) -> tuple[int, ...] | None:
    """``subsampling`` as a tuple of sample indices (None: all samples); clear errors."""
    if subsampling is None:
        return None
    if isinstance(subsampling, (str, bytes)) or not hasattr(subsampling, "__iter__"):
        raise LeanpropValueError(
            f"{owner}(subsampling={subsampling!r}): pass a list of sample indices, e.g. [0, 2]."
        )
    out = tuple(subsampling)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise LeanpropValueError(
            f"{owner}(subsampling={subsampling!r}): the sample indices must be ints."
        )
    return out


def subsample(value: Tensor, indices: tuple[int, ...] | None, dim: int, owner: str) -> Tensor:
    """``value`` restricted to the samples ``indices`` along ``dim`` (None: all)."""
    if indices is None:
        return value
    n = value.shape[dim]
    bad = [i for i in indices if not -n <= i < n]
    if bad:
        raise LeanpropValueError(
            f"{owner}(subsampling=...): indices {bad} are out of range for a batch of {n} samples."
        )
    index = torch.tensor([i % n for i in indices], dtype=torch.long, device=value.device)
    return value.index_select(dim, index)


@dataclass(frozen=True)
class BatchGrad(Quantity):
    """Individual gradients ``[N, *p.shape]``: ``p.grad_batch[n] = c_n``, summing to ``p.grad``.

    ``subsampling``: sample indices to keep (``[len(subsampling), *p.shape]``; computed for all
    samples, then selected)."""

    attr: ClassVar[str] = "grad_batch"
    subsampling: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "subsampling", check_subsampling("BatchGrad", self.subsampling))


@dataclass(frozen=True)
class BatchL2Grad(Quantity):
    """Squared L2 norms of the individual gradients ``[N]``: ``p.batch_l2[n] = ||c_n||²``.

    Computed without materialising ``c_n`` where a closed form is cheaper (Linear, Embedding).
    """

    attr: ClassVar[str] = "batch_l2"


@dataclass(frozen=True)
class SumGradSquared(Quantity):
    """Sum of squared individual gradients ``p.shape``: ``p.sum_grad_squared = sum_n c_n²``."""

    attr: ClassVar[str] = "sum_grad_squared"


@dataclass(frozen=True)
class Variance(Quantity):
    """Elementwise variance of the individual gradients ``p.shape``.

    ``p.variance = 1/N sum_n (c_n - mean_n c_n)²`` (biased, as BackPACK), computed from centred
    values, never as ``E[c²] - E[c]²``. NaN for an empty batch.
    """

    attr: ClassVar[str] = "variance"


@dataclass(frozen=True)
class BatchDotGrad(Quantity):
    """Dot products of the individual gradients ``[N, N]``: ``p.batch_dot[i, j] = <c_i, c_j>``
    (its diagonal is ``batch_l2``). Formed from the individual gradients (computed, and
    dropped after unless ``BatchGrad`` is asked for too)."""

    attr: ClassVar[str] = "batch_dot"


ALL_QUANTITIES: tuple[type[Quantity], ...] = (
    BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad,
)  # fmt: skip


def subsampling_of(quantities: tuple[object, ...]) -> tuple[int, ...] | None:
    """The samples ``BatchGrad(subsampling=...)`` among ``quantities`` keeps (None: all)."""
    return next((q.subsampling for q in quantities if isinstance(q, BatchGrad)), None)


def computed_kinds(kinds: frozenset[type[Quantity]]) -> frozenset[type[Quantity]]:
    """What backward computes for ``kinds``: ``BatchDotGrad`` is formed from ``BatchGrad``."""
    return kinds | {BatchGrad} if BatchDotGrad in kinds else kinds


def validate_quantities(quantities: tuple[object, ...]) -> frozenset[type[Quantity]]:
    """Check the requested quantities and return their types.

    Raises:
        LeanpropValueError: if none is given, one is a class instead of an instance, or is unknown.
    """
    allowed = ", ".join(f"{q.__name__}()" for q in ALL_QUANTITIES)
    if not quantities:
        raise LeanpropValueError(
            f"per_sample() got no quantity to compute; pass at least one of: {allowed}."
        )
    kinds: set[type[Quantity]] = set()
    for q in quantities:
        if isinstance(q, type) and issubclass(q, Quantity):
            raise LeanpropValueError(
                f"per_sample() got the class {q.__name__}; pass an instance: {q.__name__}()."
            )
        kind = next((k for k in ALL_QUANTITIES if isinstance(q, k)), None)  # (or a subclass)
        if kind is None:
            raise LeanpropValueError(
                f"per_sample() got an unknown quantity {q!r} of type {type(q).__name__}; "
                f"allowed: {allowed} (curvature quantities such as DiagGGNExact() are computed "
                "by leanprop.ggn(ctx, output, loss_fn, target, ...) inside the block)."
            )
        kinds.add(kind)
    return frozenset(kinds)
