"""BackPACK's module path ``hessianfree.rop``."""

from . import R_op, jacobian_vector_product

__all__ = ["R_op", "jacobian_vector_product"]
