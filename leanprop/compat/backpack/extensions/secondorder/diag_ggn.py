"""BackPACK's module path ``extensions.secondorder.diag_ggn``."""

from .. import BatchDiagGGNExact, BatchDiagGGNMC, DiagGGNExact, DiagGGNMC

__all__ = ["BatchDiagGGNExact", "BatchDiagGGNMC", "DiagGGNExact", "DiagGGNMC"]
