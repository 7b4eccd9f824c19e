"""Curvature quantities: the generalized Gauss-Newton matrix ``G = sum_n J_n^T H_n J_n``
(``J_n`` the Jacobian of sample n's output with respect to the parameters, ``H_n`` the
loss's Hessian with respect to it; see ``loss_hessian.py``), as BackPACK defines them, with
its attribute names. "MC" variants replace ``H_n`` by a Monte-Carlo estimate from
``mc_samples`` targets drawn from the model's prediction (an unbiased estimate of G).

Shapes, for a parameter ``p``: diagonals ``p.shape``; per-sample diagonals ``[N, *p.shape]``
(summing to the diagonal); square roots ``[M, N, *p.shape]`` with
``G = sum_{m,n} vec(V[m, n]) vec(V[m, n])^T`` (M = the loss's factor columns: C classes for
cross-entropy, the output size for MSE and BCE, ``mc_samples`` for MC).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from ...errors import LeanpropValueError
from ..quantities import ALL_QUANTITIES, check_subsampling


@dataclass(frozen=True)
class CurvatureQuantity:
    """Base of the curvature quantities; use one of the subclasses."""

    attr: ClassVar[str] = ""
    per_sample: ClassVar[bool] = False  # [N, ...] per sample (else summed over samples)
    root: ClassVar[bool] = False  # the factor itself [M, N, ...] (else squares)
    kronecker: ClassVar[bool] = False  # Kronecker factors of linear and conv layers
    product: ClassVar[bool] = False  # a function multiplying by the parameter's GGN block
    hessian: ClassVar[bool] = False  # the Hessian's (GGN plus the activations' terms)
    second_order: ClassVar[bool] = False  # by second-order autograd, not by factor columns
    averaged: ClassVar[bool] = False  # KFRA's recursion, averaged over the batch at each step

    @property
    def mc(self) -> int | None:
        """Monte-Carlo samples, None for the exact quantity."""
        return None

    @property
    def savefield(self) -> str:
        """The attribute the results are stored under (BackPACK's name for it)."""
        return self.attr


def _check_savefield(q: CurvatureQuantity) -> None:
    """A product's ``savefield`` (the attribute its function is stored under) is a name of its
    own: not one a parameter has (``grad``, ``data``, a method), a private one, or the
    attribute of a first-order quantity (``grad_batch``: its results would replace it)."""
    name = q.savefield
    taken = isinstance(name, str) and (
        hasattr(nn.Parameter, name) or name.startswith("_")
        or name in {k.attr for k in ALL_QUANTITIES}
    )  # fmt: skip
    if not isinstance(name, str) or not name.isidentifier() or taken:
        raise LeanpropValueError(
            f"{type(q).__name__}(savefield={name!r}): pass an attribute name of its own such "
            f"as {q.attr!r} (where p.{q.attr}(mat) is stored), not a private one, one that "
            "parameters have (grad, data, their methods) or a first-order quantity's."
        )


@dataclass(frozen=True)
class _MC(CurvatureQuantity):
    mc_samples: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.mc_samples, bool) or not isinstance(self.mc_samples, int):
            raise LeanpropValueError(
                f"{type(self).__name__}(mc_samples={self.mc_samples!r}): pass a positive int."
            )
        if self.mc_samples < 1:
            raise LeanpropValueError(
                f"{type(self).__name__}(mc_samples={self.mc_samples}): it must be at least 1."
            )

    @property
    def mc(self) -> int | None:
        return self.mc_samples


@dataclass(frozen=True)
class DiagGGNExact(CurvatureQuantity):
    """Diagonal of the GGN, ``p.shape``."""

    attr: ClassVar[str] = "diag_ggn_exact"


@dataclass(frozen=True)
class DiagGGNMC(_MC):
    """Monte-Carlo estimate of the GGN's diagonal, ``p.shape``."""

    attr: ClassVar[str] = "diag_ggn_mc"


@dataclass(frozen=True)
class BatchDiagGGNExact(CurvatureQuantity):
    """Each sample's share of the GGN's diagonal, ``[N, *p.shape]``."""

    attr: ClassVar[str] = "diag_ggn_exact_batch"
    per_sample: ClassVar[bool] = True


@dataclass(frozen=True)
class BatchDiagGGNMC(_MC):
    """Each sample's share of the MC estimate of the GGN's diagonal, ``[N, *p.shape]``."""

    attr: ClassVar[str] = "diag_ggn_mc_batch"
    per_sample: ClassVar[bool] = True


@dataclass(frozen=True)
class SqrtGGNExact(CurvatureQuantity):
    """Square root of the GGN, ``[M, N, *p.shape]``; ``subsampling``: the samples kept
    (``[M, len(subsampling), *p.shape]``, the GGN of the loss restricted to them)."""

    attr: ClassVar[str] = "sqrt_ggn_exact"
    root: ClassVar[bool] = True
    subsampling: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "subsampling", check_subsampling(type(self).__name__, self.subsampling)
        )


@dataclass(frozen=True)
class SqrtGGNMC(_MC):
    """Monte-Carlo square root of the GGN, ``[mc_samples, N, *p.shape]``; ``subsampling`` as
    for :class:`SqrtGGNExact`."""

    attr: ClassVar[str] = "sqrt_ggn_mc"
    root: ClassVar[bool] = True
    subsampling: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(
            self, "subsampling", check_subsampling(type(self).__name__, self.subsampling)
        )


