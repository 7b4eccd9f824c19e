"""Individual gradients kept as factors, for the norms of a parameter used several times.

A weight shared between uses (a language model's embedding tied to its output layer) has
individual gradients ``W_n = sum_u W_n^u`` over its uses ``u``. Its squared norms need the
sum, ``||W_n||² = sum_{u,v} <W_n^u, W_n^v>``, but not ``W_n`` itself: each use of a linear
layer or an embedding gives ``W_n^u`` as a sum of outer products of rows it already has, and
the inner products of two such sums come from ``[S, S']`` matrices of row products (the
"Gram" form), without the ``[N, *W.shape]`` tensors:

* :class:`Outer` (a linear layer, ``W: [O, I]``): ``W_n = sum_s left_ns ⊗ right_ns`` with
  ``left: [N, S, O]`` (output gradients) and ``right: [N, S, I]`` (inputs);
* :class:`Lookup` (an embedding, ``W: [V, D]``): ``W_n = sum_s e_{ids_ns} ⊗ rows_ns`` with
  ``ids: [N, S]`` and ``rows: [N, S, D]`` (output gradients; ``e_i`` the i-th unit vector).

Then ``<sum_s a_s ⊗ b_s, sum_t c_t ⊗ d_t> = sum_{s,t} (a_s·c_t)(b_s·d_t)``, where a product with
a unit vector is a lookup (``a_s·e_i = a_s[i]``) or an equality of indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .chunks import sample_chunks
from .stats import widen


@dataclass(frozen=True)
class Outer:
    """``W_n = sum_s left[n, s] ⊗ right[n, s]``: ``left: [N, S, O]``, ``right: [N, S, I]``."""

    left: Tensor
    right: Tensor


@dataclass(frozen=True)
class Lookup:
    """``W_n = sum_s e_{ids[n, s]} ⊗ rows[n, s]`` for ``W: [num, D]``: ``ids: [N, S]``,
    ``rows: [N, S, D]``."""

    ids: Tensor
    rows: Tensor
    num: int  # rows of W


Factors = Outer | Lookup


def norms_are_cheaper(f: Factors) -> bool:
    """Whether norms from these factors (``[S, S']`` products per sample and pair of uses) beat
    materialising ``W_n`` (and adding and reducing it in memory): for ``Outer`` where
    ``S (I + O) <= I O``, for ``Lookup`` where ``S² <= 8 V`` (measured on CPU)."""
    if isinstance(f, Outer):
        s, o, i = f.left.shape[1], f.left.shape[2], f.right.shape[2]
        return s * (i + o) <= i * o
    return f.ids.shape[1] ** 2 <= 8 * f.num


def _rows_of(f: Factors) -> int:
    return f.left.shape[1] if isinstance(f, Outer) else f.ids.shape[1]


def _slice(f: Factors, start: int, stop: int) -> Factors:
    if isinstance(f, Outer):
        return Outer(f.left[start:stop], f.right[start:stop])
    return Lookup(f.ids[start:stop], f.rows[start:stop], f.num)


def _inner(a: Factors, b: Factors) -> Tensor:
    """``<A_n, B_n>`` for each sample of one chunk: ``[n]``."""
    if isinstance(a, Lookup) and isinstance(b, Outer):
        a, b = b, a
    if isinstance(a, Outer) and isinstance(b, Outer):
        return (torch.bmm(a.left, b.left.mT) * torch.bmm(a.right, b.right.mT)).sum((1, 2))
    if isinstance(a, Outer):  # and b a Lookup: a.left[n, s, ids[n, t]] (a_s · e_{i_t})
        picked = a.left.gather(2, b.ids.unsqueeze(1).expand(-1, a.left.shape[1], -1))
        return (picked * torch.bmm(a.right, b.rows.mT)).sum((1, 2))
    same = (a.ids.unsqueeze(2) == b.ids.unsqueeze(1)).to(a.rows.dtype)  # [n, S, T]
    return (same * torch.bmm(a.rows, b.rows.mT)).sum((1, 2))


def _widened(f: Factors) -> Factors:
    if isinstance(f, Outer):
        return Outer(widen(f.left), widen(f.right))
    return Lookup(f.ids, widen(f.rows), f.num)


def _values(f: Factors) -> Tensor:
    return f.left if isinstance(f, Outer) else f.rows


def inner(a: Factors, b: Factors, workspace_bytes: int) -> Tensor:
    """``<A_n, B_n>`` for every sample: ``[N]`` (16-bit factors in float32), in chunks of
    samples whose ``[S, T]`` temporaries (and float32 copies) fit ``workspace_bytes``."""
    n = _values(a).shape[0]
    per_sample = 3 * _rows_of(a) * _rows_of(b) * 8 + sum(
        _values(f)[:1].numel() * 4 + (f.right[:1].numel() * 4 if isinstance(f, Outer) else 0)
        for f in (a, b)
    )
    parts = [
        _inner(_widened(_slice(a, start, stop)), _widened(_slice(b, start, stop)))
        for start, stop in sample_chunks(n, per_sample, workspace_bytes)
    ]
    if not parts:
        return widen(_values(a)).new_zeros(0)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def total(f: Factors) -> Tensor:
    """``sum_n W_n``: the ordinary gradient of the use."""
    if isinstance(f, Outer):
        return f.left.flatten(0, 1).mT @ f.right.flatten(0, 1)  # [O, I]
    rows = f.rows.flatten(0, 1)
    return rows.new_zeros(f.num, rows.shape[1]).index_add_(0, f.ids.flatten(), rows)


def sum_of_squares(f: Factors) -> Tensor | None:
    """``sum_n W_n²`` (elementwise; 16-bit factors in float32) where each ``W_n`` is one outer
    product (one row per sample, ``S == 1``): one product of the squared factors, no
    ``[N, *W.shape]`` tensor. None for ``S > 1`` (the squares of sums need ``W_n``)."""
    if _rows_of(f) != 1:
        return None
    f = _widened(f)
    if isinstance(f, Outer):
        return f.left[:, 0].square().mT @ f.right[:, 0].square()  # [O, I]
    rows = f.rows[:, 0].square()
    return rows.new_zeros(f.num, rows.shape[1]).index_add_(0, f.ids[:, 0], rows)


def materialize(f: Factors) -> Tensor:
    """The individual gradients ``[N, *W.shape]``."""
    if isinstance(f, Outer):
        return torch.bmm(f.left.mT, f.right)
    n, _, d = f.rows.shape
    return add_into(f.rows.new_zeros(n, f.num, d), f, in_place=True)  # (zeros of ours)


def add_into(batch: Tensor, f: Factors, in_place: bool = False) -> Tensor:
    """``batch + W``, ``batch: [N, *W.shape]``, without a temporary of that size (``in_place``:
    into ``batch`` itself, no second buffer either)."""
    if isinstance(f, Outer):
        left, right = f.left.mT.to(batch.dtype), f.right.to(batch.dtype)
        return batch.baddbmm_(left, right) if in_place else torch.baddbmm(batch, left, right)
    d = f.rows.shape[2]
    index, rows = f.ids.unsqueeze(2).expand(-1, -1, d), f.rows.to(batch.dtype)
    return batch.scatter_add_(1, index, rows) if in_place else batch.scatter_add(1, index, rows)


@dataclass
class FactoredUses:
    """The uses of one weight kept as factors, and the inner products of every pair of them,
    accumulated as they arrive in backward.

    Attributes:
        uses: the factors of each use.
        sq: ``sum_{u,v} <W_n^u, W_n^v>``: ``[N]``, the squared norms of ``sum_u W_n^u``.
        own: ``sum_u ||W_n^u||²``: ``[N]``, against which cancellation in ``sq`` is judged.
        total: ``sum_u sum_n W_n^u``: the summed gradient.
    """

    uses: list[Factors] = field(default_factory=list)
    sq: Tensor | None = None
    own: Tensor | None = None
    total: Tensor | None = None

    def add(self, f: Factors, workspace_bytes: int) -> Tensor:
        """Add a use; returns its summed gradient."""
        s, own = total(f), inner(f, f, workspace_bytes)
        sq = own
        for earlier in self.uses:
            sq = sq + 2 * inner(f, earlier, workspace_bytes)
        self.uses.append(f)
        self.sq = sq if self.sq is None else self.sq + sq
        self.own = own if self.own is None else self.own + own
        self.total = s if self.total is None else self.total + s
        return s

    def squared_norms(self) -> Tensor:
        """``||sum_u W_n^u||²``: ``[N]``. Where the uses nearly cancel (the sum below a tenth
        of ``own``, so rounding in the pairwise terms would show), those samples' norms come
        from their materialised individual gradients instead."""
        sq = self.sq
        cancel = (sq < 0.1 * self.own).nonzero().flatten().tolist()
        if not cancel:
            return sq
        exact = sq.clone()
        for n in cancel:
            w = sum(materialize(_slice(f, n, n + 1)) for f in self.uses)
            exact[n] = widen(w).square().sum()
        return exact

    def added_to(self, b: Tensor) -> Tensor:
        """``b + sum_u W_n^u`` for individual gradients ``b: [N, *W.shape]``."""
        for f in self.uses:
            b = add_into(b, f)
        return b
