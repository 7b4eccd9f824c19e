"""BackPACK's module path ``extensions.curvmatprod.pchmp``."""

from .. import PCHMP

__all__ = ["PCHMP"]
