"""``tree_flatten``/``tree_unflatten`` with quick paths for what the op interception meets on
every op of a forward: one tensor, and a call ``(args, kwargs)`` of tensors and plain values
(torch's pytree walk costs tens of microseconds per op)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._torch_compat import tree_flatten, tree_unflatten

_PLAIN = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
     torch.memory_format}
)  # fmt: skip


class _One:
    """Spec of a lone tensor."""


_ONE = _One()


class _Call(NamedTuple):
    """Spec of a flat call: ``n_args`` positional leaves, then the keyword arguments'."""

    n_args: int
    keys: tuple[str, ...]


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten(tree)``: its leaves and a spec for :func:`unflatten`."""
    if isinstance(tree, Tensor):
        return [tree], _ONE
    if type(tree) is tuple and len(tree) == 2 and type(tree[0]) is tuple and type(tree[1]) is dict:
        args, kwargs = tree
        leaves = [*args, *kwargs.values()]
        if all(isinstance(t, Tensor) or type(t) in _PLAIN for t in leaves):
            return leaves, _Call(len(args), tuple(kwargs))
    return tree_flatten(tree)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """The tree :func:`flatten` took apart, with ``leaves`` in its places."""
    if spec is _ONE:
        return leaves[0]
    if isinstance(spec, _Call):
        n = spec.n_args
        return tuple(leaves[:n]), dict(zip(spec.keys, leaves[n:], strict=True))
    return tree_unflatten(leaves, spec)
