"""BackPACK's module path ``hessianfree.hvp``."""

from . import hessian_vector_product

__all__ = ["hessian_vector_product"]
