"""BackPACK's extensions, as leanprop quantities (same names, same attributes:
``grad_batch``, ``batch_l2``, ``batch_dot``, ``sum_grad_squared``, ``variance``, and the
curvature ones ``diag_ggn_exact``, ``diag_ggn_mc``, ``diag_ggn_exact_batch``,
``diag_ggn_mc_batch``, ``sqrt_ggn_exact``, ``sqrt_ggn_mc``)."""

from ...per_sample.curvature.quantities import (
    GGNMP,
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
)
from ...per_sample.quantities import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance

__all__ = [
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDotGrad",
    "BatchGrad",
    "BatchL2Grad",
    "DiagGGNExact",
    "DiagGGNMC",
    "GGNMP",
    "KFAC",
    "KFLR",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "SumGradSquared",
    "Variance",
]
