"""BackPACK's module path ``extensions.secondorder.diag_hessian``."""

from .. import BatchDiagHessian, DiagHessian

__all__ = ["BatchDiagHessian", "DiagHessian"]
