"""Scoped capture of per-sample quantities: one :class:`PerSample` context.

One forward and backward through it (all state lives on the context and its
:class:`~leanprop.per_sample.cycle.Cycle`, never on user modules):

1. **Entry.** The model is split into *sites*: modules with a closed-form rule (``registry.py``,
   ``rules/``) own their direct trainable parameters; RNNs are *fallback roots*
   (``rules/fallback.py``, ``rules/packed_rnn.py``); the parameters of any other module are
   captured at each op that uses them (``ops.py``). The op interception (``fused.py``) starts.
2. **Forward.** The model's inputs are marked as carrying the batch and every op is followed
   (``batch/``). A Linear/Conv's own op becomes a ``FusedOp``; the ops of other rule modules
   and op-level parameter uses run through ``ops.OpCapture``; a parameter-derived tensor that
   meets the batch goes through ``broadcast.py``; fallback roots are recorded as calls.
3. **Backward.** Each captured op or call, given its output gradient, opens the cycle and
   has its quantities computed (``compute.py``): individual gradients a chunk of samples at a
   time (``chunks.py``), reduced at once into the quantities (``stats.py``): at most one
   layer's individual gradients exist at a time. A parameter used several times accumulates
   them.
4. **End of backward.** The cycle finishes (``cycle.py``): partial calls are completed, the
   results checked against autograd's gradients (nothing silently wrong) and written. With
   per-sample clipping (``clipping.py``), the parameters' hooks keep autograd's gradient out
   of ``.grad``, and the clipped gradients are added at this point instead.
5. **Exit.** Every hook and the interception are removed, also on exceptions.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.nn.utils.rnn import PackedSequence
from torch.utils.hooks import RemovableHandle

from .._eager import in_eager_backward
from .._torch_compat import (
    BatchNormBase,
    checkpoint_saves_tensors,
    current_graph_task_id,
    function_modes,
    in_reentrant_checkpoint_backward,
    pop_innermost_mode,
    push_mode,
    queue_callback,
    recomputing_checkpoint,
    saving_loses_leaf_hooks,
    selective_checkpoint_active,
    top_function_mode,
    tree_flatten,
)
from ..errors import BatchError, LeanpropError, LeanpropValueError, UnsupportedModelError
from . import broadcast, ops
from .batch import (
    BatchDim,
    BatchTracker,
    Lost,
    ThroughCopies,
    batch_norm_training,
    how_to_keep,
    in_place,
    op_name,
    packed_data,
    tensors_in,
    to_front,
)
from .clipping import Clipping, ClipState
from .compute import Observer, Work, compute
from .cycle import Call, Cycle, ParamState
from .escapes import EscapeWatch, reached
from .fallback_calls import call_dims
from .fused import Intercept
from .pytree import flatten
from .quantities import (
    BatchL2Grad,
    Quantity,
    Variance,
    computed_kinds,
    subsampling_of,
    validate_quantities,
)
from .registry import Rule, RuleOptions, rule_for
from .rules.packed_rnn import sample_count, sorted_order
from .stats import widen

ConvAlgorithm = Literal["auto", "unfold", "grouped", "weight_backward"]
CONV_ALGORITHMS: tuple[str, ...] = ("auto", "unfold", "grouped", "weight_backward")
DEFAULT_WORKSPACE_MIB = {"cpu": 16.0}


@dataclass(eq=False)
class Site:
    """A module whose parameters are tracked: a rule module or a fallback root."""

    name: str
    module: nn.Module
    rule: Rule | None
    direct: dict[str, nn.Parameter]  # names within the module -> parameter
    inner: list[Site] = field(default_factory=list)  # rule sites below a fallback root
    calls: int = 0  # calls seen in the current forward/backward cycle
    calls_before: list[int] = field(default_factory=list)  # inner sites' calls at entry
    fusable: bool = False  # its op is replaced while it runs (see _fused.py)
    running: bool = False  # between its forward pre-hook and forward hook
    fused: bool = False  # the current call went through the replaced op


def _refuse_complex(func: Any) -> None:
    raise UnsupportedModelError(
        f"per_sample: '{op_name(func)}' uses a parameter with complex values (a complex operand "
        "or result); per-sample quantities of parameters used in complex arithmetic are not "
        "supported. Keep each parameter's uses real (complex views of the activations alone, "
        "as rotary embeddings in complex form, are fine)."
    )


def _flat_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The op's tensors in the order ops.run numbers them."""
    return [t for t in flatten((args, kwargs))[0] if isinstance(t, Tensor)]


def _check_dim(what: str, d: object) -> None:
    if not isinstance(d, int) or isinstance(d, bool) or d < 0:
        raise LeanpropValueError(
            f"per_sample() got {what}={d!r}; it must be a non-negative int: the dimension of "
            "the model's inputs that holds the samples (0 for [N, ...], 1 for [T, N, ...])."
        )


def _where(info: Any) -> int | str | None:
    """A tracked tensor's batch dimension, or why it has none (see ``batch_dim_of``)."""
    if info is None:
        return None
    if isinstance(info, Lost):
        return info.reason
    if info.inner != 1:
        return f"its dimension {info.dim} holds the samples flattened with another one"
    return info.dim


# (``training`` is the sixth argument of both)
_BATCH_NORMS = frozenset({torch.nn.functional.batch_norm, torch.batch_norm})


_SECOND_CLIPPED_BACKWARD = (
    "per-sample clipping: a second backward through a forward whose clipped backward already "
    "ran (a retained graph, or a penalty's backward after the loss's): clipping each backward "
    "on its own would let one sample count twice. Add the losses and call backward once per "
    "forward."
)


def _set_item(x: Tensor, index: Any, value: Any) -> Tensor:
    """``x[index] = value`` out of place: a new tensor."""
    out = x.clone()
    out[index] = value
    return out


def _whole_base(t: Tensor) -> Tensor | None:
    """The tensor ``t`` is a view of, where ``t`` is all of it in the same layout (a reshape of
    an op's result) and it has a gradient of its own, else None."""
    base = t._base
    if base is None or base.grad_fn is None or base.numel() != t.numel():
        return None
    same = (
        t.is_contiguous() and base.is_contiguous() and t.storage_offset() == base.storage_offset()
    )
    return base if same else None


