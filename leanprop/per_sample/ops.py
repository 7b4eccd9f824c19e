"""Per-sample gradients of a parameter used directly in an op that no rule covers.

A module without a closed-form rule (``nn.MultiheadAttention``, BatchNorm in eval mode, HF's
``Conv1D``, a class token or a learned scale in a model's own forward) uses its parameters in
ops. Each such op that also takes a batched operand runs through :class:`OpCapture`:

* forward runs the op once, in a small graph of its own (on views of its inputs), so dropout and any
  other randomness inside the op happen once and are kept;
* backward computes the op's ordinary gradients from that graph, and each sample's
  contribution ``c_n(w) = J_wᵀ (g ⊙ m_n)`` for every parameter operand ``w``, where ``m_n``
  masks the output gradient ``g`` to sample n's entries (the batch dimension of each output is
  known from batch tracking). Samples go in chunks through one batched vector-Jacobian product
  (``is_grads_batched``), or one at a time where vmap cannot batch the op's backward.

A parameter-derived operand (e.g. ``weight.t()``) hands its contributions on to its parameters
with :func:`hand_back`. Exact for any op that keeps samples apart; costs about one backward of
the op per sample, so closed-form rules stay the fast path.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from .._torch_compat import (
    checkpoint_saves_tensors,
    checkpointed_saved_tensors,
    engine_grad,
    function_modes_active,
    graph_nodes,
    saveable,
    saved_tensor_hooks_in_effect,
)
from .batch import BatchDim, ThroughCopies, op_name, to_front
from .chunks import Scratch, sample_chunks
from .cycle import bits
from .op_rules import closed_form, closed_norms, linear_form, linear_input_grad, linear_reweigher
from .pytree import flatten, unflatten
from .stats import sample_sum


class Nesting(threading.local):
    """How many blocks of one kind run on this thread (entered and left in pairs)."""

    depth = 0

    def enter(self) -> None:
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1


# per_sample contexts running their own per-sample work on this thread (see
# PerSample.own_work): backward passes run by that work are not the model's backward
WORKING = Nesting()


def working() -> bool:
    """Whether some context runs its own per-sample work on this thread."""
    return WORKING.depth > 0


# backward passes of ours through the model's graph on this thread (see
# PerSample.model_pass): a block a checkpoint recomputes there is the model's, for every
# context
MODEL_PASSES = Nesting()


def in_model_pass() -> bool:
    """Whether some context runs a backward of its own through the model's graph here."""
    return MODEL_PASSES.depth > 0


