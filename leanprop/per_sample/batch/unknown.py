"""Ops :func:`rules.result_dim` has no branch for: the dimension they act along, read from
their signature. Also the names of the ops that place values by a layout of their own (the
strided views, replayed on the samples' ids in ``spread.py``; the scatters of a source).

An op leanprop does not know is taken as elementwise where the shapes say so (most are:
activations, arithmetic). One that takes a dimension (``torch.cross(a, b, 0)``,
``torch.fft.hfft(x, n, 0)``, ``torch.gradient(x)`` over every dimension) acts along it: along
the batch's, it may mix the samples, so the batch is lost there, never taken as elementwise.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from .infos import BatchDim, norm_dim

UNKNOWN_ALONG = "(an op leanprop does not know) along the batch dimension may mix samples"

_DIM_NAMES = ("dim", "dims", "axis")
_NO_DEFAULT = inspect.Parameter.empty
OpName = Callable[[Any], str]  # (rules.op_name: a torch function's name as the rules say it)


@functools.cache
def _dim_params(op_name: OpName) -> dict[str, tuple[int, str, Any]]:
    """Each overridable torch function's dimension argument, ``name -> (position, keyword,
    default)``, from the signatures torch lists for its function overrides (read once per
    process)."""
    from torch.overrides import get_testing_overrides

    table: dict[str, tuple[int, str, Any]] = {}
    for func, stand_in in get_testing_overrides().items():
        try:
            params = list(inspect.signature(stand_in).parameters.values())
        except (TypeError, ValueError):
            continue
        for i, p in enumerate(params):
            if p.name in _DIM_NAMES and p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY):
                table.setdefault(op_name(func), (i, p.name, p.default))
                break
    return table


def _names_batch(d: Any, nd: int, bd: BatchDim) -> bool:
    """Whether a dimension argument (one or several; not None) names the batch's dimension,
    or something leanprop cannot read as one (taken as naming it)."""
    dims = d if isinstance(d, list | tuple) else [d]
    return any(not isinstance(k, int) or norm_dim(k, nd) == bd.dim for k in dims)


def acts_along_batch(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], nd: int, bd: BatchDim,
    op_name: OpName,
) -> bool:  # fmt: skip
    """Whether an op with no branch of its own acts along the batch dimension ``bd`` of an
    ``nd``-dim operand: its dimension argument (passed by position or keyword, else its
    default) names it, or is None (every dimension, or one the op picks itself)."""
    found = _dim_params(op_name).get(name)
    if found is None:  # (no signature: a dimension by keyword only)
        d = kwargs.get("dim", kwargs.get("axis")) if kwargs else None
        return d is not None and _names_batch(d, nd, bd)
    pos, key, default = found
    if key in kwargs:
        d = kwargs[key]
    elif len(args) > pos:
        d = args[pos]
    elif default is _NO_DEFAULT:
        return False
    else:
        d = default
    return d is None or _names_batch(d, nd, bd)


STRIDED_VIEWS = frozenset({"as_strided", "as_strided_copy"})
# ops that put the values of a source operand into the places of another, in an order of
# their own: the source's samples land in other places
PLACING_SOURCES = {"as_strided_scatter": (1, "src"), "masked_scatter": (2, "source")}
