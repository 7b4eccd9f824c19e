"""One forward/backward cycle of a per_sample context.

A cycle begins with a forward of the model. It holds what that forward recorded (module calls
waiting for their output gradients, how often each parameter was used) and what its backward
computes (each parameter's results). The first output gradient of a backward *opens* it; when
the backward ends it *finishes*: calls whose outputs got only some gradients are completed,
the results are checked against the gradients autograd computed and written to the parameters,
and the backward's results are dropped (another backward through the same retained graph
computes its own). A backward or forward that raises *aborts* it: everything the forward
recorded is dropped and the next forward starts clean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .._torch_compat import current_graph_task_id, foreach_norms, graph_nodes
from ..errors import UnsupportedModelError
from .batch import BatchDim
from .chunks import Scratch
from .clipping import Reweigh
from .factors import FactoredUses, Factors, add_into, materialize, total
from .quantities import ALL_QUANTITIES, BatchGrad, BatchL2Grad, Quantity, Variance, subsample
from .stats import quantities_of, sample_sum

if TYPE_CHECKING:
    from . import ops
    from .capture import Site

ALL_ATTRS = tuple(q.attr for q in ALL_QUANTITIES)
# relative error allowed between the sum of the individual gradients and autograd's gradient,
# by the lowest precision involved (16-bit: 5e-2)
_SUM_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-3}


def _module_norms(names: list[str], norms: Tensor) -> Tensor:
    """``[P]``: for each parameter (``names``, their norms ``norms`` ``[P]``), the norm of all
    its module's parameters together (those named with the same prefix)."""
    modules = [name.rpartition(".")[0] for name in names]
    at = {m: i for i, m in enumerate(dict.fromkeys(modules))}
    index = torch.tensor([at[m] for m in modules], device=norms.device)
    squares = norms.square()
    return squares.new_zeros(len(at)).index_add(0, index, squares).sqrt()[index]


_SEVERAL_FORWARDS = (
    "per_sample (a facade's hooks, BackPACK's or Opacus'): the model ran forward more than once "
    "before this backward: the loss took several forwards (e.g. f(model(x[:3])) + "
    "f(model(x[3:]))), or another forward ran after it with autograd on (a logging or "
    "validation forward). The facade keeps the records of the last forward only, so no "
    "quantities were computed. Run one forward on the whole batch per backward, and other "
    "forwards under torch.no_grad() or after the backward."
)


def bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def _reaches(roots: list[Any], nodes: dict[int, Any]) -> bool:
    """Whether the autograd graph of ``roots`` (tensors or gradient edges) contains one of
    ``nodes`` (by ``id``)."""
    starts = [t.grad_fn if isinstance(t, Tensor) else getattr(t, "node", None) for t in roots]
    return any(id(node) in nodes for node in graph_nodes(starts))


@dataclass(eq=False)
class Call:
    """One call of a site during forward, waiting for its output gradients."""

    site: Site
    params: dict[str, nn.Parameter]
    args: tuple[Any, ...] | None
    kwargs: dict[str, Any] | None
    n: int
    grads: list[Tensor | None]
    pending: int
    closed: bool = False
    hooked: int = 0  # output gradients it waits for in each backward (module-level calls)
    in_bd: BatchDim = field(default_factory=lambda: BatchDim(0))  # rule sites: the batch in
    out_bd: BatchDim = field(default_factory=lambda: BatchDim(0))  # the input and the output
    in_dims: list[int | None] | None = None  # fallback roots: batch dim of each input leaf
    out_dims: list[int | None] | None = None  # ... and of each output leaf
    autocast: tuple[str, torch.dtype] | None = None  # fallback roots: autocast of the forward
    packed: bool = False  # an RNN called on a PackedSequence
    forward: Any = None  # replaced ops: the forward they belong to (an ops.Contribute)
    replaced: bool = False  # a replaced op: autograd's gradient of its parameters is ours


