"""BackPACK's module path ``extensions.curvmatprod.hmp``."""

from .. import HMP

__all__ = ["HMP"]
