"""Curvature: the generalized Gauss-Newton matrix (its diagonal, per-sample diagonals and
square root, exact or Monte-Carlo) through the per-sample engine.

* ``loss_hessian.py``: symmetric factors of the loss's Hessian with respect to the output.
* ``ggn.py``: :func:`ggn`, one backward per factor column through one recorded forward.
* ``batched_columns.py``: all the columns in one backward, where linear layers on ``[N, I]``
  inputs hold every parameter (MLPs).
* ``contexts.py``: how the curvature's own work treats the per_sample contexts.
* ``hessian.py``: the Hessian's diagonal: the curved activations' terms added to the GGN's.
* ``hessian_products.py``: products with the Hessian's blocks (``HMP``) and the
  positive-curvature Hessian's (``PCHMP``), by second-order autograd.
* ``quantities.py``: what can be requested (BackPACK's names and attributes).
"""

from .ggn import ggn
from .quantities import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    CurvatureQuantity,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)

__all__ = [
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDiagHessian",
    "CurvatureQuantity",
    "DiagGGNExact",
    "DiagGGNMC",
    "DiagHessian",
    "GGNMP",
    "HMP",
    "PCHMP",
    "KFAC",
    "KFLR",
    "KFRA",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "ggn",
]