class Contribute:
    """Where one forward's captured uses hand their per-sample contributions; closed when the
    forward's records are dropped, and while a backward differentiates a ``create_graph``
    backward's results (``Cycle.graph_closed``): the ops then run their ordinary backward."""

    def __init__(
        self,
        sink: Callable[[dict[nn.Parameter, Tensor], torch.dtype | None, Contribute], None],
        computing: Callable[[], AbstractContextManager[None]],
        passive: Callable[[], bool],
        norms_only: Callable[[Tensor], bool],
        norms: Callable[..., None],
        scratch: Scratch,
        sums_wanted: Callable[[], bool],
        model_pass: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self.sink = sink  # sink(batch, compute_dtype, source): source is this object
        self.computing = computing  # marks the per-sample work (its autograd calls) as ours
        # inside computing(): a backward of ours through the model's graph (a checkpoint's
        # recomputation there is followed as the forward was: PerSample.model_pass)
        self.model_pass = model_pass
        self.passive = passive  # a backward that is not for parameters (e.g. d output / d x)
        # norms_only(t): t is a parameter used once, and only BatchL2Grad is asked for;
        # norms(p, ||c_n||² [N], summed gradient, compute dtype, source, reweigher) then stores
        # its results (reweigher() makes its weighted sum for clipping, or None)
        self.norms_only, self.norms = norms_only, norms
        self.scratch = scratch  # temporaries of the per-sample work, reused by each op
        # sums_wanted(): the summed gradients go into .grad (False under clipping, which puts
        # back what autograd accumulates and forms its own weighted sums: zeros will do)
        self.sums_wanted = sums_wanted
        self._closed = False
        self.dropped_n: int | None = None  # samples, if a later forward dropped this one

    @property
    def closed(self) -> bool:
        """No contributions wanted now: the forward is over, this backward is passive, or it
        is a context's own per-sample work (another context's, when contexts are nested)."""
        return self._closed or self.passive() or working()

    def close(self) -> None:
        self._closed = True

    def reopen(self) -> None:
        """Take contributions again: closed by a ``create_graph`` backward, and another
        backward through the same forward comes (see ``Cycle.reopen``)."""
        self._closed = False

    def refuse_if_dropped(self) -> None:
        """A backward through a forward whose records a later forward (of another batch size)
        dropped, before its backward came: it would get no per-sample quantities."""
        if self.dropped_n is None or self.passive():
            return
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"per_sample: this backward goes through a forward of {self.dropped_n} samples whose "
            "records were dropped: another forward of the model, of another batch size, ran "
            "after it and before this backward, so leanprop cannot compute its per-sample "
            "quantities. Run each forward's backward before the next forward (or run the other "
            "forward under torch.no_grad())."
        )

    def __call__(
        self, batch: dict[nn.Parameter, Tensor], compute_dtype: torch.dtype | None = None,
        summed: dict[nn.Parameter, Tensor] | None = None,
    ) -> None:  # fmt: skip
        """``compute_dtype``: the precision the contributions were computed in, where lower
        than their own dtype (the autocast dtype the op ran in; a parameter's use in a lower
        precision, ``weight.float()`` in a float64 model): the sum check's tolerance;
        ``summed``: a parameter's sum of ``batch``, where the op hands it to autograd as the
        parameter's gradient."""
        self.sink(batch, compute_dtype, self, summed or {})


_TENSOR = object()  # marks where a tensor output goes back into the op's output structure


def hand_back(
    w: Tensor | ThroughCopies, params: tuple[nn.Parameter, ...], per_sample: Tensor,
    contribute: Contribute, compute_dtype: torch.dtype | None = None,
    summed: Tensor | None = None,
) -> None:  # fmt: skip
    """Give each parameter ``w`` derives from its contributions ``(dw/dp)ᵀ per_sample[n]``.

    Args:
        w: a parameter, or a batch-free tensor computed from ``params`` (or where the product
            from it goes, for one computed inside a reentrant checkpoint's recomputation).
        per_sample: ``[N, *w.shape]``, each sample's contribution to ``w``'s gradient.
        summed: ``per_sample``'s sum, as the op hands it to autograd for ``w``.
    """
    if len(params) == 1 and w is params[0]:
        contribute({w: per_sample}, compute_dtype, {w: summed} if summed is not None else None)
        return
    grads = _batched_vjp_to(w, params, per_sample, contribute.model_pass)
    n = per_sample.shape[0]
    batch = {
        p: g if g is not None else p.new_zeros(n, *p.shape)
        for p, g in zip(params, grads, strict=True)
    }
    # (the sum check's tolerance: a parameter whose use was computed in a lower precision than
    # the parameter, HF Gemma's `weight.float()` in a float64 model, is checked as such)
    low = per_sample.dtype
    lower = {p: b for p, b in batch.items() if bits(low) < bits(p.dtype)}
    if compute_dtype is not None or not lower:
        contribute(batch, compute_dtype)
        return
    contribute(lower, low)
    rest = {p: b for p, b in batch.items() if p not in lower}
    if rest:
        contribute(rest)


