"""BackPACK's module path ``extensions.secondorder`` (the same extensions as ``extensions``)."""

from .. import (
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)

__all__ = [
    "KFAC", "KFLR", "KFRA", "BatchDiagGGNExact", "BatchDiagGGNMC", "BatchDiagHessian",
    "DiagGGNExact", "DiagGGNMC", "DiagHessian", "SqrtGGNExact", "SqrtGGNMC",
]  # fmt: skip
