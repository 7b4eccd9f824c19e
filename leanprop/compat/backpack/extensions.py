"""BackPACK's first-order extensions, as leanprop quantities (same names, same attributes:
``grad_batch``, ``batch_l2``, ``sum_grad_squared``, ``variance``)."""

from ...per_sample.quantities import BatchGrad, BatchL2Grad, SumGradSquared, Variance

__all__ = ["BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance"]
