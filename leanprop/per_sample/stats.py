"""Statistics over the sample dimension of individual gradients ``b: [N, *shape]``.

Reductions over the leading (sample) dimension are cache-blocked: the columns are processed in
blocks of about 1 MiB so temporaries stay in cache (several times faster on CPU than one
strided reduction over the whole tensor). When autograd records (``create_graph=True``), plain
differentiable formulas are used instead. The variance comes from sums shifted by a mean
(the corrected two-pass form), accurate where the mean is large against the spread.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .chunks import Scratch
from .quantities import (
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    Quantity,
    SumGradSquared,
    Variance,
)

_BLOCK_BYTES = 2**20
_SMALL = 2**14  # elements below which a plain reduction beats a matrix-vector product


def _recording(b: Tensor) -> bool:
    return torch.is_grad_enabled() and b.requires_grad


def _blocks(b: Tensor) -> tuple[Tensor, int]:
    flat = b.reshape(b.shape[0], math.prod(b.shape[1:]))  # [N, D]
    return flat, max(256, _BLOCK_BYTES // max(1, b.shape[0] * b.element_size()))


def widen(b: Tensor) -> Tensor:
    """16-bit values accumulate in float32."""
    return b.float() if b.is_floating_point() and b.element_size() < 4 else b


def sample_sum(b: Tensor) -> Tensor:
    """``sum_n b[n]``: ``b.shape[1:]``, as a matrix-vector product where ``b`` is contiguous
    float32/64 (BLAS: up to several times faster on CPU than a reduction over the leading
    dimension)."""
    n = b.shape[0]
    if not (b.dtype in (torch.float32, torch.float64) and b.is_contiguous() and b.numel()):
        return b.sum(0)
    if b.numel() < _SMALL:  # (a kernel call dearer than the reduction)
        return b.sum(0)
    return torch.mv(b.reshape(n, -1).t(), b.new_ones(n)).view(b.shape[1:])


def sq_norms(b: Tensor) -> Tensor:
    """``||b[n]||²`` for each n: ``[N]``."""
    b = widen(b)
    flat = b if b.dim() == 2 else b.reshape(b.shape[0], math.prod(b.shape[1:]))  # (0-dim too)
    return torch.linalg.vector_norm(flat, dim=1).square()


def sum_sq(b: Tensor) -> Tensor:
    """``sum_n b[n]²``: ``b.shape[1:]``."""
    b = widen(b)
    if _recording(b):
        return b.pow(2).sum(0)
    return _blocked_sums(b, None)[1].view(b.shape[1:])


def shifted_sums(b: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """``sum_n (b[n] - shift)`` and ``sum_n (b[n] - shift)²``, each ``b.shape[1:]``: with a
    shift near the mean, the variance ``(s2 - s1²/N) / N`` is as accurate as a centred one
    even where the mean is large against the spread."""
    b = widen(b)
    if _recording(b):
        d = b - shift
        return d.sum(0), d.pow(2).sum(0)
    s1, s2 = _blocked_sums(b, shift.reshape(-1))
    return s1.view(b.shape[1:]), s2.view(b.shape[1:])


def mean_m2(b: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and centred sum of squares ``sum_n (b[n] - mean)²`` over the samples, from sums
    shifted by the first sample (one pass; the shifted-data algorithm)."""
    b = widen(b)
    n = b.shape[0]
    if n == 0:
        return b.sum(0), b.sum(0)
    shift = _first_sample(b)
    s1, s2 = shifted_sums(b, shift)
    return shift + s1 / n, s2 - s1 * s1 / n


def _first_sample(b: Tensor) -> Tensor:
    """``b[0]`` as a shift: near the mean, and known without a pass (a copy, unless autograd
    records: then part of the graph)."""
    return b[0] if _recording(b) else b[0].clone()


def _blocked_sums(b: Tensor, shift: Tensor | None) -> tuple[Tensor | None, Tensor]:
    """``sum_n (b[n] - shift)`` (None without a shift) and ``sum_n (b[n] - shift)²``,
    flattened, a block of columns at a time in one scratch buffer (a fresh temporary per
    block costs more than the arithmetic: page faults)."""
    flat, blk = _blocks(b)
    s2 = flat.new_empty(flat.shape[1])
    s1 = None if shift is None else flat.new_empty(flat.shape[1])
    scratch = flat.new_empty(flat.shape[0], min(blk, flat.shape[1]))
    for j in range(0, flat.shape[1], blk):
        part = flat[:, j : j + blk]
        tmp = scratch[:, : part.shape[1]]
        if shift is None:
            torch.mul(part, part, out=tmp)
        else:
            torch.sub(part, shift[j : j + blk], out=tmp)
            torch.sum(tmp, 0, out=s1[j : j + blk])
            tmp.square_()
        torch.sum(tmp, 0, out=s2[j : j + blk])
    return s1, s2