def _batched_vjp_to(
    w: Tensor | ThroughCopies, params: tuple[nn.Parameter, ...], per_sample: Tensor,
    attempt: Callable[[], AbstractContextManager[None]],
) -> list[Tensor | None]:  # fmt: skip
    """``(dw/dp)ᵀ per_sample[n]`` for each of ``params`` (None: ``w`` does not use it); each
    backward through the model's graph inside ``attempt()`` (see :func:`_rows_grad`)."""
    if isinstance(w, Tensor):
        return _rows_grad([w], params, [per_sample], attempt)
    # (w's graph ends at the checkpoint's detached copies: each one's part goes on from the
    # tensor it was detached from)
    k = len(w.copies)
    grads = _rows_grad([w.tensor], (*w.copies, *params), [per_sample], attempt)
    total = list(grads[k:])
    for g, source in zip(grads[:k], w.sources, strict=True):
        if g is None:
            continue
        for j, more in enumerate(_batched_vjp_to(source, params, g, attempt)):
            if more is not None:
                total[j] = more if total[j] is None else total[j] + more
    return total


@dataclass(eq=False)
class OpSpec:
    """What :class:`OpCapture` needs besides the op's tensors."""

    func: Callable[..., Any]
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list[Any]  # non-tensor leaves (tensor places are filled from the inputs)
    tensor_at: list[int]  # leaf index of each tensor input
    captured: dict[int, tuple[nn.Parameter, ...]]  # tensor input -> the parameters it is/uses
    originals: dict[int, Tensor | ThroughCopies]  # the captured inputs (parameters, derived)
    batch_of: Callable[[Tensor], BatchDim | None]  # where the batch is in an output
    n: int
    workspace_bytes: int
    contribute: Contribute
    out_spec: Any = None
    out_leaves: list[Any] | None = None  # non-tensor output leaves (_TENSOR: a tensor)
    out_batch: list[BatchDim | None] | None = None  # of each tensor output
    in_batch: list[BatchDim | None] | None = None  # of each tensor input
    n_args: int = 0  # tensors passed positionally (the first ones)
    autocast_dtype: torch.dtype | None = None  # the op ran under autocast to this dtype
    # a layer rule that takes over the captured inputs: rule(inputs, grad, out_batch) stores
    # their quantities itself and returns the summed gradients it has ({position: grad})
    rule: Callable[[list[Tensor], Tensor, BatchDim], dict[int, Tensor]] | None = None
    nested: bool = False  # another context captured the op inside its local graph


def _captured_inside(outs: Sequence[Tensor], local: Sequence[Tensor]) -> bool:
    """Whether the local graph of an op (``outs`` back to the views ``local``) runs one of
    the per-sample engine's autograd functions: another per_sample context (nested contexts on
    the same parameters) captured the op, or an operand of it, inside it. (Not leanprop's
    other functions: ``chunked_linear_cross_entropy``'s own, a gradient transform's.)"""
    stop = frozenset(id(t.grad_fn) for t in local if t.grad_fn is not None)
    return any(
        getattr(node, "_forward_cls", type).__module__.startswith(_ENGINE)
        for node in graph_nodes((o.grad_fn for o in outs), stop)
    )


_ENGINE = __name__.rpartition(".")[0] + "."  # (this package: leanprop.per_sample.)


def _kept(t: Tensor) -> Tensor:
    return t


_NO_HOOKS = contextlib.nullcontext()


def saving_own(keep: bool) -> AbstractContextManager[Any]:
    """Where ``keep``: saved-tensor hooks that keep what the ops inside save, in place of a
    non-reentrant checkpoint's, which drop it and recompute it in the first backward that
    needs it. A per-sample pass of ours through the graph is a backward of its own: the
    checkpoint would recompute the whole block once more there for each such pass
    (``PerSample.model_pass``)."""
    return torch.autograd.graph.saved_tensors_hooks(_kept, _kept) if keep else _NO_HOOKS


# the ops whose captured parameters have closed forms (op_rules.py): no per-sample pass
# through their local graph
_LINEAR_FORMS = frozenset({"linear", "matmul", "mm", "addmm"})
_CLOSED_FORM_OPS = _LINEAR_FORMS | {"chunked_linear_cross_entropy"}


