"""Per-sample gradient clipping at the end of one backward (the engine side of
:func:`leanprop.clip_per_sample`).

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
individual gradients, whose weighted sum is formed directly. Memory: the kept inputs and
output gradients (about the activations of one forward more, at the end of backward), and no
individual gradients of linear, convolution or embedding layers.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

from .._torch_compat import post_accumulate_hooks
from ..errors import LeanpropError, LeanpropValueError, UnsupportedModelError
from .factors import Lookup, Outer, total
from .quantities import BatchL2Grad

if TYPE_CHECKING:
    from .cycle import ParamState
    from .registry import Rule

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
    """``g`` (batch first, ``[N, ...]``) with sample n's slice multiplied by ``a[n]``
    (``a: [N]``, cast to ``g``'s dtype)."""
    return g * a.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))


def scaled_factors(f: Outer | Lookup, a: Tensor) -> Outer | Lookup:
    """Factors of ``a_n W_n`` for ``a: [N]``: one side scaled per sample, the smaller one of
    an outer product's (``left: [N, S, O]`` or ``right: [N, S, I]``: ``W_n`` is linear in
    each), a lookup's rows (``[N, S, D]``)."""
    if isinstance(f, Outer):
        if f.right.numel() < f.left.numel():
            return Outer(f.left, scale_per_sample(f.right, a))
        return Outer(scale_per_sample(f.left, a), f.right)
    return Lookup(f.ids, scale_per_sample(f.rows, a), f.num)


def rule_reweighers(
    rule: Rule, module: nn.Module, args: tuple[Any, ...], g: Tensor, names: frozenset[str]
) -> dict[str, Reweigh]:
    """The reweighers of the parameters ``names`` of one call of a rule: the summed gradient
    with each sample's part scaled (from the rule's factors, the smaller side scaled; else
    its ordinary backward with the output gradient scaled).

    Args:
        rule: the layer's rule; module: the layer.
        args: its inputs, batch first (``[N, ...]``); g: its output gradient, batch first.
        names: the parameters to weigh.

    Returns:
        ``{name: reweigh}`` for the names the rule can weigh (the others are left out).
    """

    def by_backward(k: str, a: Tensor) -> Tensor:
        return rule.param_grads(module, args[0], scale_per_sample(g, a), frozenset({k}))[k]

    def by_factors(k: str, a: Tensor) -> Tensor:  # (scales the smaller side)
        return total(scaled_factors(rule.factors(module, args, g, frozenset({k}))[k], a))

    found: dict[str, Reweigh] = {}
    for k in names:
        if rule.factors is not None and k in rule.factors(module, args, g, frozenset({k})):
            found[k] = functools.partial(by_factors, k)
        elif rule.param_grads is not None:
            found[k] = functools.partial(by_backward, k)
    return found


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
    """Add each parameter's clipped gradient to its ``.grad``.

    Args:
        states: the parameters whose gradients this backward accumulated, with the squared
            norms ``[N]`` of their individual gradients in ``state.results``.
        clipping: the thresholds and the loss's reduction.
        n: the batch size N.

    Returns:
        The per-sample gradient norms before clipping, over ``states``: ``[N]``.
    """
    s = float(n) if clipping.reduction == "mean" else 1.0
    sq = {st: st.results[BatchL2Grad.attr] * s**2 for st in states}
    norms = torch.stack(list(sq.values())).sum(0).sqrt() if sq else torch.zeros(n)
    for st in states:
        if clipping.per_param is not None:
            c = clipping.per_param.get(st.param)
            if c is None:
                raise LeanpropValueError(
                    f"per-sample clipping: '{st.name}' has no threshold of its own (it was "
                    "frozen when the per-parameter thresholds were given); make the clipping "
                    "context again with a threshold for it."
                )
            a = (c / (sq[st].sqrt() + EPS)).clamp(max=1.0)
        else:
            a = (clipping.max_norm / (norms + EPS)).clamp(max=1.0)
        g = _weighted_sum(st, a * s).to(st.param.dtype)
        p = st.param
        p.grad = g if p.grad is None else p.grad.add_(g)
    return norms


