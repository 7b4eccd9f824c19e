"""Curvature: the generalized Gauss-Newton matrix (its diagonal, per-sample diagonals and
square root, exact or Monte-Carlo) through the per-sample engine.

* ``loss_hessian.py``: symmetric factors of the loss's Hessian with respect to the output.
* ``ggn.py``: :func:`ggn`, one backward per factor column through one recorded forward.
* ``quantities.py``: what can be requested (BackPACK's names and attributes).
"""

from .ggn import ggn
from .quantities import (
    GGNMP,
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    CurvatureQuantity,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
)

__all__ = [
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "CurvatureQuantity",
    "DiagGGNExact",
    "DiagGGNMC",
    "GGNMP",
    "KFAC",
    "KFLR",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "ggn",
]
