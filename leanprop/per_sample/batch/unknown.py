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

from .infos import MAY_REORDER, BatchDim, norm_dim

UNKNOWN_ALONG = "(an op leanprop does not know) along the batch dimension may mix samples"

_DIM_NAMES = frozenset({"dim", "dims", "axis", "dim0", "dim1", "dim2", "axis0", "axis1"})
_NO_DEFAULT = inspect.Parameter.empty
OpName = Callable[[Any], str]  # (rules.op_name: a torch function's name as the rules say it)


@functools.cache
def _signatures(op_name: OpName) -> tuple[tuple[str, tuple[inspect.Parameter, ...]], ...]:
    """``(name, parameters that may be passed by position)`` of each overridable torch
    function, from the signatures torch lists for its function overrides (read once per
    process)."""
    from torch.overrides import get_testing_overrides

    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    found = []
    for func, stand_in in get_testing_overrides().items():
        try:
            params = inspect.signature(stand_in).parameters.values()
        except (TypeError, ValueError):
            continue
        found.append((op_name(func), tuple(p for p in params if p.kind in kinds)))
    return tuple(found)


@functools.cache
def _dim_params(op_name: OpName) -> dict[str, tuple[tuple[int, str, Any], ...]]:
    """Each overridable torch function's dimension arguments, ``name -> ((position, keyword,
    default), ...)``."""
    table: dict[str, tuple[tuple[int, str, Any], ...]] = {}
    for name, params in _signatures(op_name):
        found = tuple((i, p.name, p.default) for i, p in enumerate(params) if p.name in _DIM_NAMES)
        if found:
            table.setdefault(name, found)
    return table


@functools.cache
def _operand_params(op_name: OpName) -> dict[str, tuple[tuple[str, Any], ...]]:
    """Each overridable torch function's parameters that may be passed by position, in order,
    ``name -> ((keyword, default), ...)``."""
    table: dict[str, tuple[tuple[str, Any], ...] | None] = {}
    for name, params in _signatures(op_name):
        found = tuple((p.name, p.default) for p in params)
        if name not in table:
            table[name] = found
            continue
        known = table[name]
        if known is None:
            continue
        # (torch.X, Tensor.X and F.X share a name: one order of parameters for all, the first
        # (input or self) aside, or none: torch.batch_norm's and F.batch_norm's differ)
        a, b = [k for k, _ in known[1:]], [k for k, _ in found[1:]]
        short = min(len(a), len(b))
        table[name] = None if a[:short] != b[:short] else max(known, found, key=len)
    return {k: v for k, v in table.items() if v is not None}


def as_positional(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: str, op_name: OpName
) -> tuple[list[Any], int] | None:
    """The op's arguments up to the operand passed by keyword ``which``, as positional ones
    (those not passed: their defaults), and that operand's position; None where the op's
    signature does not list ``which`` among its positional parameters, or one before it has
    no default and was not passed."""
    params = _operand_params(op_name).get(name)
    keywords = [k for k, _ in params] if params else []
    if which not in keywords or keywords.index(which) < len(args):
        return None
    at = keywords.index(which)
    full = list(args)
    for keyword, default in params[len(args) : at + 1]:
        if keyword in kwargs:
            full.append(kwargs[keyword])
        elif default is not _NO_DEFAULT:
            full.append(default)
        else:
            return None
    return full, at


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
    ``nd``-dim operand: one of its dimension arguments (passed by position or keyword, else
    its default) names it, or is None (every dimension, or one the op picks itself), or
    cannot be read (a required one not found where its signature says)."""
    found = _dim_params(op_name).get(name)
    if found is None:  # (no signature: a dimension by keyword only)
        given = [kwargs[k] for k in _DIM_NAMES if k in kwargs] if kwargs else []
        return any(d is not None and _names_batch(d, nd, bd) for d in given)
    for pos, key, default in found:
        if key in kwargs:
            d = kwargs[key]
        elif len(args) > pos:
            d = args[pos]
        elif default is _NO_DEFAULT:
            return True
        else:
            d = default
        if d is None or _names_batch(d, nd, bd):
            return True
    return False


STRIDED_VIEWS = frozenset({"as_strided"})  # (and as_strided_copy: rules.op_name)
STRIDED_LOST = f"as_strided with a layout that may put samples together {MAY_REORDER}"
# ops that put the values of a source operand into the places of another, in an order of
# their own: the source's samples land in other places
PLACING_SOURCES = {"as_strided_scatter": (1, "src"), "masked_scatter": (2, "source")}
