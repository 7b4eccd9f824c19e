"""BackPACK's module path ``hessianfree.lop``."""

from . import L_op, transposed_jacobian_vector_product

__all__ = ["L_op", "transposed_jacobian_vector_product"]
