"""BackPACK's module path ``custom_module.permute``."""

from . import Permute

__all__ = ["Permute"]