@dataclass(eq=False)
class ParamState:
    """One tracked parameter: its uses in the forward, its results in the backward."""

    name: str
    param: nn.Parameter
    uses: int = 0
    batch: Tensor | None = None  # accumulated individual gradients (weight sharing)
    batch_owned: bool = False  # ``batch`` is a buffer of ours: later uses are added in place
    total: Tensor | None = None  # sum of the individual gradients, for the final check
    autograd_grad: Tensor | None = None  # what autograd computed for it in this backward
    # (graph task, cycle open, gradient) as autograd handed them over: the backward itself,
    # and backward passes nested in it (a reentrant checkpoint's) count. None: ``total``
    # itself, not held (see ``hand_over``)
    autograd_grads: list[tuple[int, bool, Tensor | None]] = field(default_factory=list)
    # the sum of ``batch`` handed to autograd as the parameter's gradient (one use so far)
    summed: Tensor | None = None
    # autograd took ``total`` or ``summed`` itself (see ``hand_over``); where later uses
    # came (a reentrant checkpoint's backward), the sum of what it took, for the check
    handed: bool = False
    handed_total: Tensor | None = None
    hooked_task: int | None = None  # graph task in which its gradient hook last ran
    compute_dtype: torch.dtype | None = None  # lowest precision its contributions came in
    results: dict[str, Tensor] = field(default_factory=dict)
    # BatchL2Grad of a weight used several times: its uses as factors, instead of ``batch``
    factored: FactoredUses | None = None
    # clipping: each use's weighted sum of its individual gradients (clipping.py)
    reweigh: list[Reweigh] = field(default_factory=list)

    @property
    def formed(self) -> bool:
        """Something was contributed in this cycle already."""
        return self.batch is not None or bool(self.results) or self.factored is not None

    def hand_over(self, grad: Tensor, allowed: bool) -> bool:
        """Autograd is about to accumulate ``grad`` for this parameter. Where it is the sum
        of this backward's individual gradients itself (one use, whose op handed that sum
        over as the parameter's whole gradient: ``total``, or ``summed``), there is nothing
        for the sum check to compare, and holding it to the end of backward would keep a
        second copy of every such gradient (and have autograd copy it into a new ``.grad``):
        it is dropped, where ``allowed``. Returns whether it was (not under
        ``create_graph``: a result's graph is followed from it). A gradient that autograd
        hands over later, in another graph task (a reentrant checkpoint's), then belongs to
        no individual gradient: ``verify`` compares it with zero."""
        summed, self.summed = self.summed, None  # (only the first gradient may be it)
        if not allowed:
            return False
        # (identity first: reading requires_grad in backward goes through the op interception)
        if grad is self.total and self.batch is None:
            if grad.requires_grad:
                return False
            self.total = None
        elif grad is not summed or grad.requires_grad:
            return False
        self.handed = True
        return True

    @property
    def sum_checked(self) -> bool:
        """Autograd took the sum of every individual gradient formed as the gradient itself:
        the sum check has nothing to compare (see ``hand_over``)."""
        return self.handed and self.handed_total is None

    def _another_use(self) -> None:
        """A use comes after others formed something: what autograd took (if it took it)
        is no longer the whole."""
        formed = self.batch if self.batch is not None else self.results.get(BatchGrad.attr)
        if self.handed and self.handed_total is None and formed is not None:
            self.handed_total = sample_sum(formed)
        self.summed = None

    def add_factors(self, f: Factors, keep: bool, workspace_bytes: int) -> Tensor:
        """Add one more use given as factors (see ``factors.py``); returns its gradient.

        ``keep``: only norms are wanted and they are cheaper from the factors; the use is
        kept as factors while every use so far was. Otherwise it is added to the individual
        gradients (without a ``[N, *p.shape]`` temporary where some are there already)."""
        if keep and self.batch is None and not self.results:
            self.factored = self.factored or FactoredUses()
            return self.factored.add(f, workspace_bytes)
        if self.batch is not None:
            self._another_use()
            self.batch = add_into(self.batch, f, in_place=self._may_add_in_place())
            self.batch_owned = True
            return total(f)
        b = materialize(f).to(self.param.dtype)  # a buffer of ours
        # its sum now, before later uses are added into it: a matrix-vector product, far less
        # work than the sum from the factors (a product over all positions)
        s = sample_sum(b)
        self.add_batch(b, owned=True, summed=s)
        return s

    def add_batch(self, b: Tensor, owned: bool = False, summed: Tensor | None = None) -> None:
        """Add individual gradients ``[N, *p.shape]`` of one more use (``owned``: ``b`` is a
        fresh buffer no one else holds, which later uses may be added into; ``summed``: their
        sum, as handed to autograd for this use)."""
        if self.formed:
            self._another_use()
        else:
            self.summed = summed
        if self.factored is not None:  # earlier uses kept as factors: materialised now
            b, self.factored = self.factored.added_to(b), None
            owned = True
        if self.results:  # formed as a single use, then used again
            if BatchGrad.attr not in self.results:
                raise UnsupportedModelError(
                    f"per_sample: '{self.name}' was used again after its quantities were "
                    "formed (its use was only seen when checkpoint(use_reentrant=True) "
                    "recomputed it), and only statistics were kept. Use "
                    "checkpoint(use_reentrant=False), or also request BatchGrad()."
                )
            b, owned = b + self.results[BatchGrad.attr], True
            self.results, self.total = {}, None
        if self.batch is None:
            self.batch, self.batch_owned = b, owned
        elif self._may_add_in_place():  # (no second [N, *p.shape] buffer)
            self.batch.add_(b)
        else:
            self.batch, self.batch_owned = self.batch + b, True

    def _may_add_in_place(self) -> bool:
        """Whether ``batch`` may be changed in place: a buffer of ours, and no graph recorded
        through it (``create_graph``)."""
        return self.batch_owned and not (torch.is_grad_enabled() and self.batch.requires_grad)

    def saw(self, dtype: torch.dtype) -> None:
        if self.compute_dtype is None or bits(dtype) < bits(self.compute_dtype):
            self.compute_dtype = dtype

    def drop_results(self) -> None:
        """Forget what a backward computed."""
        self.batch, self.batch_owned, self.total, self.factored = None, False, None, None
        self.results, self.autograd_grad, self.compute_dtype = {}, None, None
        self.autograd_grads, self.reweigh = [], []
        self.summed, self.handed, self.handed_total = None, False, None


