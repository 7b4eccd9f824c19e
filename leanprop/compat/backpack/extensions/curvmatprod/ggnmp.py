"""BackPACK's module path ``extensions.curvmatprod.ggnmp``."""

from .. import GGNMP

__all__ = ["GGNMP"]
