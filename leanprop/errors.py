"""Exceptions raised by leanprop.

Every error says what came in, what is allowed and how to fix it. Each subclass also
subclasses the matching built-in (``ValueError`` / ``RuntimeError``) so existing
``except`` clauses keep working.
"""

from __future__ import annotations


class LeanpropError(Exception):
    """Base class of every error leanprop raises."""


class LeanpropValueError(LeanpropError, ValueError):
    """An argument has the wrong type or value (unknown quantity, bad option)."""


class BatchError(LeanpropError, ValueError):
    """Inputs lack a batch dimension, or modules see different batch sizes."""


class UnsupportedModelError(LeanpropError, RuntimeError):
    """The model does something that makes the request ill-defined (e.g. BatchNorm in training)."""
