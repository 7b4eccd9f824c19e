"""Built-in per-layer rules; importing this package registers them."""

from . import conv, embedding, linear, norm  # noqa: F401
