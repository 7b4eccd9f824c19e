"""Marks the eager backward passes that :func:`leanprop.side_loss` runs during forward.

:func:`leanprop.per_sample` computes the quantities of a penalty's own parameters in such a
pass, but keeps its forward/backward cycle open until the main backward ends, so that they
join the results of that backward instead of being replaced by them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_state = threading.local()


@contextmanager
def eager_backward() -> Iterator[None]:
    """The block runs a side loss's eager backward."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_eager_backward() -> bool:
    """Whether the current thread is inside :func:`eager_backward`."""
    return getattr(_state, "depth", 0) > 0
