"""BackPACK's module path ``extensions.secondorder.hbp`` (its Kronecker factors; its generic
``HBP`` extension is not offered)."""

from .. import KFAC, KFLR, KFRA

__all__ = ["KFAC", "KFLR", "KFRA"]
