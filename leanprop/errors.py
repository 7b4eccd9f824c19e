"""Exceptions raised by leanprop.

Every error says what came in, what is allowed and how to fix it. Each subclass also
subclasses the matching built-in (``ValueError`` / ``RuntimeError``) so existing
``except`` clauses keep working.
"""

from __future__ import annotations

import math
import numbers


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
    """``value`` as a float (an int with ``integer``) if it is a finite number above 0 (or at
    0 with ``zero_ok``; at most ``at_most``); else a :class:`LeanpropValueError` that says what
    came in and what is allowed (``owner``: the function or class, ``what``: the argument).
    numpy scalars count as numbers; bools do not."""
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 or (zero_ok and value == 0)) and (at_most is None or value <= at_most)
    if not ok:
        name = "int" if integer else "number"
        if at_most is not None:
            low = "[0" if zero_ok else "(0"
            need = f"a {name} in {low}, {at_most}]"
        else:
            need = f"a {'non-negative' if zero_ok else 'positive'}, finite {name}"
        raise LeanpropValueError(f"{owner} got {what}={value!r}; it must be {need}.")
    return int(value) if integer else float(value)
