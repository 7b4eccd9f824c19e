"""BackPACK's module path ``extensions.firstorder``."""