def _local_graph(op: OpSpec, tensors: Sequence[Tensor]) -> tuple[list[Tensor], Any]:
    """The op on views of its tensors: our gradients stop at the views (autograd.grad's
    inputs), which stay differentiable with respect to the op's inputs (create_graph)."""
    with torch.enable_grad():
        local = [t.view_as(t) if t.requires_grad else t for t in tensors]
        leaves = list(op.leaves)
        for i, t in zip(op.tensor_at, local, strict=True):
            leaves[i] = t
        args, kwargs = unflatten(leaves, op.spec)
        return local, op.func(*args, **kwargs)


def _fresh_graph(
    op: OpSpec, tensors: Sequence[Tensor], outs: list[Tensor] | None
) -> tuple[list[Tensor], list[Tensor]]:
    """The op's graph made anew from its inputs; refused where its outputs differ from the
    forward's ``outs`` (None: a deterministic op, nothing to compare)."""
    local, out = _local_graph(op, tensors)
    fresh = [o for o in flatten(out)[0] if isinstance(o, Tensor)]
    if outs is not None and not all(torch.equal(a, b) for a, b in zip(fresh, outs, strict=True)):
        from ..errors import UnsupportedModelError

        name = getattr(op.func, "__name__", repr(op.func))
        raise UnsupportedModelError(
            f"per_sample: backward(create_graph=True) through '{name}', which draws random "
            "numbers (dropout inside the op): its second derivatives would use other random "
            "numbers. Switch the op's randomness off (eval mode or p=0) to differentiate the "
            "quantities."
        )
    return local, fresh


def _stub(o: Tensor) -> Tensor | None:
    """What is saved of a deterministic op's output: a tensor of no elements whose graph
    starts at the output's node. A backward from the output needs that node, not the values,
    which saving the output would keep alive until the backward passes (an attention
    projection's output, split into heads and copied, is otherwise freed in the forward)."""
    if not o.requires_grad:
        return None
    with torch.enable_grad():  # (Function.forward runs without)
        return o.narrow(0, 0, 0).clone() if o.dim() else o


def _root(stub: Tensor | None) -> Tensor | GradientEdge | None:
    """The output :func:`_stub` stands for, as a root of a backward."""
    if stub is None or stub.dim() == 0:
        return stub
    ((view, _),) = stub.grad_fn.next_functions  # clone <- narrow <- the output's node
    return GradientEdge(*view.next_functions[0])


