"""BackPACK's module path ``hessianfree.ggnvp``."""

from . import ggn_vector_product, ggn_vector_product_from_plist

__all__ = ["ggn_vector_product", "ggn_vector_product_from_plist"]
