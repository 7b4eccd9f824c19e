"""BackPACK's module path ``extensions.secondorder.sqrt_ggn``."""

from .. import SqrtGGNExact, SqrtGGNMC

__all__ = ["SqrtGGNExact", "SqrtGGNMC"]
