"""BackPACK's module path ``core.derivatives``."""