class OpCapture(torch.autograd.Function):
    """``func(*args, **kwargs)`` whose backward also hands out per-sample contributions."""

    @staticmethod
    def forward(ctx: Any, op: OpSpec, *tensors: Tensor) -> tuple[Tensor, ...]:
        # (under a non-reentrant checkpoint, the local graph of an op without a closed form
        # keeps its own saved tensors: the checkpoint would recompute them for our per-sample
        # pass through it, a backward of its own, and refuse that recomputation; other hooks,
        # such as save_on_cpu's, and the linear ops' graphs, stay as they are)
        closed_form_op = op_name(op.func) in _CLOSED_FORM_OPS
        read = closed_form_op and _closed_forms_read(op, tensors)
        own = not read and checkpoint_saves_tensors()
        with saving_own(own):
            local, out = _local_graph(op, tensors)
        out_leaves, op.out_spec = flatten(out)
        outs = [o for o in out_leaves if isinstance(o, Tensor)]
        # (another context's capture inside: only where another mode is active, as an outer
        # context's interception is while this one's runs the op; else no walk of the graph)
        op.nested = function_modes_active() > 0 and _captured_inside(outs, local)
        op.out_leaves = [_TENSOR if isinstance(o, Tensor) else o for o in out_leaves]
        ctx.op = op
        ctx.n_local = len(local)
        # the outputs of a linear op and of a layer rule's (an embedding's: deterministic) are
        # not needed by its backward, which leaves them free to change in place (`h *= 2`);
        # another op's are compared with a fresh graph's under create_graph (randomness
        # inside the op)
        ctx.stubbed = closed_form_op or op.rule is not None
        ctx.out_grad = [o.requires_grad for o in outs]
        ctx.held = None
        if ctx.stubbed:
            kept_outs = list(map(_stub, outs))
        elif saved_tensor_hooks_in_effect() is None:
            ctx.held, kept_outs = _held(outs)
        else:  # (a checkpoint's or save_on_cpu's hooks: saved as they want)
            kept_outs = outs
        ctx.save_for_backward(*local, *kept_outs, *map(saveable, tensors))
        results = tuple(o.detach() for o in outs)
        ctx.mark_non_differentiable(*(r for r in results if not r.is_floating_point()))
        return results

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        op: OpSpec = ctx.op
        saved = checkpointed_saved_tensors(ctx)
        k = ctx.n_local
        local, outs = list(saved[:k]), list(saved[k : len(saved) - k])
        if ctx.held is not None:
            outs = ctx.held.outs
        if torch.is_grad_enabled():
            if op.nested and not op.contribute.closed:
                raise _nested_create_graph(op)
            if ctx.held is not None and ctx.held.changed():
                raise _changed_in_place(op)
            # create_graph: differentiate a fresh graph of the op (a backward of the results,
            # run later, may free the saved one while passing through it)
            with op.contribute.computing():  # not an op of the model: not captured again
                compared = None if ctx.stubbed else outs
                local, outs = _fresh_graph(op, saved[len(saved) - k :], compared)
        elif ctx.stubbed:
            outs = [_root(s) for s in outs]
        live = [
            (k, o, g)
            for k, (o, g, needed) in enumerate(zip(outs, grads, ctx.out_grad, strict=True))
            if g is not None and needed
        ]
        wanted = [i for i, t in enumerate(local) if t.requires_grad]
        result: list[Tensor | None] = [None] * len(local)
        if not live or not wanted:
            return (None, *result)
        if any(i in op.captured for i in wanted):
            op.contribute.refuse_if_dropped()
        captured = [i for i in wanted if i in op.captured and not op.contribute.closed]
        # a layer rule's summed gradients: asked before our own work begins (inside it, the
        # forward's sink counts as closed)
        summed, fast = None, {}
        # (one output gradient, and a call the closed forms read: the op's tensors alone)
        single = captured and len(live) == 1 and _closed_forms_read(op, local)
        out_bd = op.out_batch[live[0][0]] if single else None
        if single and op.rule is not None and out_bd is not None:
            summed = op.rule(local, live[0][2], out_bd)
        elif single and op.rule is None:
            with op.contribute.computing():  # (ours: its ops are not followed)
                summed, fast = _closed_forms(op, live[0][2], out_bd, captured, local)
        # the ordinary gradients (a closed form's are the sums of its per-sample ones), as the
        # model's backward: it may recompute a checkpointed forward, which must be followed
        summed = summed or {}
        result = [summed.get(i) for i in range(len(local))]
        # (nested contexts: the other one captured the op inside the local graph, and gets its
        # own contributions only from a backward through it)
        rest = [i for i in wanted if op.nested or (i not in fast and i not in summed)]
        if single and op.rule is None and not op.nested and not torch.is_grad_enabled():
            direct = linear_input_grad(
                op_name(op.func), local, op.in_batch, captured, live[0][2], op.n_args
            )
            if direct is not None and direct[0] in rest:
                result[direct[0]] = direct[1]
                rest.remove(direct[0])
        if rest:
            args = (
                tuple(o for _, o, _ in live), tuple(local[i] for i in rest),
                tuple(g for _, _, g in live),
            )  # fmt: skip
            if op.nested:  # the engine directly: not a backward of its own (through the
                # interception it would be one with respect to views only, passive for every
                # context: the other context's capture would compute nothing)
                ordinary = engine_grad(
                    *args, retain_graph=True, create_graph=torch.is_grad_enabled(),
                    allow_unused=True, is_grads_batched=False,
                )  # fmt: skip
            else:
                ordinary = torch.autograd.grad(
                    *args, retain_graph=True, allow_unused=True,
                    create_graph=torch.is_grad_enabled(),
                )  # fmt: skip
            for i, g in zip(rest, ordinary, strict=True):
                result[i] = g
        generic = [i for i in captured if i not in fast and i not in summed]
        generic = generic if op.rule is None else []
        with op.contribute.computing():
            for i, ps in fast.items():
                summed = sample_sum(ps) if result[i] is None else None
                result[i] = summed if summed is not None else result[i]
                hand_back(
                    op.originals[i], op.captured[i], ps, op.contribute, op.autocast_dtype, summed
                )  # fmt: skip
            if generic:
                _generic(live, generic, local, op)
        return (None, *result)


