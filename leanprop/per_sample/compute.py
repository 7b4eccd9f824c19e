"""One call's quantities (the backward step of ``capture.py``).

A call is one use of a layer in the recorded forward (``cycle.Call``: its input, its output
gradient, where the batch is in each). :func:`compute` turns it into the asked quantities of
the layer's parameters: from a closed form where the rule has one (norms from factors, the
GGN's diagonal), else from the individual gradients a chunk of samples at a time
(``chunks.py``), reduced at once (``stats.py``), so that at most one chunk of one layer's
individual gradients exists at a time. It returns the call's summed gradient of each
parameter, which the replaced op hands to autograd (and the sum check compares).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from .._torch_compat import tree_flatten, tree_unflatten
from .batch import to_front
from .chunks import Scratch, sample_chunks
from .clipping import rule_reweighers
from .cycle import Call, ParamState
from .factors import norms_are_cheaper, sum_of_squares
from .factors import total as factors_total
from .quantities import BatchGrad, BatchL2Grad, Quantity, SumGradSquared
from .registry import INPUT, RuleOptions
from .rules.fallback import batch_dim_of, fallback_batch_grads
from .rules.packed_rnn import packed_rnn_batch_grads
from .stats import Reducer, quantities_from_batch, widen

# observer(module, inputs with the batch first, output gradient with the batch first)
Observer = Callable[[nn.Module, tuple[Any, ...], Tensor], None]


@dataclass(frozen=True, eq=False)
class Work:
    """A call's computation's view of its context: the quantities asked for, each
    parameter's state (the one thing it writes: results, totals, clipping's reweighers),
    whether per-sample clipping is on and whether a replaced op's sums go into ``.grad``, the
    observers of rule calls (curvature's Kronecker factors), the scratch buffers, and the
    rules' options on a device."""

    kinds: frozenset[type[Quantity]]
    states: Mapping[nn.Parameter, ParamState]
    clipping: bool
    sums_wanted: bool
    observers: Sequence[Observer]
    scratch: Scratch
    options: Callable[[torch.device], RuleOptions]


def _like(x: Any, g: Tensor) -> Any:
    """A floating input in the dtype its layer computed in (the output gradient's dtype), so
    rules reproduce what autocast ran."""
    if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != g.dtype:
        return x.to(g.dtype)
    return x


def _autocast_as(call: Call, leaves: list[Any]) -> Any:
    """Autocast as it was during the call's forward (off if it was off)."""
    if call.autocast is not None:
        return torch.autocast(call.autocast[0], dtype=call.autocast[1])
    device = next((t.device.type for t in leaves if isinstance(t, Tensor)), "cpu")
    return torch.autocast(device, enabled=False)


def _slice_batch(x: Any, start: int, stop: int, n: int, dim: int) -> Any:
    if stop - start == n:  # the whole batch in one chunk
        return x
    if isinstance(x, Tensor) and x.dim() > dim and x.shape[dim] == n:
        return x.narrow(dim, start, stop - start)
    return x


_L2_ONLY = frozenset({BatchL2Grad})
_SGS_ONLY = frozenset({SumGradSquared})
_SHARED = frozenset({BatchGrad})  # what a use of a shared parameter keeps (summed with others)


def compute(call: Call, work: Work) -> dict[str, Tensor]:
    """Compute one call's quantities into its parameters' states (``work.states``).

    Args:
        call: one use of a layer: its input ``[N, ...]`` (or with the batch at
            ``call.in_bd``), its output gradient(s), its parameters by name.
        work: what the computation reads of its context, and the states it writes.

    Returns:
        The call's summed gradient of each parameter, ``{name: [*p.shape]}`` (its sum of
        individual gradients, which a replaced op hands to autograd), and ``INPUT``: the
        input's gradient ``[*x.shape]`` where the rule gave it with the individual gradients.
        A parameter is missing where its closed form gave no sum.
    """
    site, kinds, params = call.site, work.kinds, call.params
    rule = site.rule
    states = {k: work.states[p] for k, p in params.items()}
    # a rule's input and output gradient with the batch first, made once (and, for the
    # closed forms, each input in the dtype the layer computed in: ``liked``)
    fronted = _fronted(call) if rule is not None and call.n else None
    liked = None
    if work.observers and fronted is not None:
        for observe in work.observers:
            observe(site.module, *fronted)
    opts = work.options(next(iter(params.values())).device)
    first = call.grads[0]
    dtype = first.dtype if first is not None else next(g.dtype for g in call.grads if g is not None)
    dtype = call.autocast[1] if call.autocast is not None else dtype
    for state in states.values():
        state.saw(dtype)
    # several contributions (weight sharing, or one already formed: a use only counted
    # when a reentrant checkpoint recomputes it) are summed as individual gradients
    multi = frozenset(k for k, st in states.items() if st.uses > 1 or st.formed)
    single = frozenset(params) - multi
    if work.clipping and call.n:
        # each single use leaves its reweigher; one without (no rule, or none that gives
        # the summed gradient) keeps its individual gradients for the weighted sum
        reweighed = _leave_reweighers(call, single, work)
        multi, single = multi | (single - reweighed), reweighed
    sums: dict[str, Tensor] = {}
    if call.n == 0:
        for k, p in params.items():
            empty = p.new_zeros(0, *p.shape)
            sums[k] = _store(p, k in multi, quantities_from_batch(empty, kinds | _SHARED), work)
        return sums
    closed: dict[str, Tensor] = {}
    l2_only = kinds == _L2_ONLY
    # clipping hands autograd zeros for a replaced op (see below): norms alone are wanted
    hands_zeros = call.replaced and not work.sums_wanted
    if hands_zeros:
        opts = replace(opts, sums_wanted=False)
    if single and l2_only and rule is not None and rule.batch_l2 is not None:
        args, g = liked = _like_all(fronted)
        closed = rule.batch_l2(site.module, args, g, single, opts)
        for k, v in closed.items():
            states[k].results[BatchL2Grad.attr] = widen(v)
    if single and kinds == _SGS_ONLY and rule is not None:
        closed = _closed_sum_of_squares(call, single, work)  # (the GGN's diagonal passes)
    if closed and hands_zeros:
        # clipping puts back what autograd accumulates: hand it zeros, not the summed
        # gradient (a use that escaped the op still shows in the check)
        for k in closed:
            p = params[k]
            sums[k] = states[k].total = p.new_zeros(()).expand_as(p)
    elif closed:  # their sums, for the check (and handed to autograd: not computed again)
        liked = liked or _like_all(fronted)
        sums.update(_closed_totals(call, frozenset(closed), work, liked))
    names = (single - closed.keys()) | multi
    if multi and rule is not None and rule.factors is not None:
        # a shared weight: its use as factors (norms without individual gradients, or
        # added to those of its other uses without a temporary)
        args, g = liked = liked or _like_all(fronted)
        for k, f in rule.factors(site.module, args, g, multi).items():
            # (clipping: the weighted sum from factors, without individual gradients)
            keep = l2_only and (norms_are_cheaper(f) or work.clipping)
            sums[k] = states[k].add_factors(f, keep, opts.workspace_bytes)
        names -= sums.keys()
    if not names:
        return sums
    scratch = work.scratch
    reducers = {  # (in a fixed order: an error names the first, whatever the hash seed)
        k: Reducer(kinds if k in single else _SHARED, params[k], call.n, scratch, k)
        for k in sorted(names)
    }
    inputs: list[Tensor] = []  # the input's gradient, where the rule gives it too
    asked = names | {INPUT} if _input_grad_too(call) else names
    for chunk in _chunks(call, asked, opts, reducers, fronted):
        for k, b in chunk.items():
            if k == INPUT:
                inputs.append(b)
            else:
                reducers[k].add(b)
    for k, r in reducers.items():
        sums[k] = _store(params[k], k in multi, r.result(), work)
    x = call.args[0] if call.args else None
    grad_x = inputs[0] if len(inputs) == 1 else torch.cat(inputs) if inputs else None
    if grad_x is not None and isinstance(x, Tensor) and grad_x.shape == x.shape:
        sums[INPUT] = grad_x if grad_x.dtype == x.dtype else grad_x.to(x.dtype)
    return sums


def _input_grad_too(call: Call) -> bool:
    """Whether to ask a replaced op's rule for the input's gradient with the individual
    gradients (its layout is the input's: the batch first, not split)."""
    rule = call.site.rule
    return (
        call.replaced and rule is not None and rule.input_grad_too
        and not torch.is_grad_enabled() and call.in_bd.dim == 0 and call.in_bd.inner == 1
    )  # fmt: skip


def _leave_reweighers(call: Call, names: frozenset[str], work: Work) -> frozenset[str]:
    """Clipping: each parameter ``names`` of a rule call whose rule gives the summed
    gradient keeps its reweigher (``clipping.rule_reweighers``), which holds the call's
    input and output gradient until the end of backward: a parameter whose individual
    gradients take well less (at most half: a bias, a norm layer's weight on sequences,
    an early convolution's) keeps those instead (less memory, and no second pass).
    Returns the names that got one (the others keep their individual gradients)."""
    if call.site.rule is None:
        return frozenset()
    front_args, g = _fronted(call)
    held = g.numel() + sum(a.numel() for a in front_args if isinstance(a, Tensor))
    names = frozenset(k for k in names if 2 * call.n * call.params[k].numel() > held)
    if not names:
        return frozenset()
    args = tuple(_like(a, g) for a in front_args)
    found = rule_reweighers(call.site.rule, call.site.module, args, g, names)
    for k, reweigh in found.items():
        work.states[call.params[k]].reweigh.append(reweigh)
    return frozenset(found)


def _closed_sum_of_squares(call: Call, names: frozenset[str], work: Work) -> dict[str, Tensor]:
    """``SumGradSquared`` of the parameters ``names`` of a rule call whose individual
    gradients are single outer products (a linear layer on ``[N, I]``): from the squared
    factors; ``{name: result}`` for those done."""
    if call.site.rule.factors is None:
        return {}
    front_args, g = _fronted(call)
    args = tuple(_like(a, g) for a in front_args)
    done = {}
    for k, f in call.site.rule.factors(call.site.module, args, g, names).items():
        value = sum_of_squares(f)
        if value is not None:
            work.states[call.params[k]].results[SumGradSquared.attr] = value
            done[k] = value
    return done


def _closed_totals(
    call: Call, names: frozenset[str], work: Work, fronted: tuple[tuple[Any, ...], Tensor]
) -> dict[str, Tensor]:
    """The summed gradients of the parameters ``names`` whose quantities came from a
    closed form (from the rule's ordinary backward, else its factors): kept as their total,
    so the sum check covers them as it covers the others. ``fronted``: the rule's inputs and
    output gradient (``_like_all``)."""
    rule = call.site.rule
    args, g = fronted
    sums = {}
    if rule.param_grads is not None:  # (the layer's own backward: linear, convolutions)
        sums.update(rule.param_grads(call.site.module, args[0], g, names))
    rest = names - sums.keys()
    if rest and rule.factors is not None:  # (an embedding)
        for k, f in rule.factors(call.site.module, args, g, rest).items():
            sums[k] = factors_total(f)
    for k, total in sums.items():
        work.states[call.params[k]].total = total
    return sums


def _store(p: nn.Parameter, multi: bool, result: tuple[dict, Tensor | None], work: Work) -> Tensor:
    """Keep one call's results for ``p`` in its state.

    Args:
        p: the parameter.
        multi: one of several uses of ``p`` (its individual gradients ``[N, *p.shape]`` are
            added to the others'), or its only one (its quantities are kept as they are).
        result: ``(quantities by attribute name, summed gradient [*p.shape])`` of this use.
        work: the context's states.

    Returns:
        The use's summed gradient ``[*p.shape]``.
    """
    state = work.states[p]
    values, total = result
    if multi:
        state.add_batch(values[BatchGrad.attr].to(p.dtype))
        return total
    state.results.update(values)
    state.total = total
    return total


def _fronted(call: Call) -> tuple[tuple[Any, ...], Tensor]:
    """A rule call's input and output gradient with the batch first: ``[N, ...]``."""
    n, g = call.n, call.grads[0]
    return (to_front(call.args[0], call.in_bd, n), *call.args[1:]), to_front(g, call.out_bd, n)


def _like_all(fronted: tuple[tuple[Any, ...], Tensor]) -> tuple[tuple[Any, ...], Tensor]:
    """A rule call's inputs and output gradient (:func:`_fronted`), each floating input in
    the dtype the layer computed in (see :func:`_like`)."""
    args, g = fronted
    return tuple(_like(a, g) for a in args), g


class _Targets(Mapping[str, "Tensor | None"]):
    """The buffers a rule may write a chunk's individual gradients into (``Reducer.target``),
    taken only when the rule asks for one (a rule that returns a view of what it has, a
    linear layer's bias, takes none)."""

    def __init__(
        self, reducers: dict[str, Reducer], names: frozenset[str], start: int, stop: int, g: Tensor
    ) -> None:
        self._reducers, self._names, self._chunk, self._g = reducers, names, (start, stop), g

    def __getitem__(self, k: str) -> Tensor | None:
        if k not in self._names:
            raise KeyError(k)
        return self._reducers[k].target(*self._chunk, self._g)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _chunks(
    call: Call, names: frozenset[str], opts: RuleOptions, reducers: dict[str, Reducer],
    fronted: tuple[tuple[Any, ...], Tensor] | None,
) -> Iterator[dict]:  # fmt: skip
    """Each chunk's individual gradients ``{name: [n_chunk, *p.shape]}`` (``fronted``: a rule
    call's inputs and output gradient with the batch first, ``_fronted``)."""
    site, n = call.site, call.n
    own = names - {INPUT}  # (INPUT: the rule's input gradient asked for too)
    if site.rule is not None:
        front_args, front_g = fronted
        per_sample = (
            site.rule.workspace(site.module, front_args, front_g, opts)
            if site.rule.workspace is not None
            else sum(call.params[k].numel() for k in own) * front_g.element_size()
        )
        dim = 0
    else:
        per_sample = 2 * sum(call.params[k].numel() for k in names) * 4
        dim = batch_dim_of(site.module)
    for start, stop in sample_chunks(n, per_sample, opts.workspace_bytes):

        def cut(x: Any, start: int = start, stop: int = stop, dim: int | None = dim) -> Any:
            if dim is None:
                return x
            return _slice_batch(x, start, stop, n, dim)

        if site.rule is not None:
            g = cut(front_g)
            args = tuple(_like(cut(a), g) for a in front_args)
            if site.rule.accepts_out:
                out = _Targets(reducers, own, start, stop, g)
                yield site.rule.batch_grads(site.module, args, g, names, opts, out=out)
            else:
                yield site.rule.batch_grads(site.module, args, g, names, opts)
        elif call.packed:  # one sample at a time anyway: the whole batch in one chunk
            with _autocast_as(call, tree_flatten((call.args, call.kwargs))[0]):
                yield packed_rnn_batch_grads(site.module, call.args, call.kwargs, call.grads, names)
            return
        elif call.in_dims is None:  # batch tracking off: the module's documented layout
            args = tuple(cut(a) for a in call.args)
            kwargs = {k: cut(v) for k, v in call.kwargs.items()}
            grads = [None if g is None else cut(g) for g in call.grads]
            yield fallback_batch_grads(site.module, args, kwargs, grads, names, stop - start)
        else:
            leaves, spec = tree_flatten((call.args, call.kwargs))
            cut_leaves = [cut(t, dim=d) for t, d in zip(leaves, call.in_dims, strict=True)]
            args, kwargs = tree_unflatten(cut_leaves, spec)
            grads = [
                None if g is None else cut(g, dim=d)
                for g, d in zip(call.grads, call.out_dims, strict=True)
            ]
            with _autocast_as(call, leaves):  # recompute in the dtypes the forward ran in
                batch = fallback_batch_grads(
                    site.module, args, kwargs, grads, names, stop - start,
                    in_dims=call.in_dims, out_dims=call.out_dims,
                )  # fmt: skip
            yield batch