@dataclass(frozen=True)
class GGNMP(CurvatureQuantity):
    """Multiplication by the parameter's block of the (exact) GGN: ``p.ggnmp(mat)`` with
    ``mat: [V, *p.shape]`` returns ``G_pp mat`` ``[V, *p.shape]`` (from the square root: it
    keeps ``[C, N, *p.shape]``)."""

    attr: ClassVar[str] = "ggnmp"
    product: ClassVar[bool] = True
    # the attribute the product is stored under (BackPACK's savefield; keyword only)
    savefield: str = field(default="ggnmp", kw_only=True)

    def __post_init__(self) -> None:
        _check_savefield(self)


@dataclass(frozen=True)
class KFLR(CurvatureQuantity):
    """Kronecker factors of the GGN's blocks of linear (``[N, I]`` inputs) and convolution
    (``groups=1``, zero padding) layers: weight ``[B, A]``, bias ``[B]`` (see
    ``kronecker.py``)."""

    attr: ClassVar[str] = "kflr"
    kronecker: ClassVar[bool] = True


@dataclass(frozen=True)
class KFAC(_MC):
    """KFLR's factors with ``B`` from ``mc_samples`` Monte-Carlo columns."""

    attr: ClassVar[str] = "kfac"
    kronecker: ClassVar[bool] = True


@dataclass(frozen=True)
class KFRA(CurvatureQuantity):
    """Kronecker factors of the GGN's blocks of a chain of linear layers (``[N, I]`` inputs)
    with the output-side factor averaged over the batch at every step back (``kfra.py``):
    weight ``[B, A]``, bias ``[B]``."""

    attr: ClassVar[str] = "kfra"
    averaged: ClassVar[bool] = True


@dataclass(frozen=True)
class DiagHessian(CurvatureQuantity):
    """Diagonal of the Hessian, ``p.shape``: the GGN's plus the terms of the model's curved
    elementwise activations (``hessian.py``: which models it covers)."""

    attr: ClassVar[str] = "diag_h"
    hessian: ClassVar[bool] = True


@dataclass(frozen=True)
class BatchDiagHessian(CurvatureQuantity):
    """Each sample's share of the Hessian's diagonal, ``[N, *p.shape]``."""

    attr: ClassVar[str] = "diag_h_batch"
    per_sample: ClassVar[bool] = True
    hessian: ClassVar[bool] = True


@dataclass(frozen=True)
class HMP(CurvatureQuantity):
    """Multiplication by the parameter's block of the Hessian: ``p.hmp(mat)`` with
    ``mat: [V, *p.shape]`` returns ``H_pp mat`` ``[V, *p.shape]``, exact for any model
    autograd can differentiate twice. The parameter's gradient is formed once as a
    differentiable function while the forward's graph is whole; each product is one
    second-order backward pass through it per vector. It keeps that graph (about the forward's
    activations once more) while the function is kept, and needs the forward's own graph too:
    run ``loss.backward(retain_graph=True)`` after ``ggn(..., HMP())`` (the BackPACK facade's
    block does it). That graph holds the parameters, which hold the function: delete
    ``p.hmp`` when done (Python's collector cannot see the cycle, as with ``.grad`` after
    ``backward(create_graph=True)``)."""

    attr: ClassVar[str] = "hmp"
    second_order: ClassVar[bool] = True
    # the attribute the product is stored under (BackPACK's savefield; keyword only)
    savefield: str = field(default="hmp", kw_only=True)

    def __post_init__(self) -> None:
        _check_savefield(self)


@dataclass(frozen=True)
class PCHMP(CurvatureQuantity):
    """Multiplication by the parameter's block of the positive-curvature Hessian (Chen et al.,
    2018; BackPACK's ``PCHMP``): the Hessian with each curved activation's residual
    ``r = δ ⊙ σ''(z)`` made non-negative, ``modify="clip"`` (``max(r, 0)``) or ``"abs"``
    (``|r|``). ``p.pchmp(mat)``, ``mat: [V, *p.shape]``. Formed as :class:`HMP`'s product plus,
    for each activation, ``J_zᵀ (c r₋ ⊙ J_z mat)`` (``c`` 1 or 2): it covers the models
    :class:`DiagHessian` covers, and keeps the graph as :class:`HMP` does."""

    attr: ClassVar[str] = "pchmp"
    second_order: ClassVar[bool] = True
    hessian: ClassVar[bool] = True
    modify: str = "clip"
    # the attribute the product is stored under (BackPACK's savefield; keyword only)
    savefield: str = field(default="pchmp", kw_only=True)

    def __post_init__(self) -> None:
        _check_savefield(self)
        if self.modify not in ("clip", "abs"):
            raise LeanpropValueError(
                f"PCHMP(modify={self.modify!r}): pass 'clip' (negative residuals set to 0) or "
                "'abs' (their absolute values)."
            )


ALL_CURVATURE: tuple[type[CurvatureQuantity], ...] = (
    DiagGGNExact, DiagGGNMC, BatchDiagGGNExact, BatchDiagGGNMC, SqrtGGNExact, SqrtGGNMC, GGNMP,
    KFLR, KFAC, KFRA, DiagHessian, BatchDiagHessian, HMP, PCHMP,
)  # fmt: skip