class _Weakly:
    """``method(*bound, *args)`` while the method's object lives: the hooks on the user's
    modules and tensors never keep a context (nor, through it, the model) alive."""

    __slots__ = ("bound", "func", "owner")

    def __init__(self, method: Any, *bound: Any) -> None:
        # (a plain reference to the object and its function: a WeakMethod costs several
        # times as much to make, and a context makes a few per layer on each entry)
        self.owner = weakref.ref(method.__self__)
        self.func = method.__func__
        self.bound = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner()
        return None if owner is None else self.func(owner, *self.bound, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _Untracked:
        # a deep copy of the model (made inside the block: a lookahead or inner-loop copy) has
        # parameters of its own, which this context does not track: its hooks do nothing (they
        # reported its forward and backward to this context, which wrote the copy's results
        # onto the original's parameters)
        return _Untracked()


class _Holder:
    """A no-op forward pre-hook through which a model owns a context (see owned_by_model):
    no reference cycle (the context holds the model weakly, its hooks hold it weakly), so a
    model dropped every iteration is freed at once."""

    __slots__ = ("capture",)

    def __init__(self, capture: PerSample) -> None:
        self.capture = capture

    def __call__(self, module: nn.Module, args: tuple) -> None:
        return None

    def __deepcopy__(self, memo: dict) -> _Holder:
        return self  # a deep copy of the model shares it (not a copy of the context)


class _Untracked:
    """The hook a deep copy of a tracked module or parameter gets: nothing."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __deepcopy__(self, memo: dict) -> _Untracked:
        return self


class _OwnWork:
    """:meth:`PerSample.own_work`'s context: the capture marked as computing, this thread's
    work depth raised, and the capture's op interception taken off where it is innermost (its
    ops would cost a Python call each). A plain object: it runs several times per layer."""

    __slots__ = ("_before", "_capture", "_popped")

    def __init__(self, capture: PerSample) -> None:
        self._capture = capture

    def __enter__(self) -> None:
        capture = self._capture
        self._before, capture._computing_here = capture._computing_here, True
        ops.WORKING.enter()
        self._popped = pop_innermost_mode(capture._intercept)

    def __exit__(self, *exc: object) -> None:
        if self._popped is not None:
            push_mode(self._popped)
        self._capture._computing_here = self._before
        ops.WORKING.leave()


_SELECTIVE_RECOMPUTED = (
    "per_sample: selective activation checkpointing (checkpoint's context_fn) around a tensor "
    "computed from parameters alone whose graph holds what the checkpoint dropped (through "
    "your own autograd Function): handing its parameters' per-sample gradients back needs a "
    "recomputation of the block of its own, and selective checkpointing's cache serves one "
    "only. Checkpoint without context_fn, keep that Function out of the checkpointed block, "
    "or compute the tensor before the checkpoint and pass it in."
)


# the contexts between their entry and exit (a model pass puts back what each one followed)
_ENTERED: weakref.WeakSet[PerSample] = weakref.WeakSet()


class _ModelPass:
    """:meth:`PerSample.model_pass`'s context: inside own work, a backward of ours through the
    model's graph (a parameter-derived tensor's contributions handed back to its parameters).
    A non-reentrant checkpoint recomputes its block there, in a graph task of its own: that
    recomputation is the model's forward replayed, followed by the op interception as the
    forward was (else it saves other tensors than the forward: the checkpoint refuses them,
    or, where their shapes agree, hands that backward the wrong ones), by every context on
    the model. Where it stops half-way (an attempt under vmap, see ``ops._rows_grad``), what
    each context holds while a module runs is put back."""

    __slots__ = ("_capture", "_held", "_pushed")

    def __init__(self, capture: PerSample) -> None:
        self._capture = capture

    def __enter__(self) -> None:
        capture = self._capture
        self._held = [
            (c, c._in_rule.copy(), [(s, s.running, s.fused) for s in c._sites]) for c in _ENTERED
        ]
        ops.MODEL_PASSES.enter()
        mode = capture._intercept  # (taken off by own work where it was innermost only)
        self._pushed = mode is not None and all(m is not mode for m in function_modes())
        if self._pushed:
            push_mode(mode)

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._pushed:
            pop_innermost_mode(self._capture._intercept)
        ops.MODEL_PASSES.leave()
        if kind is not None:
            for context, in_rule, sites in self._held:
                context._in_rule = in_rule
                for site, running, fused in sites:
                    site.running, site.fused = running, fused


class PerSample:
    """Context manager computing per-sample quantities during ``backward``; see
    :func:`leanprop.per_sample`."""

    def __init__(
        self,
        model: nn.Module,
        *quantities: Quantity,
        conv_algorithm: ConvAlgorithm = "auto",
        max_workspace_mib: float | None = None,
        check: bool = True,
        batch_dim: int = 0,
        batch_dims: Mapping[str | int, int | None] | None = None,
        fuse: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise LeanpropValueError(
                f"per_sample() needs an nn.Module as first argument, got {type(model).__name__}; "
                "call per_sample(model, BatchGrad(), ...)."
            )
        self._clip: ClipState | None = None  # see set_clipping()
        # none: the forward is recorded for leanprop.ggn, backward computes nothing extra
        self._ask(validate_quantities(quantities) if quantities else frozenset())
        self._subsampling = subsampling_of(quantities)  # BatchGrad(subsampling=...)
        if conv_algorithm not in CONV_ALGORITHMS:
            raise LeanpropValueError(
                f"per_sample() got conv_algorithm={conv_algorithm!r}; allowed: "
                f"{', '.join(map(repr, CONV_ALGORITHMS))}."
            )
        if max_workspace_mib is not None and not (
            isinstance(max_workspace_mib, int | float)
            and not isinstance(max_workspace_mib, bool)
            and 0 < max_workspace_mib < float("inf")
        ):
            raise LeanpropValueError(
                f"per_sample() got max_workspace_mib={max_workspace_mib!r}; it must be a "
                "positive, finite number of MiB (scratch memory per layer, e.g. 16) or None "
                "(default)."
            )
        _check_dim("batch_dim", batch_dim)
        if batch_dims is not None and not isinstance(batch_dims, Mapping):
            raise LeanpropValueError(
                f"per_sample() got batch_dims={batch_dims!r}; pass a dict from input names or "
                "positions to the batch dimension of that input (None: it has no batch), e.g. "
                "batch_dims={'src_key_padding_mask': 0}."
            )
        for key, d in (batch_dims or {}).items():
            if d is not None:
                _check_dim(f"batch_dims[{key!r}]", d)
        self._model = weakref.ref(model)
        self._model_held: nn.Module | None = model  # (see owned_by_model)
        self.quantities = quantities
        self.conv_algorithm = conv_algorithm
        self._workspace_mib = max_workspace_mib
        self._options_made: dict[tuple, RuleOptions] = {}
        self._work_made: Work | None = None  # (see _work)
        self._check = check
        self._fuse = fuse  # op interception while active (a TorchFunctionMode)
        self._batch_dim = batch_dim
        self._batch_dims = dict(batch_dims or {})
        self._tracker = BatchTracker(())
        self._root_running = False  # between the model's forward pre-hook and forward hook
        self._params_reached = False  # the outermost backward running reached our parameters
        self._backward_depth = 0  # backward passes called through the op interception
        self._accumulating = False  # the outermost one is a .backward() (not autograd.grad)
        self._passive = 0  # inside a backward that is not for the parameters (backward_scope)
        self._cycle_seen = False  # a cycle was open when the outermost backward_scope began
        self._op_params: set[nn.Parameter] = set()  # of modules without rule: ops.py
        self._captured: frozenset[nn.Parameter] = frozenset()  # rule sites' and op-level
        self._handles: list[RemovableHandle] = []
        self._sites: list[Site] = []
        self._batch_norms: list[tuple[str, nn.Module]] = []  # (name, module) of the model's
        self._states: dict[nn.Parameter, ParamState] = {}
        self._cycle = Cycle(self._states, self._sites)  # the current forward and its backward
        self._cycle.watch_results = weakref.WeakMethod(self._watch_results)  # (no cycle)
        self._active = False
        self._computing_here = False
        self._layer_outputs_only = 0  # see for_layer_outputs
        self._intercept: Intercept | None = None
        self._fusable_by_weight: dict[int, list[Site]] = {}  # id(weight) -> fusable sites
        self._rule_sites_of: dict[Tensor | None, list[Site]] = {}  # weight -> rule sites
        self._rule_sites_using: dict[Tensor, list[Site]] = {}  # parameter -> its rule sites
        self.reset_on_forward = False  # see set_quantities
        # last backward, for leanprop.all_reduce_quantities: batch size and, if Variance was
        # asked for, each parameter's sum of individual gradients (its local mean times N)
        self.last_n: int | None = None
        self.last_sums: dict[nn.Parameter, Tensor] = {}
        self._observers: list[Observer] = []  # see observing()
        self._in_rule: Counter[nn.Parameter] = Counter()  # parameters of rule sites running
        # module calls made during a backward: a checkpoint recomputing part of the forward
        self.recomputed = 0

    @property
    def model(self) -> nn.Module:
        """The model this context computes quantities for."""
        model = self._model()
        if model is None:
            raise LeanpropValueError("per_sample: the model of this context no longer exists.")
        return model

    @property
    def model_alive(self) -> bool:
        """Whether the model still exists (the BackPACK facade holds it weakly)."""
        return self._model() is not None

    def owned_by_model(self) -> RemovableHandle:
        """The model owns this context from now on (the facades keep it for the model's life):
        it is held by a no-op hook on the model, and holds the model weakly, so that dropping
        the model frees both at once. Returns the hook's handle (removing it drops that hold)."""
        handle = self.model.register_forward_pre_hook(_Holder(self))
        self._model_held = None
        return handle

    @property
    def kinds(self) -> frozenset[type[Quantity]]:
        """The quantities asked for (written to the parameters after each backward)."""
        return self._asked

    @property
    def subsampling(self) -> tuple[int, ...] | None:
        """The samples whose individual gradients ``BatchGrad`` keeps (None: all)."""
        return self._subsampling

    def _ask(self, kinds: frozenset[type[Quantity]]) -> None:
        self._asked, self._kinds = kinds, computed_kinds(kinds)  # (_kinds: what is computed)
        if self._clip is not None:  # (its norms)
            self._kinds = self._kinds | {BatchL2Grad}

    def set_clipping(self, clipping: Clipping) -> None:
        """Clip per sample in each backward (``clipping.py``; :func:`leanprop.clip_per_sample`
        is the public way in): a backward then adds to each parameter's ``.grad`` its clipped
        gradient instead of its gradient; nothing else is computed or written."""
        if self._asked or self._active:
            raise LeanpropValueError(
                "per-sample clipping is set on a context opened without quantities, before it "
                f"is entered; this one asks for {sorted(k.__name__ for k in self._asked)} and "
                f"is {'active' if self._active else 'not active'}."
            )
        self._clip = ClipState(clipping)
        self._ask(frozenset())

    @property
    def clipping(self) -> Clipping | None:
        """The per-sample clipping this context does (None: none)."""
        return None if self._clip is None else self._clip.clipping

    def holds_clipped_grad(self, p: nn.Parameter) -> bool:
        """Whether ``p.grad`` is what this context's clipping left: the clipped gradients of
        one or more backward passes, nothing added or changed since (an unclipped backward,
        ``.grad`` replaced or modified in place)."""
        return self._clip is not None and self._clip.holds(p)

    def clipped_backwards_in(self, p: nn.Parameter) -> int:
        """How many clipped backward passes ``p.grad`` adds up (0: not held)."""
        return 0 if self._clip is None else self._clip.backwards_in(p)

    @property
    def clipped_backwards(self) -> int:
        """Backward passes that clipped, since the context was made."""
        return 0 if self._clip is None else self._clip.backwards

    @property
    def last_norms(self) -> Tensor | None:
        """The per-sample gradient norms ``[N]`` before clipping in the last backward that
        clipped (over the parameters it reached)."""
        return None if self._clip is None else self._clip.last_norms

    @property
    def active(self) -> bool:
        """Whether the context is entered (and not yet left)."""
        return self._active

    def set_quantities(
        self, kinds: frozenset[type[Quantity]], conv_algorithm: str,
        subsampling: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        """Change what backward computes (used by the BackPACK facade, whose forward runs
        before the quantities are known). Empty ``kinds``: idle, forward is still recorded and
        backward computes nothing extra; each forward of the model then starts a new cycle.
        ``subsampling``: the samples whose individual gradients are kept (None: all)."""
        self._ask(kinds)
        self._subsampling = subsampling
        self.conv_algorithm = conv_algorithm
        self.reset_on_forward = True

    @contextmanager
    def computing(self, kinds: frozenset[type[Quantity]] | None = None) -> Iterator[None]:
        """Compute ``kinds`` (None: those asked for) in the backward passes run inside the
        block (curvature's extra passes, or BackPACK's ``retain_graph=True``: several backward
        passes through one forward), then what was asked before. The inputs of modules hooked
        as a whole are kept for each next backward through the same forward, the first after
        the block included."""
        saved, subsampling, keep = self._asked, self._subsampling, self._cycle.keep_calls
        self._ask(saved if kinds is None else kinds)
        if kinds is not None:
            self._subsampling = None  # (the passes need every sample)
        self._cycle.keep_calls = True
        try:
            yield
        finally:
            self._ask(saved)
            self._subsampling = subsampling
            self._cycle.keep_calls = keep

    def raise_pending_refusal(self) -> None:
        """Raise what the recorded forward's backward would refuse before computing anything
        (noted with no quantities asked: BatchNorm in training mode, a tensor from parameters
        through a reentrant checkpoint's output): for curvature computed without the
        engine's per-sample passes."""
        if self._cycle.pending_refusal is not None:
            raise UnsupportedModelError(self._cycle.pending_refusal)

    @contextmanager
    def for_layer_outputs(self) -> Iterator[None]:
        """The backward passes in the block are for gradients of layer outputs only (the
        curvature's batched columns): the replaced ops skip their parameters' gradients."""
        self._layer_outputs_only += 1
        try:
            yield
        finally:
            self._layer_outputs_only -= 1

    @property
    def layer_outputs_only(self) -> bool:
        """Inside :meth:`for_layer_outputs`."""
        return self._layer_outputs_only > 0

    @property
    def batch_dim(self) -> int:
        """The dimension of the model's inputs that holds the samples (``batch_dim=``)."""
        return self._batch_dim

    def batch_dim_of(self, t: Tensor) -> int | str | None:
        """Where ``t`` (a tensor of the recorded forward) holds the samples: a dimension (of
        ``N`` samples, each whole), a description of why none does (the samples were mixed,
        or flattened with another dimension), or None where leanprop did not follow ``t``
        (not computed from the model's inputs inside the block, or not op by op)."""
        return _where(self._tracker.info(t))

    def batch_dim_of_node(self, node: Any) -> int | str | None:
        """Where the output of autograd node ``node`` holds the samples, for a curved
        elementwise op of the recorded forward (``tanh``, ``sigmoid``, ...; see
        :meth:`batch_dim_of`); None where leanprop did not record it. Without the op
        interception (``fuse=False``), ``batch_dim``: every layer's documented layout."""
        if self._intercept is None:
            return self._batch_dim
        return _where(self._tracker.curved(node))

    @property
    def samples(self) -> int | None:
        """Samples in the recorded forward (None before one)."""
        return self._cycle.n

    @contextmanager
    def observing(self, observer: Observer) -> Iterator[None]:
        """Call ``observer(module, inputs, grad_output)`` for each call of a layer with a
        rule that the backward passes inside the block reach, with the batch first (curvature's
        Kronecker factors come from them)."""
        self._observers.append(observer)
        try:
            yield
        finally:
            self._observers.remove(observer)

    # ------------------------------------------------------------------ set-up / tear-down
    def __enter__(self) -> PerSample:
        if self._active:
            raise LeanpropValueError(
                "this per_sample context is already active; use one `with` block at a time."
            )
        outer = [m.capture for m in function_modes() if isinstance(m, Intercept)]
        if outer and (self._clip is not None or any(c.clipping is not None for c in outer)):
            raise LeanpropValueError(
                "per-sample clipping cannot be nested with another per_sample context (each "
                "would take the other's gradients); open one at a time."
            )
        try:
            self._plan(self.model, "", None, set())
            if not self._states:
                raise LeanpropValueError(
                    f"per_sample() found no trainable parameter in {type(self.model).__name__}; "
                    "nothing to compute (are all parameters frozen?)."
                )
            if any(p.is_complex() for p in self._states):
                complex_ = [n for n, p in self.model.named_parameters()
                            if p in self._states and p.is_complex()]  # fmt: skip
                raise UnsupportedModelError(
                    f"per_sample(): complex parameters {complex_[:3]} are not supported (the "
                    "layers' closed forms are real); keep the parameters real (e.g. a complex "
                    "weight as two real ones, combined with torch.complex in the forward)."
                )
            self._cycle.clear_attrs()
            hooks, model = self._handles, self.model  # (hooks hold this context weakly)
            for m_name, m in self._batch_norms:
                hooks.append(m.register_forward_pre_hook(_Weakly(self._bn_check, m_name)))
            for site in self._sites:
                enter = self._on_fallback_enter if site.rule is None else self._on_rule_enter
                hooks.append(site.module.register_forward_pre_hook(_Weakly(enter, site)))
                on_forward = _Weakly(self._on_forward, site)
                # (first: a user's forward hook on the module runs outside it, op by op)
                hooks.append(
                    site.module.register_forward_hook(on_forward, with_kwargs=True, prepend=True)
                )
            for state in self._states.values():
                hooks.append(state.param.register_hook(_Weakly(self._on_param_grad, state)))
                # (also where this torch may lose the first hook: this one then tells)
                if self._clip is not None or saving_loses_leaf_hooks():
                    on_accumulated = _Weakly(self._on_accumulated, state)
                    hooks.append(state.param.register_post_accumulate_grad_hook(on_accumulated))
            on_enter = _Weakly(self._on_model_enter)  # first: it may start a new cycle, which
            # resets what the model's own pre-hook as a site (a bare nn.Linear) would mark
            hooks.append(model.register_forward_pre_hook(on_enter, with_kwargs=True, prepend=True))
            hooks.append(model.register_forward_hook(_Weakly(self._on_model_exit)))
            self._tracker = BatchTracker(self._states)
            self._captured = frozenset(self._op_params) | frozenset(
                p for site in self._sites if site.rule is not None for p in site.direct.values()
            )
            if self._fuse:
                self._intercept = Intercept(self)
                self._intercept.__enter__()
            self._active = True
            _ENTERED.add(self)
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._teardown()

    def _teardown(self) -> None:
        self._active = False
        _ENTERED.discard(self)
        misplaced = False
        if self._intercept is not None:
            # leaving pops the innermost mode: only ours may be popped
            misplaced = top_function_mode() is not self._intercept
            if not misplaced:
                self._intercept.__exit__(None, None, None)
                self._intercept = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        # a later backward through the graph is an ordinary one
        self._cycle.abort()
        self._sites.clear()
        self._batch_norms.clear()
        self._fusable_by_weight.clear()
        self._rule_sites_of.clear()
        self._rule_sites_using.clear()
        self._states.clear()
        self._op_params.clear()
        self._tracker = BatchTracker(())
        self._root_running = False
        self._computing_here = False
        self.last_n, self.last_sums = None, {}
        if misplaced:  # everything else is undone; our mode stays, passing every op through
            raise LeanpropError(
                "per_sample: the `with` block ended while a TorchFunctionMode entered inside it "
                "was still active, so leanprop could not remove its own op interception (it "
                "now passes every op through unchanged). Exit modes in the reverse order of "
                "entering them."
            )

    def _plan(self, module: nn.Module, prefix: str, root: Site | None, planned: set[int]) -> None:
        if id(module) in planned:  # one module at several places (a layer registered twice):
            return  # one site takes all its calls
        planned.add(id(module))
        if isinstance(module, BatchNormBase):  # (refused in training mode: _bn_check)
            self._batch_norms.append((prefix, module))
        direct = {k: p for k, p in module._parameters.items() if p is not None and p.requires_grad}
        rule = rule_for(module)
        if rule is not None and not set(direct) <= {"weight", "bias"}:
            rule = None  # e.g. weight_norm's weight_g/weight_v: not what the rule knows
        op_level = (
            self._fuse and rule is None and root is None and not isinstance(module, nn.RNNBase)
        )
        if direct and op_level:  # its parameters are captured at each op that uses them (ops.py)
            for k, p in direct.items():
                self._state(p, f"{prefix}.{k}" if prefix else k)
                self._op_params.add(p)
        elif direct and (rule is not None or root is None):
            site = Site(prefix or type(module).__name__, module, rule, direct)
            site.fusable = (
                self._fuse
                and rule is not None
                and rule.input_grad is not None
                and rule.param_grads is not None
                and (rule.can_fuse is None or rule.can_fuse(module))
            )
            self._sites.append(site)
            if site.fusable:
                weight = module._parameters.get("weight")
                self._fusable_by_weight.setdefault(id(weight), []).append(site)
            elif rule is not None and self._fuse and "weight" in direct:
                self._rule_sites_of.setdefault(direct["weight"], []).append(site)
            if rule is not None:
                for p in direct.values():
                    self._rule_sites_using.setdefault(p, []).append(site)
            if root is not None:
                root.inner.append(site)
            if rule is None:  # fallback root: owns its whole sub-tree unless children are called
                root = site
            for k, p in direct.items():
                self._state(p, f"{prefix}.{k}" if prefix else k)
        elif direct and root is not None:
            for k, p in direct.items():
                self._state(p, f"{prefix}.{k}")
        for child_name, child in module._modules.items():
            if child is not None:
                name = f"{prefix}.{child_name}" if prefix else child_name
                self._plan(child, name, root, planned)

    def _state(self, p: nn.Parameter, name: str) -> None:
        if p not in self._states:
            self._states[p] = ParamState(name, p)

    # ------------------------------------------------------------------ forward
    def _bn_check(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._computing or not torch.is_grad_enabled():
            return
        if module.training or module.running_mean is None:
            self._refuse_batch_statistics(f"{type(module).__name__} '{name}'")

    def _refuse_batch_statistics(self, what: str) -> None:
        """A batch norm in training mode in this forward (see :meth:`_refuse_when_asked`)."""
        self._refuse_when_asked(
            f"per_sample: {what} normalises with statistics of the whole batch (training "
            "mode), so each sample's gradient depends on the other samples and per-sample "
            "quantities are undefined. Put it in eval mode (module.eval(), or training=False "
            "with running statistics), or replace it with GroupNorm/LayerNorm."
        )

    def _refuse_when_asked(self, problem: str) -> None:
        """Something in this forward makes per-sample quantities undefined or out of reach:
        refused now if quantities are asked, else when a backward asks for them (the first
        one seen is kept). A forward for curvature alone, or with none asked, goes on."""
        if self._kinds:
            raise UnsupportedModelError(problem)
        if self._cycle.pending_refusal is None:
            self._cycle.pending_refusal = problem

    def _on_model_enter(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A forward of the whole model: drop a cycle that died, mark the batched inputs. A
        forward without autograd (``torch.no_grad()``: an evaluation) has no backward: it
        leaves the records of the forward before it alone."""
        if self._computing or not torch.is_grad_enabled():
            return
        died = (self._cycle.finish_queued or self._root_running) and current_graph_task_id() == -1
        if died or not self._root_running:  # (a forward that raised inside a rule site left it)
            self._in_rule.clear()
        done = self._cycle.backward_done and not self._recomputing()
        anew = died or done or self.reset_on_forward
        if died or done:
            # a new forward after a backward; or a backward that raised never ended its cycle,
            # or a forward raised: start anew
            self._abort_cycle()
        elif self.reset_on_forward and not self._cycle.open:
            # facade: drop what a forward recorded without a backward that asked for quantities
            recorded = any(s.uses for s in self._states.values())
            self._abort_cycle()
            self._cycle.discarded_forward = recorded  # a backward through it cannot be split
        if self._clip is not None:
            self._clip.new_forward()
        # inputs that carry the batch already (an earlier forward's outputs, or the same
        # tensors again: an unrolled model, R-Drop) hold the same samples: one forward's
        # contributions; fresh inputs (another part of the batch, another view) a new one's
        same_samples = (
            not anew and self._intercept is not None and self._inputs_tracked(args, kwargs)
        )
        if not same_samples:
            self._cycle.next_forward()  # its contributions are told from an earlier forward's
        self._root_running = self._cycle.model_forward = True
        if self._intercept is not None:
            if not same_samples:
                self._tracker.clear()
            self._mark_inputs(args, kwargs)
            if (
                self._cycle.n is not None
                and self._tracker.n != self._cycle.n
                and not self._cycle.open
            ):
                # an earlier forward of another batch size never had its backward (e.g. a
                # validation loss under grad): this forward starts anew (a late backward
                # through the earlier one is refused where it meets a captured op)
                dropped = self._cycle.n
                self._cycle.drop_forward()
                self._abort_cycle()
                self._cycle.dropped_n = dropped  # (a backward through it finds nothing of ours)

    def _inputs_tracked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether every batched tensor input of the model carries the batch already."""
        tensors = [
            t
            for key, value in [*enumerate(args), *kwargs.items()]
            if self._batch_dims.get(key, self._batch_dim) is not None
            for t in tree_flatten(value)[0]
            if isinstance(t, Tensor) and t.dim() > 0
        ]
        return bool(tensors) and all(isinstance(self._tracker.info(t), BatchDim) for t in tensors)

    def _on_model_exit(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self._root_running = False

    def _mark_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model's input tensors carry the batch at ``batch_dim`` (or ``batch_dims[key]``)."""
        named: list[tuple[str | int, Any]] = [*enumerate(args), *kwargs.items()]
        for key, value in named:
            dim = self._batch_dims.get(key, self._batch_dim)
            if dim is None:
                continue
            if isinstance(value, PackedSequence):  # samples sorted by length, packed
                n = sample_count(value)
                self._input_samples(key, n, f"a PackedSequence of {n} sequences")
                self._tracker.mark(value.data, packed_data(sorted_order(value)))
                continue
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]
            if not isinstance(value, Tensor) and tensors and key not in self._batch_dims:
                raise BatchError(
                    f"per_sample: the model's input {key!r} is a {type(value).__name__} of "
                    "tensors: leanprop cannot tell whether each holds the batch (in dimension "
                    f"{dim}) or whether they are the samples themselves (sequences for "
                    f"pack_sequence). If each holds the batch, say where: batch_dims={{{key!r}: "
                    f"{dim}}}. For a list of samples, pack it before the model "
                    "(torch.nn.utils.rnn.pack_sequence) and pass the PackedSequence."
                )
            for t in tensors:
                if t.dim() == 0:
                    continue
                if t.dim() <= dim:
                    raise BatchError(
                        f"per_sample: the model's input {key!r} has shape {tuple(t.shape)}, "
                        f"which has no batch dimension {dim}. Pass batch_dim= for where the "
                        f"batch is, or batch_dims={{{key!r}: None}} if this input has no batch."
                    )
                n = t.shape[dim]
                self._input_samples(key, n, f"shape {tuple(t.shape)}: {n} in batch dimension {dim}")
                self._tracker.mark(t, BatchDim(dim))

    def _input_samples(self, key: str | int, n: int, what: str) -> None:
        """The model's input ``key`` holds ``n`` samples: the same as every other input."""
        if self._tracker.n is None:
            self._tracker.n = n
        elif n != self._tracker.n:
            raise BatchError(
                f"per_sample: the model's input {key!r} has {what}, but another input has "
                f"{self._tracker.n} samples. Say where its batch is with "
                f"batch_dims={{{key!r}: DIM}} (or None if it has no batch)."
            )

    # ------------------------------------------------------------------ op interception
    def _tracking(self) -> bool:
        """Whether batch tracking decides where the batch is: during the model's forward, and
        while a checkpoint recomputes part of it in backward (else: ``batch_dim`` of each
        module's input, e.g. when a sub-module is called directly)."""
        return self._intercept is not None and (
            self._root_running or (self._tracker.n is not None and current_graph_task_id() != -1)
        )

    @property
    def follows_the_batch(self) -> bool:
        """Whether the op interception follows the samples through the forward (else each
        module's input holds them at ``batch_dim``)."""
        return self._intercept is not None

    def tracks(self, t: Any) -> bool:
        """Whether ``t`` is one of the parameters this context computes quantities of."""
        return isinstance(t, Tensor) and t in self._states

    def follow_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called by the op interception for every op it does not replace: run it, and follow
        it where it touches a tracked tensor. Most ops of a forward take batched tensors and
        constants only (no parameter): where the batch went is all there is to record;
        an op that may use a parameter goes through :meth:`run_op`."""
        if not self._active or self._computing or self._intercept is None:
            return func(*args, **kwargs)
        batched = self._tracker.batched_only(args, kwargs)
        if batched is None:  # (a tracked parameter, or a tensor derived from one, may be used)
            if not self._tracker.involved(args, kwargs):
                return func(*args, **kwargs)
            return self.run_op(func, args, kwargs)
        out = func(*args, **kwargs)
        if batched:
            self.after_op(func, args, kwargs, out, batched)
        return out

    def before_op(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Parameter-derived operands of an op that meets the batch: captured (broadcast.py);
        of one that joins values in which the samples were combined: watched (escapes.py)."""
        if not torch.is_grad_enabled():
            return args, kwargs
        if not args and "tensors" in kwargs and op_name(func) in broadcast.CONCAT_MEETINGS:
            kwargs = dict(kwargs)  # (torch.cat(tensors=[...]): positional, as meet reads it)
            args = (kwargs.pop("tensors"),)
        if self._tracking():
            owned = self._captured - self._in_rule.keys() if self._in_rule else self._captured
            args = broadcast.meet(
                self._tracker,
                op_name(func),
                args,
                owned,
                self._sink(),
                self._count_use,
                self._refuse_when_asked,
            )
        escaping = self._escaping(func, args, kwargs)
        if escaping:
            args, kwargs = list(args), dict(kwargs)
            for (key, *inner), params in escaping:
                on_gradient = _Weakly(self._on_escape, params, op_name(func))
                holder = args if isinstance(key, int) else kwargs
                if inner:  # (an element of a list argument)
                    items = list(holder[key])
                    items[inner[0]] = EscapeWatch.apply(items[inner[0]], on_gradient)
                    holder[key] = type(holder[key])(items)
                else:
                    holder[key] = EscapeWatch.apply(holder[key], on_gradient)
            args = tuple(args)
        return args, kwargs

    def _escaping(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[tuple[int | str, ...], frozenset[nn.Parameter]]]:
        """Operands to watch (``BatchTracker.escaping``; also after the model's forward), where
        something checks them (``check``, clipping). The target of an in-place op is watched
        here, by a hook on its value before the op; the others are returned, to be wrapped."""
        if not (self._check or self._clip is not None):
            return []
        found = self._tracker.escaping(args, kwargs)
        if found and in_place(func):
            for place, params in found:
                if place == (0,):  # (args[0]: the tensor changed in place)
                    t = args[0]
                    before = GradientEdge(t.grad_fn, t.output_nr)
                    hook = _Weakly(self._on_escape, params, op_name(func), before)
                    self._cycle.tensor_handles.append(t.register_hook(hook))
            found = [(place, params) for place, params in found if place != (0,)]
        return found

    def _on_escape(
        self, params: frozenset[nn.Parameter], name: str, t: Tensor | GradientEdge, grad: Tensor
    ) -> None:
        """The gradient ``grad`` of a watched use ``t`` in this backward: the parameters it
        reaches with a gradient that is not zero are refused by the check (whatever the size
        of that part of their gradient)."""
        if not (self._active and not self._computing and not self._passive and self._kinds):
            return
        with self.own_work(), self.model_pass():
            found = reached(t, list(params), grad)
        for p in found:
            self._cycle.escaped.setdefault(self._states[p].name, name)

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op that touches a tracked tensor and may use a parameter (see
        :meth:`follow_op`): parameters broadcast over the batch (broadcast.py), parameters
        used in an op with no rule (ops.py), and where the batch went in the outputs."""
        args, kwargs = self.before_op(func, args, kwargs)
        # (a tensor computed from parameters without the batch, under a non-reentrant
        # checkpoint, keeps what its ops save: its parameters' contributions are handed back
        # through it by a backward of our own, ops.hand_back)
        keep = checkpoint_saves_tensors() and self._batch_free(args, kwargs)
        with ops.saving_own(keep):
            return self._run_op(func, args, kwargs)

    def _batch_free(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether no tensor of an op carries the batch, nor values the batch went into."""
        return all(self._tracker.info(t) is None for t in _flat_tensors(args, kwargs))

    def _run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rule_op = self._rule_op(args, kwargs)
        if rule_op is not None:
            return self._run_rule_op(func, args, kwargs, *rule_op)
        captured = self._op_uses(func, args, kwargs)
        if not captured:
            out = func(*args, **kwargs)
            self.after_op(func, args, kwargs, out)
            return out
        n = self._tracker.n or 0
        device = next(iter(self._states)).device
        tensors = _flat_tensors(args, kwargs)
        if any(t.is_complex() for t in tensors):
            _refuse_complex(func)
        roots = {i: self._tracker.vjp_root(tensors[i], self._refuse_when_asked) for i in captured}
        if func is Tensor.__setitem__ and not kwargs and self._batch_at(args[0]) is not None:
            return self._run_setitem(args, captured, n, device, roots)

        def after(out: Any) -> None:
            if any(t.is_complex() for t in _flat_tensors((out,), {})):
                _refuse_complex(func)
            self.after_op(func, args, kwargs, out)

        return ops.run(
            func, args, kwargs, captured, after, self._batch_at, n, self._budget(device),
            self._sink(), roots=roots,
        )  # fmt: skip

    def _batch_at(self, t: Tensor) -> BatchDim | None:
        """Where ``t`` holds the samples, where one dimension does."""
        info = self._tracker.info(t)
        return info if isinstance(info, BatchDim) else None

    def _run_setitem(
        self, args: tuple[Any, ...], captured: dict[int, tuple[nn.Parameter, ...]], n: int,
        device: torch.device, roots: dict[int, Tensor | ThroughCopies],
    ) -> None:  # fmt: skip
        """``x[index] = value`` with a parameter in ``value`` (Wav2Vec2's masked time steps
        take a learned embedding): captured as the same assignment into a copy of ``x``,
        which then goes into ``x`` (whose batch stays where it is). The op captured in place
        would change ``x`` inside its own graph, where its contributions are not taken."""
        x, info = args[0], self._tracker.info(args[0])
        copy = x.clone()
        self._tracker.mark(copy, info)
        out = ops.run(
            _set_item, (copy, *args[1:]), {}, captured,
            lambda result: self._tracker.mark(result, info), self._batch_at, n,
            self._budget(device), self._sink(), roots=roots,
        )  # fmt: skip
        x.copy_(out)

    def _rule_op(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Site, dict[int, str]] | None:
        """A running rule site's own op (its parameters among the op's tensors), where the rule
        can take the op's input as the module's: the site and {tensor position: name}."""
        if self._computing or not torch.is_grad_enabled():
            return None
        weight = args[1] if len(args) > 1 and isinstance(args[1], Tensor) else None
        weight = kwargs.get("weight", weight) if weight is None else weight
        if weight not in self._rule_sites_of:
            return None
        tensors = _flat_tensors(args, kwargs)
        for site in self._rule_sites_of.get(tensors[1] if len(tensors) > 1 else None, ()):
            if site.running and not site.fused and site.rule.at_op_level(site.module):
                names = {id(p): k for k, p in site.direct.items()}
                return site, {i: names[id(t)] for i, t in enumerate(tensors) if id(t) in names}
        return None

    def _run_rule_op(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], site: Site,
        positions: dict[int, str],
    ) -> Any:  # fmt: skip
        """The op of a rule site through ops.OpCapture, its backward handled by the rule (a
        call processed at each backward through it, so a retained graph's every backward
        gets its own results)."""
        x = args[0]
        bd = self._rule_batch(site, x)
        site.fused = True  # the module's forward hook has nothing left to record
        if bd is None:  # batch-free input: the output is parameter-derived (broadcast.py)
            site.calls += 1
            out = func(*args, **kwargs)
            self.after_op(func, args, kwargs, out)
            return out
        n = self._rule_batch_size(site, x, bd)
        site.calls += 1
        self._count_use(frozenset(site.direct.values()))
        forward = self._sink()

        def rule(local: list[Tensor], g: Tensor, out_bd: BatchDim) -> dict[int, Tensor]:
            if not self._active or not self._kinds or forward.closed:
                return {}  # (closed: also while a passive backward runs)
            call = Call(
                site, dict(site.direct), (local[0],), {}, n, [g], 0, in_bd=bd, out_bd=out_bd,
                forward=forward, replaced=True,
            )  # fmt: skip
            self._open_cycle()
            sums = self._process(call)
            return {i: sums[k] for i, k in positions.items() if k in sums}

        return ops.run(
            func, args, kwargs, {i: (site.direct[k],) for i, k in positions.items()},
            lambda out: self.after_op(func, args, kwargs, out),
            self._batch_at,
            n, self._budget(x.device), forward, rule,
        )  # fmt: skip

    def _op_uses(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[int, tuple[nn.Parameter, ...]]:
        """Tensors of an op (by position among the flattened tensors) that are captured
        parameters or derive from them, when the op also takes a batched tensor."""
        if not torch.is_grad_enabled() or "out" in kwargs or not self._tracking():
            return {}
        if in_place(func):
            return {}  # in-place: leave it (the sum check refuses an escaped use)
        quick = tensors_in(args, kwargs)  # cheap first look (one level of nesting)
        if not any(self._tracker.derived_params(t) for t in quick):
            return {}
        tensors = _flat_tensors(args, kwargs)
        if not any(isinstance(self._tracker.info(t), BatchDim) for t in tensors):
            return {}
        uses: dict[int, tuple[nn.Parameter, ...]] = {}
        for i, t in enumerate(tensors):
            params = self._tracker.derived_params(t)
            if (
                params
                and params <= self._captured
                and not any(site.running for site in self._rule_sites_using.get(t, ()))
                and not (self._in_rule and params & self._in_rule.keys())
            ):  # a rule site's parameter is captured here only where it escapes its module
                uses[i] = tuple(params)
        for params in uses.values():
            self._count_use(frozenset(params))
        return uses

    def after_op(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
        batched: list[tuple[int | str, Tensor, Any]] | None = None,
    ) -> None:  # fmt: skip
        """Where the batch went in the op's outputs (``batched``: its operands that carry the
        batch, where none derives from a parameter: ``BatchTracker.batched_only``); a
        functional batch norm in training mode on the batch refused."""
        if self._intercept is not None and not self._computing:
            replay = self._recomputing()
            if batched is None:
                self._tracker.propagate(func, args, kwargs, out, replay=replay)
            else:
                self._tracker.propagate_batched(func, args, kwargs, out, batched, replay)
            if func in _BATCH_NORMS and self._batch_statistics(args, kwargs):
                self._refuse_batch_statistics(f"'{op_name(func)}' (a functional batch norm)")

    def _batch_statistics(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A ``batch_norm`` call normalising samples together: training mode, autograd on,
        and an input that carries the batch anywhere but in its channels (not a weight
        standardised by it, nor a teacher's forward under ``torch.no_grad()``, nor instance
        normalisation as ``[1, N*C, ...]``)."""
        x = args[0] if args else kwargs.get("input")
        training = batch_norm_training(args, kwargs)
        info = self._tracker.info(x)
        channels = isinstance(info, BatchDim) and info.dim == 1
        return bool(training) and torch.is_grad_enabled() and info is not None and not channels

    def _count_use(self, params: Iterable[nn.Parameter]) -> None:
        """One more use of each of ``params`` in the recorded forward (several uses: their
        contributions are summed as individual gradients). A non-reentrant checkpoint's
        recomputation replays uses already counted: not again (the parameters of every
        checkpointed layer were taken for shared ones, their individual gradients held to the
        end of backward, memory growing with depth)."""
        if self._recomputing():
            return
        states = self._states
        for p in params:
            states[p].uses += 1

    def _sink(self) -> ops.Contribute:
        """The current cycle's place for contributions found outside any call."""
        if self._cycle.contributions is None:
            self._cycle.contributions = ops.Contribute(
                _Weakly(self._contribute), _Weakly(self.own_work), _Weakly(self._is_passive),
                _Weakly(self._norms_only), _Weakly(self._store_norms), self._cycle.scratch,
                _Weakly(self._sums_wanted), _Weakly(self.model_pass),
            )  # fmt: skip
        return self._cycle.contributions

    def _is_passive(self) -> bool:
        """No contributions wanted: a backward not for the parameters, or none asked for (the
        forward recorded for ``ggn`` only)."""
        return self._passive > 0 or not self._kinds

    @property
    def _computing(self) -> bool:
        """This context, or another one on this thread (nested contexts), runs its own
        per-sample work: its ops and module calls are not the model's (but for a block that a
        checkpoint recomputes inside a model pass of ours: see ``model_pass``)."""
        if ops.in_model_pass() and recomputing_checkpoint():
            if selective_checkpoint_active():
                raise UnsupportedModelError(_SELECTIVE_RECOMPUTED)
            return False
        return self._computing_here or ops.working()

    def own_work(self) -> _OwnWork:
        """Work of ours (per-sample and backward computations): its ops are not followed or
        captured, and hooks ignore the autograd calls made inside (a context manager)."""
        return _OwnWork(self)

    def model_pass(self) -> _ModelPass:
        """Inside :meth:`own_work`, a backward of ours through the model's own graph (a
        context manager; see :class:`_ModelPass`)."""
        return _ModelPass(self)

    def _sums_wanted(self) -> bool:
        """Whether a replaced op's summed gradients go into ``.grad``: not in a clipped
        ``.backward()`` (the clipping puts back what autograd accumulates)."""
        return not (self._clip is not None and self._accumulating)

    def _norms_only(self, t: Tensor) -> bool:
        state = self._states.get(t) if isinstance(t, nn.Parameter) else None
        return (
            state is not None
            and self._kinds == frozenset({BatchL2Grad})
            and state.uses == 1
            and not state.formed
        )

    def _store_norms(
        self, p: nn.Parameter, norms: Tensor, total: Tensor, compute_dtype: torch.dtype | None,
        source: ops.Contribute,
        reweigher: Callable[[], Callable[[Tensor], Tensor] | None] | None = None,
    ) -> None:  # fmt: skip
        """``BatchL2Grad`` of a parameter used once, from a closed form (``reweigher()``: its
        weighted sum, kept for clipping)."""
        self._open_cycle()
        self._cycle.from_forward(source)
        state = self._states[p]
        if self._clip is not None:
            reweigh = reweigher() if reweigher is not None else None
            if reweigh is None:
                raise LeanpropError(
                    f"per_sample clipping: no weighted sum for '{state.name}' (an internal "
                    "error: please report it with the model)."
                )
            state.reweigh.append(reweigh)
        state.saw(compute_dtype or norms.dtype)
        state.results[BatchL2Grad.attr] = widen(norms)
        state.total = total

    def _contribute(
        self,
        batch: dict[nn.Parameter, Tensor],
        compute_dtype: torch.dtype | None,
        source: ops.Contribute,
        summed: dict[nn.Parameter, Tensor],
    ) -> None:
        """Individual gradients ``[N, *p.shape]`` of one use, found outside any call (and
        their sums where the op hands those to autograd)."""
        self._open_cycle()
        self._cycle.from_forward(source)
        for p, b in batch.items():
            state = self._states[p]
            state.saw(compute_dtype or b.dtype)
            # 16-bit (autocast) kept in the parameter's dtype
            state.add_batch(b.to(p.dtype), summed=summed.get(p))

    def _rule_batch(self, site: Site, x: Any) -> BatchDim | None:
        """Where the batch is in a rule site's input; None if it carries none."""
        if not self._tracking():
            return BatchDim(self._batch_dim)
        info = self._tracker.info(x)
        if isinstance(info, Lost):
            raise BatchError(
                f"per_sample: {type(site.module).__name__} '{site.name}' got an input in which "
                f"leanprop cannot tell which dimension holds the samples: {info.reason}. "
                f"{how_to_keep(info)}"
            )
        return info

    def _rule_out_batch(self, site: Site, out: Any, in_bd: BatchDim) -> BatchDim:
        if not self._tracking():
            return in_bd
        info = self._tracker.info(out)
        if not isinstance(info, BatchDim):
            raise BatchError(
                f"per_sample: the output of {type(site.module).__name__} '{site.name}' has no "
                f"batch dimension leanprop can follow ({getattr(info, 'reason', 'none')})."
            )
        return info

    def _on_fallback_enter(self, site: Site, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self._computing:
            self._note_direct_call(site)  # (first: it may start a new cycle)
            site.calls_before = [s.calls for s in site.inner]
            self.recomputed += current_graph_task_id() != -1

    def _on_rule_enter(self, site: Site, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self._computing:
            self._note_direct_call(site)  # (first: it may start a new cycle)
            self.recomputed += current_graph_task_id() != -1
        site.running = not self._computing
        site.fused = False
        if site.running and not site.rule.at_op_level(module):
            # hooked as a whole: its parameters' uses inside are its rule's (not captured op
            # by op); a rule run at its op leaves the module's other uses to the op capture
            self._in_rule.update(site.direct.values())

    def _note_direct_call(self, site: Site) -> None:
        """A module of the model called on its own (the model's forward not running): what
        it records is not followed from the model's inputs, and a weight it shares with
        another module (a tied embedding and head) may be split wrongly, so this forward's
        quantities are checked even with ``check=False``. Not one: a checkpoint's recompute
        inside backward of the model's forward (a non-reentrant one replaying it; a reentrant
        one recording its part of it, which ran under no_grad)."""
        if (
            not self._root_running and torch.is_grad_enabled() and site.module is not self.model
            and not self._recomputing()  # (a non-reentrant checkpoint replays the forward)
        ):  # fmt: skip
            # the first call of a new forward: start it here, so that a model call taking its
            # output does not drop it
            if self._cycle.backward_done:
                self._abort_cycle()
            elif self._cycle.model_forward and current_graph_task_id() != -1:
                return  # (a reentrant checkpoint's part of the model's forward)
            self._cycle.direct_call = site.name

    def _recomputing(self) -> bool:
        """A module call inside a backward, but for a reentrant checkpoint's: a non-reentrant
        checkpoint recomputing the recorded forward, not a new forward (a reentrant
        checkpoint's forward runs under no_grad, and is recorded when its backward runs it
        again: a new forward)."""
        return current_graph_task_id() != -1 and not in_reentrant_checkpoint_backward()

    def begin_fused(self, x: Any, weight: Any) -> Call | None:
        """Called by the op interceptor: record a call of a running fusable site whose own
        weight is ``weight``; None to leave the op alone."""
        if self._computing or not self._active or not torch.is_grad_enabled():
            return None
        site = None
        for s in self._fusable_by_weight.get(id(weight), ()):
            if s.running and s.module._parameters.get("weight") is weight:
                site = s
                break
        if (
            site is None
            or type(x) is not Tensor
            or site.fused
            or torch.is_autocast_enabled(x.device.type)
        ):
            return None
        bd = self._rule_batch(site, x)
        if bd is None:  # batch-free input: its output is parameter-derived (broadcast.py)
            return None
        n = self._rule_batch_size(site, x, bd)
        site.calls += 1
        site.fused = True
        # the input lives in the replaced op's autograd graph (it saves it), not in the call
        params = dict(site.direct)
        call = Call(site, params, None, {}, n, [None], 1, in_bd=bd, out_bd=bd,
                    forward=self._sink(), replaced=True)  # fmt: skip
        self._count_use(params.values())
        return call

    def end_fused(
        self, call: Call, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor
    ) -> None:
        """Called by the op interceptor after a replaced op: where the batch went in its
        output; an op that mixed the samples (a LayerNorm normalising over the batch, a linear
        layer summing over it) has no per-sample gradients: refused."""
        info = None
        if self._intercept is not None and not self._computing:
            info = self._tracker.propagate_layer(func, args, kwargs, out, self._recomputing())
        if isinstance(info, Lost) and self._tracking():
            site = call.site
            raise BatchError(
                f"per_sample: {type(site.module).__name__} '{site.name}' mixes the samples "
                f"({info.reason}): each sample's gradient depends on the others, so per-sample "
                "quantities are undefined. Keep the batch out of the dimensions the layer acts "
                "on (batch_dim=, or the layer's configuration)."
            )

    def fused_backward(self, call: Call, x: Tensor, grad: Tensor) -> Call | None:
        """Output gradient of a replaced op: the call to process (:meth:`compute_call`, inside
        :meth:`own_work`), or None when the capture is over and the op must do an ordinary
        backward."""
        if self._active and self._kinds:
            call.forward.refuse_if_dropped()
        if not self._active or not self._kinds or call.forward.closed:
            return None  # (closed: also while a passive backward runs)
        if call.closed:  # another backward through the same forward: a call of its own
            call = replace(call, grads=[None], closed=False)
        call.args = (x,)
        self._open_cycle()
        call.grads[0] = grad
        call.pending = 0
        return call

    def _site_params(self, site: Site) -> dict[str, nn.Parameter]:
        """Parameters a call of ``site`` is responsible for (names within the module)."""
        if site.rule is not None:
            return dict(site.direct)
        before = site.calls_before or [0] * len(site.inner)
        called = {id(s.module) for s, c in zip(site.inner, before, strict=True) if s.calls > c}
        skip = {f"{n}." for n, m in site.module.named_modules() if n and id(m) in called}
        return {
            k: p
            for k, p in site.module.named_parameters()
            if p in self._states and not any(k.startswith(s) for s in skip)
        }

    def _on_forward(
        self, site: Site, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ):
        if site.running and site.rule is not None and not site.rule.at_op_level(module):
            self._in_rule.subtract(site.direct.values())
            self._in_rule += Counter()  # (drops the zero counts)
        site.running = False
        if site.fused:  # already recorded by begin_fused
            site.fused = False
            return None
        if site.rule is None and self._computing:
            return None
        if self._computing or not torch.is_grad_enabled() or self.layer_outputs_only:
            return None  # (a checkpoint recomputing in the curvature's passes: ggn refuses)
        leaves, _ = tree_flatten(out)
        if site.rule is not None:
            bd = self._rule_batch(site, args[0] if args else None)
            if bd is None:  # batch-free input: its output is parameter-derived
                site.calls += 1  # (a fallback root above leaves its parameters alone)
                return None
            n = self._rule_batch_size(site, args[0], bd)
            call = Call(site, {}, args, kwargs, n, [None] * len(leaves), 0, in_bd=bd)
            call.out_bd = self._rule_out_batch(site, leaves[0], bd)
        else:
            n, in_dims, out_dims = call_dims(
                site, args, kwargs, leaves, self._tracker, self._tracking(), self._name_of
            )
            n = None if n is None else self._same_n(site, n)
            if n is None:  # batch-free call: its outputs are parameter-derived
                return None
            call = Call(site, {}, args, kwargs, n, [None] * len(leaves), 0)
            call.in_dims, call.out_dims = in_dims, out_dims
            call.packed = bool(args) and isinstance(args[0], PackedSequence)
            device = next(iter(site.direct.values())).device.type
            if torch.is_autocast_enabled(device):
                call.autocast = (device, torch.get_autocast_dtype(device))
        site.calls += 1
        call.forward = self._sink()
        call.params = params = self._site_params(site)
        for i, t in enumerate(leaves):
            if isinstance(t, Tensor) and t.requires_grad:
                call.pending += 1
                # (a layer's output that is a view of the whole op's result, F.linear's on
                # [N, T, I]: hooked at the result, whose gradient is the same; the view's own
                # node leaves the graph when the view is changed in place, `h += x`)
                base = _whole_base(t) if site.rule is not None else None
                hook = (
                    t.register_hook(_Weakly(self._on_output_grad, call, i))
                    if base is None
                    else base.register_hook(_Weakly(self._on_base_grad, call, i, t.shape))
                )
                self._cycle.tensor_handles.append(hook)
        call.hooked = call.pending
        if call.pending and params:
            self._count_use(params.values())
            self._cycle.calls.append(call)
        return None

    def _rule_batch_size(self, site: Site, x: Tensor, bd: BatchDim) -> int:
        """Samples in a rule site's input (batch at ``bd``); checks the input's shape."""
        if x.dim() <= bd.dim:
            raise BatchError(
                f"per_sample: {type(site.module).__name__} '{site.name}' got an input of shape "
                f"{tuple(x.shape)}, which has no batch dimension {bd.dim}. Per-sample quantities "
                "need a batch dimension (batch_dim=, default 0)."
            )
        n = x.shape[bd.dim] // bd.inner
        problem = None
        if site.rule.check_input is not None:
            problem = site.rule.check_input(site.module, (to_front(x, bd, n),))
        if problem is None and (bd.dim, bd.inner) != (0, 1) and site.rule.batch_first:
            problem = f"got its batch in dimension {bd.dim}; it needs the batch first"
        if problem is not None:
            raise BatchError(
                f"per_sample: {type(site.module).__name__} '{site.name}' {problem}. "
                "Per-sample quantities need a batch dimension N (first, or at batch_dim=)."
            )
        return self._same_n(site, n)

    def _name_of(self, p: nn.Parameter) -> str:
        return self._states[p].name

    def _same_n(self, site: Site, n: int) -> int:
        if self._cycle.n is None:
            self._cycle.n = n
        elif n != self._cycle.n:
            raise BatchError(
                f"per_sample: {type(site.module).__name__} '{site.name}' got a batch of {n} "
                f"samples, but earlier modules in this forward got {self._cycle.n}. Every tracked "
                "module must see the same batch; run backward before a forward with another "
                "batch size."
            )
        return n

    # ------------------------------------------------------------------ backward
    def _open_cycle(self) -> None:
        if not self._cycle.open:
            if self._clip is not None and self._clip.clipped_this_forward:
                raise UnsupportedModelError(_SECOND_CLIPPED_BACKWARD)
            if self._cycle.pending_refusal is not None:
                problem, self._cycle.pending_refusal = self._cycle.pending_refusal, None
                raise UnsupportedModelError(problem)
            self._cycle.open = self._cycle_seen = True
            self._cycle.grad_mode = torch.is_grad_enabled()
            self._cycle.clear_attrs()
            task = current_graph_task_id()
            for state in self._states.values():  # drop those of earlier backward passes;
                # this one's, reached before the cycle opened, are the cycle's
                state.autograd_grads = [
                    (t, True, g) for t, _, g in state.autograd_grads if t == task
                ]
        # a side loss's eager backward (during forward) is part of the coming main backward:
        # the results are written and checked when that one ends
        # inside a backward started through the op interception the cycle ends when the
        # outermost one returns (backward_scope); else when the engine's task ends
        if not self._cycle.finish_queued and not in_eager_backward() and not self._backward_depth:
            self._cycle.finish_queued = True
            queue_callback(self._finish)

    def _refuse_mixed_roots(self, roots: tuple[Any, ...]) -> None:
        """A backward from a loss whose values mix the samples (after the last layer: a
        contrastive loss, outputs centred over the batch) has no per-sample parts; refused
        where the results are checked (``check=False``: each sample's contribution through
        the output gradient, which adds up to the batch gradient all the same)."""
        if not self._check:
            return
        reason = next((r for t in roots if (r := self._tracker.mixed(t)) is not None), None)
        if reason is not None:
            raise UnsupportedModelError(
                f"per_sample: this backward's loss mixes the samples ({reason}), so it is not a "
                "sum of per-sample terms and sample n's gradient is not defined: a "
                "contrastive loss over the batch, outputs centred or normalised over the "
                "batch, a softmax over it, rows of the batch paired with other rows (a "
                "preference pair's halves, two views: put a pair's parts in a dimension of "
                "their own, e.g. [N, 2, ...], to make the pair the sample). Per-sample "
                "quantities need a loss whose terms each depend on one sample. "
                "per_sample(..., check=False) gives each sample's "
                "contribution through the output gradient instead (it adds up to p.grad, but "
                "is no sample's own gradient)."
            )

    @contextmanager
    def backward_scope(
        self, passive: bool, accumulates: bool = False, roots: tuple[Any, ...] = ()
    ) -> Iterator[None]:
        """A backward (or autograd.grad) called inside the context. The cycle ends when the
        outermost one returns, so backward passes nested in it (a reentrant checkpoint's) are
        part of it. ``passive``: a pass that is not for the parameters (with respect to inputs
        only, e.g. a gradient penalty, or batched) computes nothing per sample, and ends no
        cycle. ``accumulates``: a backward into ``.grad``; one that computed nothing per sample
        leaves no earlier results (nor does an ``autograd.grad``, unless it differentiates a
        ``create_graph`` backward's results: those stay). ``roots``: the tensors it starts
        from."""
        if self._computing or not self._active:  # our own autograd calls
            yield
            return
        outermost = not self._backward_depth
        if outermost:
            self._cycle_seen = self._cycle.open
            self._params_reached = False
            self._accumulating = accumulates
            if not passive:  # (what an earlier backward's watched uses found is not this one's)
                self._refuse_mixed_roots(roots)
                self._cycle.escaped = {}
                self._cycle.begin_backward(list(roots))
        self._backward_depth += 1
        self._passive += passive
        try:
            yield
        except BaseException:
            self._backward_depth -= 1
            self._passive -= passive
            self._accumulating = self._accumulating and not outermost
            ends = outermost and not passive and not in_eager_backward()
            if ends and self._cycle.open:
                self._abort_cycle()  # the backward is aborted: the next one starts clean
            raise
        self._backward_depth -= 1
        self._passive -= passive
        if not outermost or in_eager_backward():
            return
        self._accumulating = False
        if passive:
            self._cycle.backward_done = self._cycle.backward_done or not self._cycle.open
        elif self._cycle.open:
            self._finish()
        elif not self._cycle_seen and self._params_reached:
            # no quantities for this backward: none of an earlier one (an autograd.grad that
            # differentiates a create_graph backward's results leaves them, for reading)
            if accumulates or not self._cycle.is_differentiating():
                self._cycle.clear_attrs()
            for state in self._states.values():  # (they may hold graphs: not kept)
                state.autograd_grads = []
        self._cycle.differentiating = False

    def _on_param_grad(self, state: ParamState, grad: Tensor | None) -> None:
        if grad is None:  # (an op that reads the parameter's dtype alone: x.to(p), type_as)
            return
        state.hooked_task = task = current_graph_task_id()  # (see _on_accumulated)
        # not while computing: the fallback's own per-sample autograd calls fire it too;
        # recorded before the cycle opens too (autograd may reach a parameter first)
        if self._active and not self._computing:
            self._params_reached = True
            wanted = bool(self._kinds) and not self._passive
            cycle = self._cycle
            clipping = wanted and self._clip is not None and not in_eager_backward()
            if clipping and self._clip.clipped_this_forward and not cycle.open:  # (a penalty's)
                raise UnsupportedModelError(_SECOND_CLIPPED_BACKWARD)
            # (the facade drops a forward's records when another forward follows it; clipping
            # must own every gradient of the model's backward)
            unrecorded = (
                cycle.n is None or cycle.dropped_n is not None or cycle.discarded_forward
                or clipping
            )  # fmt: skip
            if (
                wanted and unrecorded and not cycle.open
                and (not cycle.backward_done or clipping)  # (clipping: after a passive pass)
                and not in_eager_backward()
            ):  # fmt: skip
                # the first backward since the last forward reaches the parameters, and that
                # forward recorded nothing (it ran outside the block), or its records (or those
                # of the forward before it) were dropped: its end then finds their quantities
                # missing and says so (a gradient with no records after a backward, e.g.
                # differentiating create_graph quantities, or of a penalty on the weights is
                # not the model's)
                self._open_cycle()
            # (Variance keeps each total: all_reduce_quantities; clipping owns the gradients)
            handed = state.hand_over(
                grad, cycle.open and self._clip is None and Variance not in self._kinds
            )
            # held where it is read: by the sum check (at the end of backward) and for the
            # result nodes of a create_graph backward; a gradient held until then is one
            # autograd cannot take as .grad: it copies it (twice the gradients' memory)
            read = torch.is_grad_enabled() or (
                bool(self._kinds)
                and (self._check or self._clip is not None or cycle.direct_call is not None)
            )
            state.autograd_grads.append(
                (task, self._cycle.open, grad if read and not handed else None)
            )
            if wanted:
                self._complete_calls_of(state.param)
            # (autograd.grad accumulates nothing; without the interception it cannot be told)
            accumulates = self._accumulating or self._intercept is None
            if clipping and cycle.open and accumulates:
                self._clip.before_accumulate(state)

    def before_grad(self) -> None:
        """An ``autograd.grad`` begins (called by the op interception): see ``after_grad``."""
        if saving_loses_leaf_hooks() and self._active and not self._computing:
            for state in self._states.values():
                state.hooked_task = None

    def after_grad(self, inputs: tuple[Any, ...], results: tuple[Tensor | None, ...]) -> None:
        """An ``autograd.grad`` returned ``results`` for ``inputs`` (called by the op
        interception). On a torch that loses a saved parameter's hooks, a tracked parameter
        that got a gradient without its hook running is refused (``_on_accumulated`` tells it
        for ``.backward()``; this call accumulates nothing)."""
        if not saving_loses_leaf_hooks() or not self._active or self._computing:
            return
        if in_eager_backward():  # (a side loss's eager pass suspends the hooks itself)
            return
        for t, g in zip(inputs, results, strict=False):
            state = self._states.get(t) if self.tracks(t) else None
            if state is not None and g is not None and state.hooked_task is None:
                self._refuse_lost_hooks(state)

    def _refuse_lost_hooks(self, state: ParamState) -> None:
        if self._check or self._clip is not None:
            raise UnsupportedModelError(
                f"per_sample: torch {torch.__version__} lost the hooks leanprop put on "
                f"'{state.name}': an autograd Function of the model saves this parameter "
                "(ctx.save_for_backward) while saved-tensor hooks are in effect (a "
                "non-reentrant checkpoint, save_on_cpu), and this torch then never calls them: "
                "leanprop cannot check its per-sample quantities against its gradient, nor "
                "clip it. Save a view of it instead (p.view_as(p), made under "
                "torch.enable_grad()), run without those saved-tensor hooks, or use a newer "
                "torch (2.13 keeps them); check=False takes its quantities unchecked."
            )

    def _on_accumulated(self, state: ParamState, p: nn.Parameter) -> None:
        hooked, state.hooked_task = state.hooked_task, None
        if hooked != current_graph_task_id() and self._active and not self._computing:
            self._refuse_lost_hooks(state)  # (the hook before did not run)
        if self._active and self._clip is not None:
            self._clip.after_accumulate(state)

    def _complete_calls_of(self, p: nn.Parameter) -> None:
        """``p``'s gradient is computed, so every call that uses it has had all the output
        gradients it will get: complete those still waiting for others (which count as zero)
        now, while ``p`` still has its forward value (an optimizer stepping in backward, e.g.
        InBackward, changes it right after), not at the end of backward."""
        for call in self._cycle.calls:
            if (
                not call.closed
                and any(g is not None for g in call.grads)
                and any(q is p for q in call.params.values())
            ):
                self._process(call)

    def _on_base_grad(self, call: Call, index: int, shape: torch.Size, grad: Tensor) -> None:
        self._on_output_grad(call, index, grad.view(shape))

    def _on_output_grad(self, call: Call, index: int, grad: Tensor) -> None:
        if not self._active or not self._kinds or self._computing or self._passive:
            return
        cycle = self._cycle
        if cycle.is_differentiating():  # (of a create_graph backward's results: not the model's)
            return
        if call.closed:
            # (a sink a create_graph backward closed: this backward is another through the
            # forward, the BackPACK facade's, which reopens none)
            forward = call.forward
            if forward is not None and (not forward.closed or forward in cycle.graph_closed):
                raise UnsupportedModelError(
                    f"per_sample: a second backward through the same forward reached "
                    f"{type(call.site.module).__name__} '{call.site.name}', whose inputs "
                    "leanprop keeps for one backward only (a module hooked as a whole: "
                    "RNNs, convolutions with a padding_mode other than 'zeros'; any layer "
                    "in the BackPACK facade or in a per_sample context nested in another). "
                    "Run the "
                    "forward again before each backward (leanprop.ggn: call it before "
                    "loss.backward(); BackPACK facade: backpack(..., retain_graph=True))."
                )
            return
        self._open_cycle()
        call.grads[index] = grad
        call.pending -= 1
        if call.pending == 0:
            self._process(call)

    def _process(self, call: Call) -> dict[str, Tensor]:
        with self.own_work():
            return self.compute_call(call)

    def compute_call(self, call: Call) -> dict[str, Tensor]:
        """The call's quantities (``compute.py``) and its summed gradients, inside
        :meth:`own_work` (a replaced op's backward runs there whole)."""
        call.closed = True
        try:
            self._cycle.from_forward(call.forward)
            return compute(call, self._work())
        except BaseException:
            self._abort_cycle()  # the backward is aborted: the next one starts clean
            raise
        finally:
            if self._cycle.keep_calls:  # for the next backward through this forward
                call.grads = [None] * len(call.grads)
            else:
                call.args = call.kwargs = None
                call.grads = []

    def _budget(self, device: torch.device) -> int:
        """Scratch bytes per layer: as given, else 16 MiB on CPU (small chunks stay in cache
        and run as fast) and 64 MiB on accelerators (fewer, larger kernels)."""
        mib = self._workspace_mib
        if mib is None:
            mib = DEFAULT_WORKSPACE_MIB.get(device.type, 64.0)
        return int(mib * 2**20)

    def _options(self, device: torch.device) -> RuleOptions:
        key = (device, self.conv_algorithm, self._workspace_mib)  # (made once: every call asks)
        options = self._options_made.get(key)
        if options is None:
            options = self._options_made[key] = RuleOptions(key[1], self._budget(device))
        return options

    def _work(self) -> Work:
        """The computation of a call's view of this context (``compute.py``): made again
        where what it holds changed (the quantities computed, whether sums go into ``.grad``),
        else the one made for an earlier call."""
        work, sums_wanted = self._work_made, self._sums_wanted()
        if (
            work is None
            or work.kinds is not self._kinds
            or work.sums_wanted != sums_wanted
            or work.clipping != (self._clip is not None)
            or work.scratch is not self._cycle.scratch
        ):
            # (the options through a weak binding: a Work kept here makes no cycle)
            work = self._work_made = Work(
                self._kinds, self._states, self._clip is not None, sums_wanted,
                self._observers, self._cycle.scratch, _Weakly(self._options),
            )  # fmt: skip
        return work

    def _watch_results(self, nodes: list[Any]) -> None:
        """Hook the nodes of a create_graph backward's results: a later backward that reaches
        one differentiates them (see ``Cycle.graph_closed``). The hooks live with the nodes and
        hold this context weakly."""
        ref = weakref.ref(self)

        def reached(grad_outputs: tuple[Tensor | None, ...]) -> None:
            capture = ref()
            if capture is not None and capture._active and not capture._computing:
                capture._cycle.differentiates_results()

        for node in nodes:
            node.register_prehook(reached)

    def _finish(self) -> None:
        """End of the backward pass: complete partial calls, write and check the results."""
        n = self._cycle.n
        if self._cycle.is_differentiating():  # (it differentiates a create_graph backward's
            # results, and also reached the model's forward: per sample, neither is defined)
            self._computing_here = False
            self._cycle.end_backward()
            self._cycle.clear_attrs()
            return
        try:
            check = self._check or self._cycle.direct_call is not None
            clip = None
            if self._clip is not None:
                clip = functools.partial(self._clip.finish, n=n or 0)
            self.last_sums = self._cycle.finish(
                self._asked, check, self._process, self._subsampling, clip
            )
            self.last_n = n
        finally:
            self._computing_here = False

    def forget_forward(self) -> None:
        """Drop the recorded forward (its backward then computes no quantities and says so):
        for work on it that failed midway and left its records unusable."""
        self._abort_cycle()

    def _abort_cycle(self) -> None:
        """Forget everything about the current forward and its backward passes."""
        self._computing_here = False
        self._cycle.abort()
        if self._clip is not None:
            self._clip.abort()
