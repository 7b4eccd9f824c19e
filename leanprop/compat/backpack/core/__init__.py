"""BackPACK's module path ``core``."""
