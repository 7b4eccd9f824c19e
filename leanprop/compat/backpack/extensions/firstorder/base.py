"""BackPACK's module path ``extensions.firstorder.base``."""

from ..module_extension import ModuleExtension


class FirstOrderModuleExtension(ModuleExtension):
    """Base of a custom module's first-order extension (see ``module_extension.py``)."""


__all__ = ["FirstOrderModuleExtension"]
