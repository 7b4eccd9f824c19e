"""BackPACK's module path ``utils`` (the helpers its examples import)."""
