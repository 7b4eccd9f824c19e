"""How the curvature's own work treats the per_sample contexts around it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

from ..._torch_compat import function_modes
from ..capture import PerSample
from ..fused import Intercept


@contextmanager
def own_work(contexts: Sequence[PerSample]) -> Iterator[None]:
    """The block's ops are the curvature's own, not the model's: the contexts neither follow
    nor capture them (innermost context first: each takes its own interception off)."""
    with ExitStack() as stack:
        for c in reversed(contexts):
            stack.enter_context(c.own_work())
        yield


@contextmanager
def quiet(contexts: Iterable[PerSample]) -> Iterator[None]:
    """``contexts`` and every per_sample context whose interception is active here (nested
    contexts around the model) compute nothing in the block: its backward passes are not the
    model's."""
    around = [m.capture for m in function_modes() if isinstance(m, Intercept)]
    found = {id(c): c for c in [*contexts, *around] if c.active}
    with ExitStack() as stack:
        for c in found.values():
            stack.enter_context(c.computing(frozenset()))
        yield
