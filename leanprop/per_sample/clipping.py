"""Per-sample gradient clipping at the end of one backward (the engine side of
``leanprop.private``).

With ``c_n`` sample n's contribution to a parameter's gradient (``quantities.py``), the
gradient of sample n's own loss is ``s c_n``, ``s = N`` for a mean-reduced loss and ``1`` for
a summed one. Clipping replaces the parameter's gradient by

    sum_n min(1, C / (||s c_n|| + 1e-6)) s c_n

where ``||s c_n||`` is the norm over all parameters (flat clipping: one threshold ``C``), or
over the parameter alone with its own threshold (per-parameter clipping). The ``1e-6`` is
Opacus' (so that results agree with it).

No ``[N, *p.shape]`` tensor is needed for layers whose individual gradients are linear in the
output gradient, which is every layer: ``sum_n a_n c_n`` is the ordinary gradient of the layer
with its output gradient scaled by ``a_n`` per sample. Each parameter's use therefore leaves a
*reweigher* in backward (its input and output gradient, kept until the norms of every layer
are known), or, where no rule offers one (the torch.func fallback, elementwise uses), its
individual gradients, whose weighted sum is formed directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from ..errors import LeanpropError
from .factors import Lookup, Outer, total
from .quantities import BatchL2Grad

if TYPE_CHECKING:
    from .cycle import ParamState

# reweigh(a) -> sum_n a_n c_n of one use of a parameter; a: [N]
Reweigh = Callable[[Tensor], Tensor]
EPS = 1e-6  # as Opacus: min(1, C / (norm + 1e-6))


@dataclass(frozen=True)
class Clipping:
    """What clipping in backward does.

    Attributes:
        max_norm: the threshold ``C`` of flat clipping (None with per-parameter thresholds).
        per_param: per-parameter thresholds (each parameter clipped by its own norm).
        reduction: how the loss reduces over samples (``"mean"``: ``s = N``; ``"sum"``: 1).
    """

    max_norm: float | None
    per_param: Mapping[nn.Parameter, float] | None = field(default=None, hash=False)
    reduction: Literal["mean", "sum"] = "mean"


def scale_per_sample(g: Tensor, a: Tensor) -> Tensor:
    """``g`` (batch first, ``[N, ...]``) with sample n's slice multiplied by ``a[n]``."""
    return g * a.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))


def scaled_factors(f: Outer | Lookup, a: Tensor) -> Outer | Lookup:
    """Factors of ``a_n W_n`` (the output-gradient side scaled)."""
    if isinstance(f, Outer):
        return Outer(scale_per_sample(f.left, a), f.right)
    return Lookup(f.ids, scale_per_sample(f.rows, a), f.num)


def _weighted_sum(state: ParamState, a: Tensor) -> Tensor:
    """``sum_n a_n c_n`` of one parameter in this backward."""
    if not a.numel():  # no samples
        return torch.zeros_like(state.param)
    if state.batch is not None:
        return torch.tensordot(a.to(state.batch.dtype), state.batch, dims=1)
    if state.factored is not None:
        parts = [total(scaled_factors(f, a)) for f in state.factored.uses]
    else:
        parts = [r(a) for r in state.reweigh]
    if not parts:
        raise LeanpropError(
            f"per_sample clipping: '{state.name}' has norms but no way to form its clipped "
            "gradient (an internal error: please report it with the model)."
        )
    return sum(parts[1:], parts[0])


def clip_into_grads(states: list[ParamState], clipping: Clipping, n: int) -> Tensor:
    """Add each parameter's clipped gradient to its ``.grad`` (to which this backward added
    nothing), from the individual gradients' squared norms in ``state.results``. Returns the
    per-sample gradient norms before clipping, over all parameters: ``[N]``."""
    s = float(n) if clipping.reduction == "mean" else 1.0
    sq = {st: st.results[BatchL2Grad.attr] * s**2 for st in states}
    norms = torch.stack(list(sq.values())).sum(0).sqrt() if sq else torch.zeros(n)
    for st in states:
        if clipping.per_param is not None:
            own = sq[st].sqrt()
            a = (clipping.per_param[st.param] / (own + EPS)).clamp(max=1.0)
        else:
            a = (clipping.max_norm / (norms + EPS)).clamp(max=1.0)
        g = _weighted_sum(st, a * s).to(st.param.dtype)
        p = st.param
        p.grad = g if p.grad is None else p.grad.add_(g)
    return norms
