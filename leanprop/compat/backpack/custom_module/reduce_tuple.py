"""BackPACK's module path ``custom_module.reduce_tuple``."""

from . import ReduceTuple

__all__ = ["ReduceTuple"]
