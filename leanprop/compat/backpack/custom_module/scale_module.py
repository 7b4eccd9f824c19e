"""BackPACK's module path ``custom_module.scale_module``."""

from . import ScaleModule

__all__ = ["ScaleModule"]
