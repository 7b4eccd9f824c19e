"""BackPACK's module path ``extensions.curvmatprod`` (block-diagonal curvature products)."""

from .. import GGNMP, HMP, PCHMP

__all__ = ["GGNMP", "HMP", "PCHMP"]