@dataclass(eq=False)
class _Held:
    """An op's local outputs, held beside its saved tensors rather than saved: saved, a change
    of the op's result in place (``h += x`` after an eval-mode BatchNorm), which the op alone
    accepts, fails the backward's version check; the local graph's own saved tensors still
    check what its backward reads."""

    outs: list[Tensor]
    versions: list[int]

    def changed(self) -> bool:
        return any(o._version != v for o, v in zip(self.outs, self.versions, strict=True))


def _held(outs: list[Tensor]) -> tuple[_Held, list[Tensor]]:
    """``outs`` held, and the tensor to save in their place: an empty one whose release with
    the op's other saved tensors (after a backward without ``retain_graph``, or with the
    graph) releases them too."""
    anchor = torch.empty(0)
    weakref.finalize(anchor, outs.clear)
    return _Held(outs, [o._version for o in outs]), [anchor]


def _changed_in_place(op: OpSpec) -> Exception:
    from ..errors import UnsupportedModelError

    return UnsupportedModelError(
        f"per_sample: backward(create_graph=True) through '{op_name(op.func)}', whose result "
        "was changed in place afterwards (e.g. `h += x`): leanprop cannot check that its fresh "
        "graph for the second derivatives computes the same values. Change it out of place "
        "(`h = h + x`) to differentiate the quantities."
    )


def _nested_create_graph(op: OpSpec) -> Exception:
    from ..errors import UnsupportedModelError

    return UnsupportedModelError(
        f"per_sample: backward(create_graph=True) through '{op_name(op.func)}', an op whose "
        "parameters two nested per_sample contexts both track (parameters used at the op "
        "level, e.g. HF's Conv1D or nn.MultiheadAttention's projections): the outer context's "
        "per-sample values cannot be formed differentiably there. Use one context, asked for "
        "every quantity, or a backward without create_graph."
    )


def _closed_forms_read(op: OpSpec, tensors: Sequence[Tensor]) -> bool:
    """Whether the closed forms read the op's call: linear forms called with their tensors
    alone, positionally (not with a scale, such as ``addmm``'s ``alpha=`` and ``beta=``,
    which they do not apply), in a form they cover (``linear_form``: not a parameter as the
    first operand of a matmul), or another op (a layer rule's, or one whose closed form
    reads its arguments). Decided in the forward (``tensors``: the op's): the others' local
    graph keeps its own saved tensors under a checkpoint (see ``OpCapture.forward``)."""
    name = op_name(op.func)
    if op.rule is not None or name not in _LINEAR_FORMS:
        return True
    if any(leaf is not None for leaf in op.leaves):
        return False
    return linear_form(name, tensors, op.in_batch, list(op.captured), op.n_args) is not None


