"""BackPACK's module path ``custom_module.slicing``."""

from . import Slicing

__all__ = ["Slicing"]