def quantities_of(b: Tensor, kinds: frozenset[type[Quantity]]) -> dict[str, Tensor]:
    """Quantities from materialised individual gradients ``b: [N, *shape]``."""
    n = b.shape[0]
    out: dict[str, Tensor] = {}
    if BatchGrad in kinds:
        out[BatchGrad.attr] = b
    if BatchL2Grad in kinds:
        out[BatchL2Grad.attr] = sq_norms(b)  # [N]
    if BatchDotGrad in kinds:
        flat = b.flatten(1)
        out[BatchDotGrad.attr] = flat @ flat.t()  # [N, N]
    if SumGradSquared in kinds:
        out[SumGradSquared.attr] = sum_sq(b)
    if Variance in kinds:
        if n == 0:
            out[Variance.attr] = b.new_full(b.shape[1:], float("nan"))
        else:
            out[Variance.attr] = mean_m2(b)[1] / n
    return out


def quantities_from_batch(
    b: Tensor, kinds: frozenset[type[Quantity]]
) -> tuple[dict[str, Tensor], Tensor]:
    """Quantities from materialised individual gradients ``b: [N, *shape]``, and their sum."""
    return quantities_of(b, kinds), sample_sum(b)


class Reducer:
    """Streams chunks of individual gradients ``[n_chunk, *shape]`` into the quantities,
    without keeping them unless ``BatchGrad`` is asked for. The variance uses shifted sums
    (shift: the first sample), as accurate chunked as in one piece."""

    def __init__(
        self, kinds: frozenset[type[Quantity]], like: Tensor, n: int, scratch: Scratch,
        slot: str = "",
    ) -> None:  # fmt: skip
        self.kinds, self.like, self.n = kinds, like, n
        self.scratch, self.slot = scratch, slot  # (slot: this reducer's own scratch buffer)
        self.parts: list[Tensor] = []
        self.full: Tensor | None = None  # preallocated [n, *shape] when not recording
        self.l2: list[Tensor] = []
        self.count = 0
        self.shift: Tensor | None = None  # Variance: the first chunk's mean
        self.s1: Tensor | None = None  # Variance: sum of (b - shift)
        self.s2: Tensor | None = None  # Variance: sum of (b - shift)²
        self.sgs: Tensor | None = None
        self.total: Tensor | None = None  # sum of the individual gradients

    def target(self, start: int, stop: int, like: Tensor) -> Tensor | None:
        """Buffer ``[stop - start, *shape]`` a rule may write chunk ``start:stop`` into, when
        autograd does not record: a slice of the result for ``BatchGrad`` computed in several
        chunks, the shared scratch buffer where the chunk is only reduced (see add)."""
        if torch.is_grad_enabled() or like.dtype != self.like.dtype:
            return None  # (16-bit chunks are converted: see add)
        if BatchGrad not in self.kinds:
            return self.scratch.take((stop - start, *self.like.shape), like, self.slot)
        if stop - start == self.n:
            return None
        if self.full is None:
            self.full = like.new_empty(self.n, *self.like.shape)
        return self.full[start:stop]

    def add(self, b: Tensor) -> None:
        if b.dtype != self.like.dtype:  # a 16-bit layer's (autocast) in the parameter's dtype
            b = b.to(self.like.dtype)
        k = b.shape[0]
        if BatchGrad in self.kinds:
            if k == self.n or _recording(b):
                self.parts.append(b)
            else:  # chunks go into one buffer: no second copy of the whole result
                if self.full is None:
                    self.full = b.new_empty(self.n, *b.shape[1:])
                part = self.full[self.count : self.count + k]
                if b.data_ptr() != part.data_ptr():  # not written in place by the rule
                    part.copy_(b)
                s = sample_sum(b)  # while the chunk is still in cache: about 2x faster on CPU
                self.total = s if self.total is None else self.total.add_(s)
            self.count += k
            return
        if BatchL2Grad in self.kinds:
            self.l2.append(sq_norms(b))
        if SumGradSquared in self.kinds:
            s = sum_sq(b)
            self.sgs = s if self.sgs is None else self.sgs + s
        if Variance in self.kinds and k:
            if self.shift is None:  # one sample: near the mean, and costs no pass
                self.shift = _first_sample(widen(b))
            s1, s2 = shifted_sums(b, self.shift)
            self.s1 = s1 if self.s1 is None else self.s1 + s1
            self.s2 = s2 if self.s2 is None else self.s2 + s2
            total = s1 + k * self.shift
        else:
            total = sample_sum(widen(b))
        self.total = total if self.total is None else self.total + total
        self.count += k

    def result(self) -> tuple[dict[str, Tensor], Tensor]:
        """The quantities and the sum of the individual gradients."""
        if BatchGrad in self.kinds and (self.parts or self.full is not None):
            if self.full is not None:
                return quantities_of(self.full, self.kinds), self.total
            b = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
            return quantities_from_batch(b, self.kinds)
        if self.total is None:
            return quantities_from_batch(self.like.new_zeros(0, *self.like.shape), self.kinds)
        out: dict[str, Tensor] = {}
        if BatchL2Grad in self.kinds:
            out[BatchL2Grad.attr] = self.l2[0] if len(self.l2) == 1 else torch.cat(self.l2)
        if SumGradSquared in self.kinds:
            out[SumGradSquared.attr] = self.sgs
        if Variance in self.kinds:
            if self.s1 is None:  # no samples
                out[Variance.attr] = self.like.new_full(self.like.shape, float("nan"))
            else:
                out[Variance.attr] = (self.s2 - self.s1 * self.s1 / self.count) / self.count
        return out, self.total