def _closed_forms(
    op: OpSpec, g: Tensor, out_bd: BatchDim | None, captured: list[int], local: list[Tensor]
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """Closed forms for the ``captured`` inputs of an op with one output (gradient ``g``, its
    batch at ``out_bd``, None if it has none: a summed loss). Returns ``({input: summed
    gradient}, {})`` where only their norms are asked (stored here), ``({}, {input:
    per-sample contributions})`` where the op has a closed form for them, else ``({}, {})``."""
    name = op_name(op.func)
    if all(op.contribute.norms_only(op.originals[i]) for i in captured):
        norms = closed_norms(
            name, local, op.in_batch, captured, g, out_bd, op.n, op.n_args, op.workspace_bytes,
            op.contribute.scratch, op.contribute.sums_wanted(),
        ) or {}  # fmt: skip
        summed: dict[int, Tensor] = {}
        for i, (sq, total) in norms.items():  # BatchL2Grad alone: norms, not gradients
            summed[i] = total
            reweigher = functools.partial(  # (made only where clipping wants it)
                linear_reweigher, name, local, op.in_batch, i, g, out_bd, op.n, op.n_args
            )
            op.contribute.norms(
                op.originals[i], sq, total, op.autocast_dtype, op.contribute, reweigher
            )
        if summed:
            return summed, {}
    leaves = list(op.leaves)
    for i, t in zip(op.tensor_at, local, strict=True):
        leaves[i] = t
    args, kwargs = unflatten(leaves, op.spec)
    fast = closed_form(
        name, args, kwargs, local, op.in_batch, captured, g, out_bd, op.n, op.n_args
    )  # fmt: skip
    return {}, fast or {}


def _generic(
    live: list[tuple[int, Tensor, Tensor]], generic: list[int], local: list[Tensor], op: OpSpec
) -> None:
    """Per-sample contributions of the captured inputs ``generic`` by batched VJPs."""
    per_sample = _per_sample(
        [(o, g) for _, o, g in live],
        [op.out_batch[k] for k, _, _ in live],
        [local[i] for i in generic],
        op,
    )
    for i, ps in zip(generic, per_sample, strict=True):
        hand_back(op.originals[i], op.captured[i], ps, op.contribute, op.autocast_dtype)


def _masked(g: Tensor, bd: BatchDim, n: int, start: int, stop: int) -> Tensor:
    """``[stop - start, *g.shape]``: row j is ``g`` with everything but sample start+j zeroed."""
    k = stop - start
    front = to_front(g, bd, n)  # [N, (inner,) ...]
    full = front.new_zeros(k, *front.shape)
    idx = torch.arange(k, device=g.device)
    full[idx, idx + start] = front[start:stop]
    # back to g's layout: [k, N * inner, ...] with the batch moved back to its dimension
    full = full.reshape(k, n * bd.inner, *full.shape[2 + (bd.inner != 1) :])
    return full.movedim(1, bd.dim + 1)


def _per_sample(
    live: list[tuple[Tensor, Tensor]], batch: list[BatchDim | None], inputs: list[Tensor],
    op: OpSpec,
) -> list[Tensor]:  # fmt: skip
    """Each sample's gradient contribution to each of ``inputs``: ``[N, *input.shape]``."""
    for (_, g), bd in zip(live, batch, strict=True):
        if bd is None:
            raise _no_batch_error(op, g)
    if not op.n:  # an empty batch (e.g. Poisson sampling's)
        return [t.new_zeros(0, *t.shape) for t in inputs]
    per_sample_bytes = sum(g.numel() * g.element_size() for _, g in live)
    parts: list[list[Tensor]] = [[] for _ in inputs]
    outputs = [o for o, _ in live]
    for start, stop in sample_chunks(op.n, per_sample_bytes, op.workspace_bytes):
        masks = [_masked(g, bd, op.n, start, stop) for (_, g), bd in zip(live, batch, strict=True)]
        for j, g in enumerate(_batched_vjp(outputs, inputs, masks)):
            parts[j].append(g)
    return [torch.cat(p) if len(p) > 1 else p[0] for p in parts]


def _batched_vjp(outputs: list[Tensor], inputs: list[Tensor], masks: list[Tensor]) -> list:
    k = masks[0].shape[0]
    return [
        t.new_zeros(k, *t.shape) if g is None else g
        for t, g in zip(inputs, _rows_grad(outputs, inputs, masks), strict=True)
    ]


def _rows_grad(
    outputs: Sequence[Tensor], inputs: Sequence[Tensor], grads: Sequence[Tensor],
    attempt: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
) -> list[Tensor | None]:  # fmt: skip
    """``torch.autograd.grad(outputs, inputs, ...)`` for each row of ``grads`` (each
    ``[k, *output.shape]``): ``[k, *input.shape]`` per input, None where none is used. All
    rows at once (vmap), else one at a time where vmap cannot batch the backward (an RNN's;
    random ops that a checkpoint recomputes in it). Each backward runs inside ``attempt()``
    (a model pass: it puts back what a recomputation that vmap stopped half-way left)."""
    k = grads[0].shape[0]
    if k == 0:
        return [t.new_zeros(0, *t.shape) for t in inputs]
    create = torch.is_grad_enabled()  # (create_graph: the results stay differentiable)
    try:
        with attempt(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There is a performance drop")
            return list(
                torch.autograd.grad(
                    outputs,
                    inputs,
                    grads,
                    retain_graph=True,
                    allow_unused=True,
                    is_grads_batched=True,
                    create_graph=create,
                )
            )
    except RuntimeError as e:
        if not _vmap_may_be_why(e):
            raise
    rows = []
    for j in range(k):
        with attempt():
            rows.append(
                torch.autograd.grad(
                    outputs,
                    inputs,
                    [g[j] for g in grads],
                    retain_graph=True,
                    allow_unused=True,
                    create_graph=create,
                )
            )
    return [
        None if rows[0][i] is None else torch.stack([r[i] for r in rows])
        for i in range(len(inputs))
    ]


def _vmap_may_be_why(e: RuntimeError) -> bool:
    """Whether a batched backward's error may go away one row at a time (vmap's, or running
    out of memory for all rows at once): not a refusal of ours inside it (a recomputation's),
    nor a checkpoint's refusal of what its recomputation saved (the same for each row)."""
    from torch.utils.checkpoint import CheckpointError

    from ..errors import LeanpropError

    return not isinstance(e, (LeanpropError, CheckpointError))


def _no_batch_error(op: OpSpec, o: Tensor) -> Exception:
    """``o``: the output (or its gradient, of the same shape) without a batch dimension."""
    from ..errors import UnsupportedModelError

    name = getattr(op.func, "__name__", repr(op.func))
    return UnsupportedModelError(
        f"per_sample: '{name}' uses parameters and returns an output of shape "
        f"{tuple(o.shape)} in which leanprop cannot tell which dimension holds the samples, "
        "so it cannot split its gradient by sample. Keep the batch a dimension of its own, or "
        "freeze these parameters."
    )


def run(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
    captured: dict[int, tuple[nn.Parameter, ...]], follow: Callable[[Any], None],
    batch_of: Callable[[Tensor], BatchDim | None], n: int, workspace_bytes: int,
    contribute: Contribute, rule: Callable[..., dict[int, Tensor]] | None = None,
    roots: dict[int, Tensor | ThroughCopies] | None = None,
) -> Any:  # fmt: skip
    """``func(*args, **kwargs)`` through :class:`OpCapture`.

    ``captured`` maps the position of a tensor among the flattened ``(args, kwargs)`` tensors
    to the parameters it stands for (itself, or those it derives from); ``follow(out)`` tracks
    the batch into the outputs, ``batch_of`` then tells where it is in each. ``roots``: for
    a captured tensor that does not lead to its parameters itself (a reentrant checkpoint's
    detached input, or a tensor computed from such inputs), where the product to them
    starts (``BatchTracker.vjp_root``: the tensor that does, or a :class:`ThroughCopies`)."""
    leaves, spec = flatten((args, kwargs))
    tensor_at = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
    tensors = [leaves[i] for i in tensor_at]
    op = OpSpec(
        func, spec, [None if isinstance(t, Tensor) else t for t in leaves], tensor_at,
        captured, {i: (roots or {}).get(i, tensors[i]) for i in captured}, batch_of, n,
        workspace_bytes, contribute,
    )  # fmt: skip
    op.rule = rule
    op.in_batch = [batch_of(t) for t in tensors]
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        op.autocast_dtype = torch.get_autocast_dtype(device)
    op.n_args = sum(isinstance(t, Tensor) for t in flatten((args, {}))[0])
    results = OpCapture.apply(op, *tensors)
    it = iter(results)
    out = unflatten([next(it) if o is _TENSOR else o for o in op.out_leaves], op.out_spec)
    follow(out)
    op.out_batch = [batch_of(r) for r in results]
    return out
