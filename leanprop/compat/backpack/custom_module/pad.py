"""BackPACK's module path ``custom_module.pad``."""

from . import Pad

__all__ = ["Pad"]
