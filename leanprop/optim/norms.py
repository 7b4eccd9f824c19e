"""Norms of the gradients an InBackward optimizer stepped, for clipping and for trainers that
read the global norm (``clip_grad_norm_(params, inf)``) after backward freed the gradients."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._torch_compat import foreach_norms, foreach_scale_, grouped_by_device_and_dtype


def grad_norms(grads: Sequence[Tensor]) -> list[Tensor]:
    """2-norm of each gradient (dense ones in a few multi-tensor kernels; sparse ones from
    their coalesced values)."""
    if not any(g.is_sparse for g in grads):  # (the usual case: no lists to rebuild)
        return foreach_norms(grads) if grads else []
    dense = [g for g in grads if not g.is_sparse]
    it = iter(foreach_norms(dense) if dense else [])
    return [
        torch.linalg.vector_norm(g.coalesce().values()) if g.is_sparse else next(it) for g in grads
    ]


def scale_grads(grads: Sequence[Tensor], factor: Tensor) -> None:
    """``g.mul_(factor)`` for each gradient (dense ones in a few multi-tensor kernels)."""
    dense = [g for g in grads if not g.is_sparse]
    if dense:
        foreach_scale_(dense, factor)
    for g in grads:
        if g.is_sparse:
            g.mul_(factor)


def clip_factor(max_norm: float, total: Tensor) -> Tensor:
    """The factor ``clip_grad_norm_`` scales gradients of global norm ``total`` by:
    ``max_norm / (total + 1e-6)``, at most 1."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


@dataclass
class SteppedNorms:
    """Each parameter's gradient norm, as backward produced it (before any clipping), in the
    last backward pass that accumulated gradients of the optimizer's parameters.

    Attributes:
        keep: whether the norms are kept (one extra read of each gradient).
        auto: ``keep`` is decided by use: norms kept in a backward that nobody read before
            the next backward began stop being kept (``dropped``); a read keeps them for good.
        dropped: ``keep`` was turned off so.
        task: the autograd graph task of that backward (-1: none yet).
        stepped: ``id(p)`` of the parameters stepped in it so far.
        norms: ``id(p) -> 0-dim norm`` of those, if ``keep``.
    """

    keep: bool = True
    auto: bool = False
    dropped: bool = False
    task: int = -1
    stepped: set[int] = field(default_factory=set)
    norms: dict[int, Tensor] = field(default_factory=dict)

    def begin(self, task: int) -> None:
        """A gradient of backward ``task`` arrived: a new backward forgets the last one's
        (and, deciding by use, stops keeping norms if the last one's were kept unread)."""
        if task != self.task:
            if self.auto and self.norms:
                self.keep, self.auto, self.dropped = False, False, True
            self.task, self.stepped, self.norms = task, set(), {}

    def record(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        self.stepped.update(map(id, params))
        if self.keep:
            self.norms.update(zip(map(id, params), grad_norms(grads), strict=True))

    def read(self) -> None:
        """The norms were read (deciding by use: they are kept from now on)."""
        if self.norms:
            self.auto = False

    def wanted(self) -> None:
        """The norms are used (clipping reads them): kept from now on, also where they had
        stopped being kept."""
        self.auto = False
        if self.dropped:
            self.keep, self.dropped = True, False

    def total(self, groups: Iterable[dict[str, Any]]) -> Tensor | None:
        """Global 2-norm over ``groups``' parameters (None if nothing was stepped)."""
        return norm_in_order(self.norms, groups) if self.norms else None


def norm_in_order(
    norms: dict[int, Tensor], groups: Iterable[dict[str, Any]], norm_type: float = 2.0,
    device: torch.device | None = None,
) -> Tensor:  # fmt: skip
    """:func:`global_norm` of ``norms`` (``id(p) -> norm``) taken in ``groups``' parameter
    order, as ``clip_grad_norm_(params)`` over those parameters forms it."""
    ordered = [norms[id(p)] for g in groups for p in g["params"] if id(p) in norms]
    return global_norm(ordered, norm_type, device)


def global_norm(
    norms: Sequence[Tensor], norm_type: float = 2.0, device: torch.device | None = None
) -> Tensor:
    """The global norm from per-tensor norms as ``clip_grad_norm_`` forms it: grouped by
    device and dtype (in torch's order), stacked on the first one's device (0 on ``device``
    if there are none)."""
    if not norms:
        return torch.zeros((), device=device)
    ordered = [n for group in grouped_by_device_and_dtype(list(norms)) for n in group]
    first = ordered[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in ordered]), norm_type)