class ClipState:
    """What one context's clipping keeps across backward passes: the gradients it left (to
    tell them from any other), how many backward passes each holds, the last norms.

    A parameter's gradient is handled in three steps in each backward: before autograd
    accumulates into ``.grad`` (:meth:`before_accumulate`: the gradient found there is kept),
    after (:meth:`after_accumulate`: it is put back, so autograd's unclipped gradient never
    stays), and at the end (:meth:`finish`: the clipped gradient is added). ``autograd.grad``
    accumulates nothing: its parameters are left alone (and it returns their ordinary,
    unclipped gradients)."""

    def __init__(self, clipping: Clipping) -> None:
        self.clipping = clipping
        # parameter -> (its .grad as clipping left it, that tensor's version, backward passes)
        self._held: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        # this backward: what .grad held before autograd accumulated (a copy, and its count)
        self._before: dict[ParamState, tuple[Tensor | None, int]] = {}
        self._accumulated: dict[ParamState, int] = {}  # ... and its count, once put back
        self.backwards = 0  # backward passes that clipped, since the context was made
        self.clipped_this_forward = False  # the current forward's clipped backward ran
        self.last_norms: Tensor | None = None

    def holds(self, p: nn.Parameter) -> bool:
        """Whether ``p.grad`` is what the clipping left (nothing added or changed since)."""
        entry = self._held.get(p)
        return (
            entry is not None and p.grad is not None and entry[0]() is p.grad
            and entry[1] == p.grad._version
        )  # fmt: skip

    def backwards_in(self, p: nn.Parameter) -> int:
        """How many clipped backward passes ``p.grad`` adds up (0: none, or not held)."""
        return self._held[p][2] if self.holds(p) else 0

    def before_accumulate(self, state: ParamState) -> None:
        """Autograd is about to hand ``state``'s parameter a gradient in a clipped backward."""
        p = state.param
        if p.grad is not None and not self.holds(p):
            raise UnsupportedModelError(
                f"per-sample clipping: '{state.name}'.grad already holds a gradient that the "
                "clipping did not leave (a backward outside the clipping, or a gradient set or "
                "changed by hand, or zeroed in place); the clipped gradient would be added to "
                "it. Set the gradients to None before the clipped backward "
                "(optimizer.zero_grad(set_to_none=True))."
            )
        if post_accumulate_hooks(p) > 1:  # (ours is one)
            raise UnsupportedModelError(
                f"per-sample clipping: '{state.name}' has another hook that runs when its "
                "gradient is accumulated (an optimizer stepping inside backward, such as "
                "InBackward, or a hook reading the gradient): it would see the unclipped "
                "gradient. Remove it (InBackward: .remove()) and step after the backward."
            )
        # set aside, not copied: autograd then stores this backward's gradient as a new .grad
        # instead of adding it to the held one, which stays as it is
        self._before[state] = (p.grad, self.backwards_in(p))
        p.grad = None

    def after_accumulate(self, state: ParamState) -> None:
        """Autograd accumulated into ``.grad``: put back what was there (the clipping adds
        this backward's clipped gradient to it at the end of backward)."""
        if state not in self._before:
            return
        before, count = self._before.pop(state)
        state.param.grad = before
        self._accumulated[state] = count

    def finish(self, states: list[ParamState], n: int) -> None:
        """End of a backward: add the clipped gradients of the parameters it accumulated
        (``states``: those with norms)."""
        counts, self._accumulated, self._before = self._accumulated, {}, {}
        states = [st for st in states if st in counts]
        if not states:  # (autograd.grad, or a backward for inputs only)
            return
        self.last_norms = clip_into_grads(states, self.clipping, n)
        self.backwards += 1
        self.clipped_this_forward = True
        for st in states:
            grad = st.param.grad
            self._held[st.param] = (weakref.ref(grad), grad._version, counts[st] + 1)

    def abort(self) -> None:
        """A backward raised: forget its partial state; a gradient set aside for autograd's
        accumulation is put back (the held ones stay as the backward before left them)."""
        for state, (before, _) in self._before.items():
            state.param.grad = before
        self._before, self._accumulated = {}, {}

    def new_forward(self) -> None:
        """A forward of the model starts: its backward may clip."""
        self.clipped_this_forward = False
