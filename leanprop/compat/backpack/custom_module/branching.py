"""BackPACK's module path ``custom_module.branching``."""

from . import ActiveIdentity, Parallel, SumModule

__all__ = ["ActiveIdentity", "Parallel", "SumModule"]