# the sum check's differences are formed this many bytes at a time (at least one parameter's)
_CHECK_BYTES = 16 * 2**20


def _by_bytes(pairs: list[tuple[Any, Tensor, Tensor]], limit: int) -> Iterator[list]:
    """``pairs`` in consecutive groups whose tensors (the second) take at most ``limit``
    bytes, or one pair."""
    group: list[tuple[Any, Tensor, Tensor]] = []
    size = 0
    for pair in pairs:
        nbytes = pair[1].numel() * pair[1].element_size()
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append(pair)
        size += nbytes
    if group:
        yield group


@dataclass(eq=False)
class Cycle:
    """The current forward and its backward passes. ``states`` and ``sites`` are the
    context's (one per tracked parameter and per hooked module); the cycle resets their
    per-cycle fields."""

    states: dict[nn.Parameter, ParamState]
    sites: list[Site]
    n: int | None = None  # samples in this forward
    calls: list[Call] = field(default_factory=list)  # module calls waiting for gradients
    tensor_handles: list[RemovableHandle] = field(default_factory=list)  # on their outputs
    contributions: ops.Contribute | None = None  # the current forward's (created lazily)
    earlier: list[ops.Contribute] = field(default_factory=list)  # earlier forwards' sinks
    source: Any = None  # the forward whose samples this backward computes (a Contribute)
    open: bool = False  # a backward is computing quantities
    finish_queued: bool = False  # finish() is queued to run when the engine's task ends
    backward_done: bool = False  # a backward ended since this forward's state was made
    grad_mode: bool = False  # the backward records autograd (create_graph)
    # what the forward would refuse had quantities been asked (BatchNorm in training mode, a
    # tensor from parameters through a reentrant checkpoint's output): refused when a
    # backward opens
    pending_refusal: str | None = None
    # parameters this backward reached through values in which the samples were combined
    # (name -> the op where they joined them): refused by the check
    escaped: dict[str, str] = field(default_factory=dict)
    discarded_forward: bool = False  # BackPACK facade: an earlier forward's records were dropped
    scratch: Scratch = field(default_factory=Scratch)  # chunks' temporaries, one backward's
    dropped_n: int | None = None  # samples of an earlier forward dropped before its backward
    direct_call: str | None = None  # a module of the model called on its own in this forward
    model_forward: bool = False  # the model's own forward ran (recording) in this forward
    keep_calls: bool = False  # module-level calls stay for another backward (curvature passes)
    # a create_graph backward closes the forward's sinks: a later backward that differentiates
    # its results (their autograd nodes, ``result_nodes``, reached from its roots, or its
    # hooks on them firing: ``watch_results``) computes no per-sample quantities; any other
    # backward through the retained forward reopens them and computes its own
    graph_closed: list[Any] = field(default_factory=list)
    # id -> node of the create_graph backward passes' results (held until the next forward,
    # so that their ids stay theirs)
    result_nodes: dict[int, Any] = field(default_factory=dict)
    differentiating: bool = False  # the backward running was found to differentiate them
    differentiating_task: int | None = None  # ... by a hook firing in this graph task
    # () -> the function that hooks the results' nodes (the context's, held weakly) or None
    watch_results: Callable[[], Callable[[list[Any]], None] | None] | None = None
    _written: list[Any] = field(default_factory=list)  # nodes made for the results written

    def next_forward(self) -> None:
        """Another forward of the model starts before a backward: its uses hand their
        contributions to a sink of their own."""
        if self.contributions is not None:
            self.earlier.append(self.contributions)
            self.contributions = None

    def from_forward(self, source: Any) -> None:
        """A contribution of the forward ``source`` (its sink) arrives in this backward: every
        contribution of one backward must come from one forward."""
        if source is None:
            return
        if self.source is None:
            self.source = source
        elif source is not self.source:
            raise UnsupportedModelError(
                "per_sample: one backward reached the samples of two forward passes of the "
                "model (e.g. f(model(x[:3])) + f(model(x[3:])), or two views of each "
                "example): leanprop cannot tell whether sample i of each forward is one example "
                "or two, so it computes neither. Run the model once on the whole batch "
                "(concatenate the inputs), or run backward after each forward."
            )

    def _sinks(self) -> list[Any]:
        return [*self.earlier, *([self.contributions] if self.contributions else [])]

    def clear_attrs(self) -> None:
        """Remove every quantity attribute from the parameters."""
        for p in self.states:
            held = p.__dict__  # (where they are set: most parameters hold none)
            if held:
                for attr in ALL_ATTRS:
                    if attr in held:
                        delattr(p, attr)

    def finish(
        self,
        kinds: frozenset[type[Quantity]],
        check: bool,
        complete: Callable[[Call], object],
        subsampling: tuple[int, ...] | None = None,
        clip: Callable[[list[ParamState]], object] | None = None,
    ) -> dict[nn.Parameter, Tensor]:
        """End of a backward: ``complete`` each call whose outputs got only some gradients
        (the others count as zero), form the quantities, check them (``check``), write those
        asked for (``kinds``) to the parameters. ``clip``: per-sample clipping, given the
        states this backward reached (with their norms); it writes the gradients. Returns
        each parameter's sum of individual gradients if ``Variance`` is among ``kinds`` (for
        ``all_reduce_quantities``), else ``{}``."""
        formed = kinds | {BatchL2Grad} if clip is not None else kinds
        try:
            with torch.set_grad_enabled(self.grad_mode):
                for call in self.calls:
                    if not call.closed and any(g is not None for g in call.grads):
                        complete(call)
                for state in self.states.values():
                    if state.batch is not None:
                        state.results = quantities_of(state.batch, formed)
                        if not state.sum_checked:  # (checks what is written)
                            state.total = sample_sum(state.batch)
                    elif state.factored is not None:  # BatchL2Grad alone (add_factors)
                        state.results = {BatchL2Grad.attr: state.factored.squared_norms()}
                        state.total = state.factored.total
                if check or clip is not None:  # before anything is written
                    self.verify()
                if clip is not None:
                    clip([s for s in self.states.values() if BatchL2Grad.attr in s.results])
                asked = {k.attr for k in kinds}  # (BatchDotGrad's individual gradients: not)
                for state in self.states.values():
                    for attr, value in state.results.items():
                        if attr in asked:
                            if attr == BatchGrad.attr:  # (BatchGrad(subsampling=...))
                                value = subsample(value, subsampling, 0, "BatchGrad")
                            if self.grad_mode and value.grad_fn is not None:
                                # a node of its own, made now: a later backward that reaches
                                # it differentiates this result (the value's own node may be
                                # the forward's: a bias's individual gradients are its output
                                # gradient, the user's grad_outputs)
                                value = value.view_as(value)
                                self._written.append(value.grad_fn)
                            setattr(state.param, attr, value)
                if Variance not in kinds:
                    return {}
                return {
                    s.param: s.total.detach() for s in self.states.values() if s.total is not None
                }
        finally:
            self.end_backward()

    def end_backward(self) -> None:
        """Forget this backward's results. Another backward through the same forward (a
        retained graph) computes its own; one that differentiates the results of a
        ``create_graph`` backward computes none (see ``graph_closed``)."""
        kept = []
        for call in self.calls:  # module-level calls: their inputs are gone (see the hook)
            if self.keep_calls and call.args is not None:  # ready for the next backward
                call.closed, call.pending = False, call.hooked
                kept.append(call)
            else:
                call.closed = True
                call.args = call.kwargs = None
        self.calls[:] = kept
        self.scratch.clear()
        self.pending_refusal = None
        self.escaped = {}
        self.source = None
        if self.grad_mode:
            self.graph_closed = self._sinks()
            for sink in self.graph_closed:
                sink.close()
            nodes = self._result_nodes()
            self.result_nodes.update((id(node), node) for node in nodes)
            watch = self.watch_results() if self.watch_results is not None else None
            if watch is not None:  # (what a later backward may differentiate)
                watch(nodes)
        for state in self.states.values():
            state.drop_results()
        self.open = False
        self.finish_queued = False
        self.backward_done = True
        self.discarded_forward = False

    def _result_nodes(self) -> list[Any]:
        """The autograd nodes of this (create_graph) backward's results: those made for the
        quantities written, and those of the gradients autograd handed over (``.grad``,
        ``autograd.grad``'s: made by this backward)."""
        found, self._written = self._written, []
        for state in self.states.values():
            found += [g.grad_fn for _, _, g in state.autograd_grads if g is not None]
        return [node for node in dict.fromkeys(found) if node is not None]

    def begin_backward(self, roots: list[Any]) -> None:
        """A backward (not passive) from ``roots`` begins: whether it differentiates a
        create_graph backward's results (its graph reaches one of their nodes) decides
        whether the sinks that backward closed take contributions again."""
        self.differentiating = bool(self.result_nodes) and _reaches(roots, self.result_nodes)
        for sink in self.graph_closed:
            if self.differentiating:
                sink.close()
            else:
                sink.reopen()

    def differentiates_results(self) -> None:
        """A hook on a create_graph backward's result fired: this backward differentiates
        them, and computes no per-sample quantities (where the roots did not tell: the
        BackPACK facade's backward passes run without the op interception)."""
        self.differentiating_task = current_graph_task_id()
        for sink in self.graph_closed:
            sink.close()

    def is_differentiating(self) -> bool:
        """Whether the backward running differentiates a create_graph backward's results."""
        return self.differentiating or (
            self.differentiating_task is not None
            and self.differentiating_task == current_graph_task_id()
        )

    def drop_forward(self) -> None:
        """The current forward (and earlier ones waiting for a backward) will be dropped
        before their backward came: a backward through them is refused."""
        for sink in self._sinks():
            sink.dropped_n = self.n

    def abort(self) -> None:
        """Forget everything about the current forward and its backward passes."""
        self.end_backward()
        for h in self.tensor_handles:
            h.remove()
        self.tensor_handles.clear()
        for sink in self._sinks():
            sink.close()
        self.contributions, self.earlier, self.graph_closed = None, [], []
        self.result_nodes, self.differentiating, self.differentiating_task = {}, False, None
        for site in self.sites:
            site.calls, site.running, site.fused = 0, False, False
        for state in self.states.values():
            state.uses = 0
        self.n = None
        self.backward_done = False
        self.dropped_n = None
        self.direct_call, self.model_forward = None, False

    def verify(self) -> None:
        """The individual gradients must add up to what autograd computed in this backward,
        and every parameter that got a gradient must have its individual gradients."""
        if self.escaped:
            uses = ", ".join(f"'{p}' (at '{op}')" for p, op in sorted(self.escaped.items()))
            raise UnsupportedModelError(
                f"per_sample: {uses} reach the loss after the samples were combined, through "
                "values in which leanprop sees no samples: a penalty on the parameters added "
                "to the loss (weight decay, L2), the mean loss scaled by a parameter, or "
                "inputs leanprop could not follow (made outside torch, e.g. through numpy). "
                "That part of their gradient belongs to no sample, so per-sample quantities "
                "cannot add up to the gradient. Give weight decay to the optimizer "
                "(weight_decay=), add a penalty's gradient after the block (its own "
                "backward), apply the parameter to each sample's loss before the mean, or keep "
                "the inputs torch tensors (check=False computes the per-sample part alone)."
            )
        task = current_graph_task_id()
        for s in self.states.values():
            # this backward's, and those of backward passes nested in it while the cycle was
            # open; not those of another backward (e.g. of a create_graph result) before it
            mine = [g for t, in_cycle, g in s.autograd_grads if t == task or in_cycle]
            # (a total autograd took whole: equal to itself; where later uses were added to
            # its individual gradients, what it was)
            mine = [s.handed_total if g is None else g for g in mine]
            mine = [g for g in mine if g is not None]
            s.autograd_grad = sum(mine[1:], mine[0]) if mine else None
            if s.sum_checked and s.autograd_grad is not None:
                # autograd took every individual gradient whole, yet handed over more:
                # gradient that belongs to no sample (compared with zero)
                s.total = s.autograd_grad.new_zeros(()).expand_as(s.autograd_grad)
        missing = [
            f"'{s.name}'"
            for s in self.states.values()
            if s.total is None and not s.results and s.autograd_grad is not None
        ]
        if missing and self.discarded_forward:
            raise UnsupportedModelError(_SEVERAL_FORWARDS)
        direct = (
            f" ('{self.direct_call}' was called on its own, not through the model's forward: "
            "call the model, or open the context on the module you call)"
            if self.direct_call is not None
            else ""
        )
        if missing and self.direct_call is not None:
            raise UnsupportedModelError(
                f"per_sample: {', '.join(missing)} got a gradient in this backward but no "
                f"per-sample quantities{direct}."
            )
        if missing and self.dropped_n is not None:
            raise UnsupportedModelError(
                f"per_sample: {', '.join(missing)} got a gradient in this backward but no "
                f"per-sample quantities: it goes through a forward of {self.dropped_n} samples "
                "whose records were dropped, since another forward of the model, of another "
                "batch size, ran after it and before this backward. Run each forward's "
                "backward before the next forward (or run the other forward under "
                "torch.no_grad())."
            )
        if missing:
            raise UnsupportedModelError(
                f"per_sample: {', '.join(missing)} got a gradient in this backward but no "
                "per-sample quantities: leanprop did not see the samples reach them (e.g. a "
                "forward run outside the `with` block, under torch.no_grad(), or inside "
                "checkpoint(use_reentrant=True) before the block it wraps; or a parameter "
                "applied in the loss, after the model's forward returned). Run the forward "
                "inside the block; prefer checkpoint(use_reentrant=False); apply parameters "
                "inside the model's forward."
            )
        # (a total that autograd took as the whole gradient, the same tensor, adds up)
        pairs = [
            (s, s.total.detach(), s.autograd_grad.detach())
            for s in self.states.values()
            if s.total is not None
            and s.autograd_grad is not None
            and s.autograd_grad is not s.total
            and not s.autograd_grad.is_sparse
        ]
        if not pairs:
            return
        norms: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        for group in _by_bytes(pairs, _CHECK_BYTES):  # (the differences: a group at a time)
            totals, refs = [t for _, t, _ in group], [r for _, _, r in group]
            diffs = [t - r for t, r in zip(totals, refs, strict=True)]
            # multi-tensor norms: a few kernel launches for all parameters instead of three each
            for out, x in zip(norms, (diffs, totals, refs), strict=True):
                out += foreach_norms(x)
        d, a, b = (torch.stack(x).double() for x in norms)
        # each difference relative to the parameter's gradient; for a parameter whose gradient
        # is zero but for rounding (a key projection's bias under softmax, HF BART's), which
        # differs at the rounding of its module's sums, relative to its module's (all its
        # parameters' together): no tolerance relative to that rounding alone can take it
        names = [s.name for s, _, _ in pairs]
        module = _module_norms(names, a) + _module_norms(names, b)
        # (the module's scale only for a gradient at the rounding of its module's: within a
        # hundred units of the last place, in the parameter's dtype)
        ulps = torch.tensor(
            [
                100 * torch.finfo(min(r.dtype, t.dtype, s.compute_dtype or t.dtype, key=bits)).eps
                for s, t, r in pairs
            ],
            dtype=d.dtype,
        )
        rounding = a + b <= ulps * module
        rel = torch.where(rounding, d / (module + 1e-30), d / (a + b + 1e-30)).tolist()
        bad = [
            f"'{s.name}' (relative error {e:.2e})"
            for (s, t, r), e in zip(pairs, rel, strict=True)
            if e
            > _SUM_TOLERANCE.get(min(r.dtype, t.dtype, s.compute_dtype or t.dtype, key=bits), 5e-2)
        ]
        if bad and self.discarded_forward:
            raise UnsupportedModelError(_SEVERAL_FORWARDS)
        if bad and self.direct_call is not None:
            raise UnsupportedModelError(
                "per_sample: the individual gradients do not add up to the batch gradient for "
                f"{', '.join(bad)}{direct}."
            )
        if bad:
            raise UnsupportedModelError(
                "per_sample: the individual gradients do not add up to the batch gradient for "
                f"{', '.join(bad)}. Some use of these parameters escaped leanprop (an in-place "
                "op on a parameter outside its module), the loss differentiates through the "
                "model's own gradients (a gradient penalty: not supported), or the model mixes "
                "samples. Call the owning module instead, or wrap the use in a small nn.Module "
                "so it gets its own rule."
            )
