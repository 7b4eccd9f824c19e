"""Exceptions raised by leanprop.

Every error says what came in, what is allowed and how to fix it. Each subclass also
subclasses the matching built-in (``ValueError`` / ``RuntimeError``) so existing
``except`` clauses keep working.
"""

from __future__ import annotations

import math


class LeanpropError(Exception):
    """Base class of every error leanprop raises."""


class LeanpropValueError(LeanpropError, ValueError):
    """An argument has the wrong type or value (unknown quantity, bad option)."""


class BatchError(LeanpropError, ValueError):
    """Inputs lack a batch dimension, or modules see different batch sizes."""


class UnsupportedModelError(LeanpropError, RuntimeError):
    """The model does something that makes the request ill-defined (e.g. BatchNorm in training)."""


def checked_number(
    owner: str, what: str, value: object, *, zero_ok: bool = False, at_most: float | None = None,
    integer: bool = False,
) -> float:  # fmt: skip
    """``value`` if it is a finite number above 0 (or at 0 with ``zero_ok``, at most
    ``at_most``, an int with ``integer``); else a :class:`LeanpropValueError` that says what
    came in and what is allowed (``owner``: the function or class, ``what``: the argument)."""
    kind = "int" if integer else "number"
    allowed = (int,) if integer else (int, float)
    ok = isinstance(value, allowed) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > 0 or (zero_ok and value == 0))
    ok = ok and (at_most is None or value <= at_most)
    if not ok:
        if at_most is not None:
            need = f"a {kind} in ({'[' if zero_ok else ''}0, {at_most}]".replace("([", "[")
        else:
            need = f"a {'non-negative' if zero_ok else 'positive'}, finite {kind}"
        raise LeanpropValueError(f"{owner} got {what}={value!r}; it must be {need}.")
    return value
