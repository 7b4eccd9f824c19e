""":class:`BatchTracker`: where the batch is in each tensor of the current forward (held
weakly), which tensors derive from the parameters alone, and which mix the samples. The op
interception calls :meth:`BatchTracker.propagate` on every op."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from ..._torch_compat import (
    current_graph_task_id,
    detaching_checkpoint_inputs,
    saved_tensor_hooks_in_effect,
    through_reentrant_checkpoint,
)
from .indexing import assigned_result, base_result
from .infos import (
    MAY_MIX,
    REORDERED,
    BatchDim,
    Combined,
    Grouped,
    Info,
    Lost,
    Packed,
    Reordered,
    Selected,
)
from .mixing import (
    SIDE_BY_SIDE,
    holds_samples,
    merge_infos,
    mixes_itself,
    mixes_unplaced,
    mixing_by_joining,
    reads_summed,
)
from .order import ORDER_OPS, by_value, ordered_result, reorders
from .rules import (
    CONCATENATED,
    CURVED_ELEMENTWISE,
    FACTORIES,
    NON_TENSOR,
    ONE_OUTPUT_EACH,
    POINTWISE_LOSSES,
    REJOINED,
    combines,
    in_place,
    op_name,
    result_dim,
)
from .spread import MOVED, grouped_result, joined, read, replayed, selected_result
from .unknown import STRIDED_LOST, STRIDED_VIEWS


@dataclass(frozen=True, eq=False)
class ThroughCopies:
    """Where a vector-Jacobian product from a derived tensor to its parameters goes when the
    tensor was computed inside a reentrant checkpoint's recomputation from detached copies of
    the block's inputs (T5's position bias, masked in each later block): ``tensor``'s graph
    ends at each of ``copies`` (and at the parameters the block reads itself); each copy's part
    goes on from ``sources[i]``, the tensor it was detached from (itself a ``ThroughCopies``
    where that one was computed so, in an outer reentrant checkpoint)."""

    tensor: Tensor
    copies: tuple[Tensor, ...]
    sources: tuple[Tensor | ThroughCopies, ...]


class _ByTensor:
    """A dict keyed by tensor identity that holds its tensors weakly.

    Looked up on every op of the forward, so lighter than ``torch.utils.weak``'s dictionary
    (which builds a weak reference per lookup): the id finds the entry, and the entry's weak
    reference confirms it is still the same tensor (an id reused after a tensor died never
    matches a dead reference)."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, Any]] = {}

    def __setitem__(self, t: Tensor, value: Any) -> None:
        key, d = id(t), self._d

        def drop(ref: weakref.ref, key: int = key) -> None:
            entry = d.get(key)
            if entry is not None and entry[0] is ref:
                del d[key]

        d[key] = (weakref.ref(t, drop), value)

    def get(self, t: Any, default: Any = None) -> Any:
        entry = self._d.get(id(t))
        if entry is None or entry[0]() is not t:
            return default
        return entry[1]

    def __contains__(self, t: Any) -> bool:
        entry = self._d.get(id(t))
        return entry is not None and entry[0]() is t

    def __bool__(self) -> bool:
        return bool(self._d)

    @property
    def ids(self) -> Mapping[int, Any]:
        """The ids of the tensors held (an id of a tensor that died may linger until its
        weak reference's callback runs)."""
        return self._d


class BatchTracker:
    """Where the batch is in each tensor of the current forward, and which tensors derive from
    tracked parameters without carrying the batch.

    Owned by one :class:`~leanprop.per_sample.capture.PerSample`; tensors are held weakly.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = set(params)
        self._param_ids = frozenset(map(id, self.params))  # (held in ``params``: ids stay theirs)
        self.n: int | None = None
        self._info = _ByTensor()  # tensor -> Info
        # tensor -> why its values mix samples, where it requires grad: one sample's values
        # through another's (softmax or flip along the batch, o @ o.T) or joined with a value
        # over all samples (o - o.mean(0)); a loss from one has no per-sample parts
        self._mixed = _ByTensor()
        # the same, found while autograd did not record (the output required no grad): kept
        # for a custom autograd Function's forward, whose outputs it returns with gradients
        # (its own backward); a value computed under no_grad alone stays a constant
        self._mixed_quietly = _ByTensor()
        # tensors computed while autograd did not record from one that may carry gradients
        # (inside a custom Function's forward: what its outputs are made of)
        self._quiet_live = _ByTensor()
        self._quiet = False  # (while an op is followed with autograd not recording)
        self._derived = _ByTensor()  # tensor -> the tracked parameters it derives from
        self._lookups = _ByTensor()  # derived tensor -> Lookup, where it is one
        # derived tensor -> the tensor it was detached from by a reentrant checkpoint's
        # recomputation, or a parameter whose copy it is (see vjp_root); derived tensors
        # computed from such detached copies -> those copies
        self._sources = _ByTensor()
        self._detached = _ByTensor()
        self._from_detached = _ByTensor()
        # kept in the autograd nodes' own metadata (gone with the graph, never held here):
        # where the batch is in each tensor followed while saved-tensor hooks were in effect
        # (see _recover), and in each curved elementwise op's output (the Hessian's residual
        # terms: the output itself is gone by then, its node is not); each under this
        # forward's token
        self._forward = object()
        self._edges_kept = False
        self._ref = weakref.ref(self)
        self._accumulators: dict[nn.Parameter, Any] = {}  # (held for one forward)

    def clear(self) -> None:
        """Forget where the batch is in every tensor (another batch's forward). Tensors
        computed from the parameters alone stay what they are: made before this forward (a
        weight prepared outside the model, a penalty), they are still batch-free."""
        self.n = None
        self._info = _ByTensor()
        self._mixed = _ByTensor()
        self._mixed_quietly = _ByTensor()
        self._quiet_live = _ByTensor()
        self._forward = object()
        self._edges_kept = False
        self._accumulators = {}

    def curved(self, node: Any) -> Info | None:
        """Where the batch is in the output of ``node``, the autograd node of a curved
        elementwise op of this forward (None for other nodes)."""
        return self._kept(node, _CURVED).get(0)

    def _kept(self, node: Any, kind: str) -> dict[int, Any]:
        """What this forward keeps of kind ``kind`` in ``node``'s metadata: ``{output_nr:
        value}`` (empty where it keeps nothing)."""
        slot = node.metadata.get(kind, {}).get(id(self))
        return slot[2] if slot is not None and slot[1] is self._forward else {}

    def _keep(self, node: Any, kind: str, output_nr: int, value: Any) -> None:
        """Keep ``value`` in ``node``'s metadata for this forward. One slot per live tracker
        (nested contexts), each holding its latest forward's values only: a node that outlives
        its forward (a parameter's gradient accumulator, held across steps by DDP) keeps no
        more than that."""
        slots = node.metadata.get(kind)
        if slots is None:
            slots = node.metadata[kind] = {}
        slot = slots.get(id(self))
        if slot is None or slot[1] is not self._forward or slot[0]() is not self:
            for key in [k for k, (ref, _, _) in slots.items() if ref() is None]:
                del slots[key]  # (a tracker gone: its context's exit)
            slot = slots[id(self)] = (self._ref, self._forward, {})
        slot[2][output_nr] = value

    def vjp_root(self, t: Tensor, refuse: Callable[[str], None]) -> Tensor | ThroughCopies:
        """Where a vector-Jacobian product from the derived tensor ``t`` to its parameters
        starts: ``t``; for a copy that a reentrant checkpoint's recomputation detached from
        the forward's (its input), that tensor, which leads to them; for a tensor computed
        inside from such copies, a :class:`ThroughCopies`.

        ``refuse`` gets the reason when ``t`` was computed from a reentrant checkpoint's
        output (its graph back to the parameters is there only in that checkpoint's
        backward): raised by it where quantities are asked."""
        root = self._root(t)
        if self._past_reentrant(root):
            refuse(_PAST_REENTRANT)
        return root

    def _root(self, t: Tensor) -> Tensor | ThroughCopies:
        """:meth:`vjp_root` unchecked (a copy's, when it is detached: it may never be used)."""
        copies = self._from_detached.get(t) if self._from_detached else None
        if copies is not None:
            return ThroughCopies(t, copies, tuple(self._sources.get(c, c) for c in copies))
        return self._sources.get(t, t)

    @staticmethod
    def _past_reentrant(root: Tensor | ThroughCopies) -> bool:
        """Whether a product from ``root`` to its parameters would pass through a reentrant
        checkpoint's node (whose graph back into its block exists only while that
        checkpoint's backward runs: its individual gradients would be taken through the
        checkpoint's own backward, wrongly)."""
        tensors = [root]
        while tensors:
            t = tensors.pop()
            if isinstance(t, ThroughCopies):
                tensors += [t.tensor, *t.sources]
            elif through_reentrant_checkpoint(t):
                return True
        return False

    def lookup(self, t: Any) -> Lookup | None:
        """How ``t`` was computed, if it is rows of one tracked parameter looked up with
        batch-free indices (a position embedding)."""
        return self._lookups.get(t) if isinstance(t, Tensor) else None

    def mark(self, t: Tensor, info: Info) -> None:
        self._info[t] = info

    def mixed(self, t: Any) -> str | None:
        """Why ``t``'s values mix samples (see ``_record``), or None: a loss computed from such
        values is no sum of per-sample terms."""
        return self._mixing(t) if isinstance(t, Tensor) else None

    def _mixing(self, t: Tensor) -> str | None:
        """Why ``t`` mixes samples: found where autograd recorded, or while it did not inside a
        custom autograd Function's forward that returned ``t`` (or, while it still does not,
        an earlier op of that forward)."""
        reason = self._mixed.get(t)
        if reason is not None or not self._mixed_quietly:
            return reason
        reason = self._mixed_quietly.get(t)
        if reason is not None and (self._quiet or _from_custom_function(t)):
            return reason
        return None

    def _live(self, t: Tensor) -> bool:
        """Whether ``t`` may carry gradients to the loss: it requires grad, or, while autograd
        does not record, it was computed from one that does (a custom Function's forward may
        return it; a detached statistic stays a constant)."""
        return t.requires_grad or (self._quiet and t in self._quiet_live)

    def info(self, t: Any) -> Info | None:
        """Where ``t`` carries the batch; None if it does not (or is not a tensor)."""
        if not isinstance(t, Tensor):
            return None
        info = self._info.get(t)
        if info is None and self._edges_kept and self._may_recover(t):
            info = self._info.get(t)
        return info

    def _may_recover(self, t: Tensor) -> bool:
        """:meth:`_recover` ``t``, unless it is known to carry no batch (a parameter, or a
        tensor computed from parameters alone)."""
        return t not in self.params and t not in self._derived and self._recover(t)

    def _recover(self, t: Tensor) -> bool:
        """Follow ``t``, a tensor that a checkpoint's recomputation got from its saved inputs,
        as the tensor of the recorded forward that was saved: True where it is one.

        Saved-tensor hooks that copy what they save (``save_on_cpu``, activation offloading)
        hand a checkpoint's recomputation copies of its inputs, not the tensors followed in
        the forward. A copy keeps the original's place in the graph (its autograd node and
        output number; a leaf's gradient accumulator), by which it is found here: only inside
        a backward, where the recomputations run."""
        if not t.requires_grad or current_graph_task_id() == -1:
            return False
        node = self._edge_node(t)
        found = None if node is None else self._kept(node, _EDGES).get(t.output_nr)
        if found is None:
            return False
        if isinstance(found, frozenset):
            self._derived[t] = found
            p = next(iter(found))
            if len(found) == 1 and p.requires_grad and self._edge_node(p) is node:
                self._sources[t] = p  # (a parameter's copy: its individual gradients are its
                # own; not a leaf the model detached from it, which leads to no parameter)
        else:
            self._info[t] = found
        return True

    def _copies_in(self, t: Tensor) -> tuple[Tensor, ...]:
        """The reentrant checkpoints' detached copies ``t`` is, or is computed from, that
        carry a gradient (a copy of a value without one leads to no parameter)."""
        if t in self._detached:
            return (t,) if t.requires_grad else ()
        return self._from_detached.get(t, ())

    def _edge_node(self, t: Tensor) -> Any:
        """The autograd node where ``t``'s gradient goes: its ``grad_fn``, or a leaf's gradient
        accumulator (a tracked parameter's looked up once per forward; None for a view made
        without autograd, which has neither of its own)."""
        if t.grad_fn is not None:
            return t.grad_fn
        if not t.requires_grad or t._is_view():
            return None
        if t in self.params:
            node = self._accumulators.get(t)
            if node is None:
                node = self._accumulators[t] = get_gradient_edge(t).node
            return node
        return get_gradient_edge(t).node

    def _derived_input(self, t: Tensor, by_edge: bool) -> frozenset[nn.Parameter]:
        params = self.derived_params(t)
        if by_edge and params:
            self._remember_edge(t, params)
        return params

    def _remember_edge(self, t: Tensor, found: Info | frozenset[nn.Parameter]) -> None:
        """Keep where ``t``'s batch is in its autograd node, for :meth:`_recover` (while
        saved-tensor hooks are in effect)."""
        node = self._edge_node(t)
        if node is not None:
            self._keep(node, _EDGES, t.output_nr, found)
            self._edges_kept = True

    def derived_params(self, t: Any) -> frozenset[nn.Parameter]:
        """Tracked parameters a batch-free tensor derives from (empty if none or batched)."""
        if not isinstance(t, Tensor):
            return frozenset()
        if t in self.params:
            return frozenset({t})
        found = self._derived.get(t)
        if found is None and self._edges_kept and self._recover(t):
            found = self._derived.get(t)
        return frozenset() if found is None else found

    def mark_derived(self, t: Tensor, params: frozenset[nn.Parameter]) -> None:
        self._derived[t] = params

    def involved(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether any input may be tracked (a fast check before the op runs, on every op of
        the forward: by ids alone, so a dead tensor's id reused may answer yes, and the op
        then takes the careful way)."""
        info, derived, params = self._info.ids, self._derived.ids, self._param_ids
        for a in (*args, *kwargs.values()) if kwargs else args:
            for t in a if isinstance(a, list | tuple) else (a,):
                if not isinstance(t, Tensor):
                    continue
                i = id(t)
                if i in info or i in derived or i in params:
                    return True
                if self._edges_kept and self._may_recover(t):
                    return True
        return False

    def escaping(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> list[tuple[tuple[int | str, ...], frozenset[nn.Parameter]]]:
        """The operands of an op computed from tracked parameters alone, needing gradients,
        that it joins with values in which the samples were combined (every batched operand
        :class:`Combined`; see ``escapes.py``), with their parameters. Each is named by its
        place: ``(position,)``, ``(keyword,)``, or ``(position, index)`` in a list argument
        (``torch.stack([loss, penalty])``)."""
        batch_free: list[tuple[tuple[int | str, ...], Tensor]] = []
        combined = False
        for key, v in (*enumerate(args), *kwargs.items()):
            if isinstance(v, Tensor):
                items: Iterable[tuple[tuple[int | str, ...], Any]] = (((key,), v),)
            elif isinstance(v, list | tuple):
                items = (((key, j), t) for j, t in enumerate(v))
            else:
                continue
            for place, t in items:
                if not isinstance(t, Tensor):
                    continue
                info = self._info.get(t)
                if info is None:
                    batch_free.append((place, t))
                elif not isinstance(info, Combined):  # (the op meets the batch itself: on
                    return []  # the hot path of every forward, left at the first one)
                else:
                    combined = True
        if not combined:
            return []
        return [
            (place, params)
            for place, t in batch_free
            if t.requires_grad and (params := self.derived_params(t))
        ]

    def propagate(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, replay: bool = False
    ) -> None:
        """Record where the batch went in the outputs of ``func(*args, **kwargs) -> out``.

        ``replay``: the op runs again in a non-reentrant checkpoint's recomputation, whose
        graph no backward goes through: nothing is kept in its nodes."""
        name = op_name(func)
        if name in NON_TENSOR or name in FACTORIES:
            return
        if name == "setitem":
            self._assigned(args)
            return
        outs = _tensor_outputs(out)
        if not outs:
            return
        if "tensors" in kwargs and (name in SIDE_BY_SIDE or name == "linalg_multi_dot"):
            # (torch.cat(tensors=[...], dim=1), linalg.multi_dot(tensors=[...]))
            args = (kwargs["tensors"], *args)
            kwargs = {k: v for k, v in kwargs.items() if k != "tensors"}
        batched: list[tuple[int | str, Tensor, Info]] = []
        derived: set[nn.Parameter] = set()
        copies: dict[int, Tensor] = {}  # (reentrant checkpoints' detached copies, by id)
        # (a checkpoint's saved inputs may come back as copies: see _recover(). Kept while
        # saved-tensor hooks other than a checkpoint's own are in effect, for the op's tensors
        # too: such a hook that copies what it saves reads the tensor with an op. Not inside a
        # checkpointed block, where they would cost every checkpointed model and serve a
        # checkpoint nested in it only; nor in a replay, whose graph no backward frees)
        by_edge = not replay and saved_tensor_hooks_in_effect() == "other"
        for i, a in enumerate(args):
            for j, t in enumerate(a if isinstance(a, list | tuple) else (a,)):
                if not isinstance(t, Tensor):
                    continue
                info = self.info(t)
                if info is not None:  # a list's j-th tensor counts as argument i + j (einsum)
                    batched.append((i + j, t, info))
                else:
                    derived |= self._derived_input(t, by_edge)
                    if self._detached:
                        copies.update((id(c), c) for c in self._copies_in(t))
                    continue
                if by_edge:
                    self._remember_edge(t, info)
        for key, v in kwargs.items():
            if isinstance(v, list | tuple) and any(self.info(e) is not None for e in v):
                # (tensors that carry the batch in a list passed by keyword: in no place a
                # rule reads; the op is taken to mix them)
                unplaced = Lost(f"'{name}' of tensors passed by keyword ({key}=): it {MAY_MIX}")
                for o in outs:
                    self._info[o] = unplaced
                    self._mixed[o] = unplaced.reason
                return
            if isinstance(v, Tensor):
                info = self.info(v)
                if info is not None:
                    batched.append((_position_of(key), v, info))
                    if by_edge:
                        self._remember_edge(v, info)
                else:
                    derived |= self._derived_input(v, by_edge)
                    if self._detached:
                        copies.update((id(c), c) for c in self._copies_in(v))
        batched = by_value(name, args, kwargs, batched)
        if not batched:
            if derived:
                params = frozenset(derived)
                for o in outs:
                    self._derived[o] = params
                    if by_edge:
                        self._remember_edge(o, params)
                if name == "detach" and detaching_checkpoint_inputs():
                    self._sources[outs[0]] = self._root(args[0])
                    self._detached[outs[0]] = True
                elif copies:  # (one that carries no gradient is a constant: a mask; one that
                    # is a copy itself, b.contiguous(), stays one: holding itself, it would
                    # never be dropped)
                    for o in outs:
                        if o.requires_grad and id(o) not in copies:
                            self._from_detached[o] = tuple(copies.values())
                if name == "embedding" and len(outs) == 1:
                    found = _lookup(args, kwargs, self.params)
                    if found is not None:
                        self._lookups[outs[0]] = found
            return
        writes = _writes(func, kwargs)
        before = self.info(outs[0]) if writes else None
        self._record(name, args, kwargs, outs, batched, by_edge, replay)
        if writes:
            self._written_through_view(outs[0], before)

    def _assigned(self, args: Sequence[Any]) -> None:
        """``dest[index] = value`` (``Tensor.__setitem__``, which returns nothing). Where
        ``value`` carries the batch: a ``dest`` that carried none carries it where the value's
        lands (see ``assigned_result``); one that did keeps it only where the value's lands in
        the same place (another sample's values, a batch mean, or samples along another
        dimension written into each sample's: lost); one computed from parameters alone is
        lost (its parameters' contributions would not be taken). Where ``value`` is computed
        from parameters alone, a ``dest`` that carried nothing derives from them too."""
        if len(args) < 3 or not isinstance(args[0], Tensor) or not isinstance(args[2], Tensor):
            return
        dest, value = args[0], args[2]
        info, had = self.info(value), self.info(dest)
        if info is None:
            params = self.derived_params(value)
            if params and had is None:
                self._derived[dest] = self.derived_params(dest) | params
            return
        landed = assigned_result(args[1], dest, value, info, self)
        if self.derived_params(dest):
            landed = Lost(
                "values that carry the batch written into a tensor computed from parameters "
                "alone (a cls token's copy): write the parameters into the batched tensor "
                "instead (torch.cat([cls.expand(N, -1, -1), h], 1), or h[:, 0] = cls)"
            )
        if had is None or had != landed:
            self._info[dest] = landed if had is None else Lost(
                "values of other samples, or of samples in another place, written into a "
                "tensor that carries the batch"
            )  # fmt: skip
        if not torch.is_grad_enabled() and (value.requires_grad or value in self._quiet_live):
            self._quiet_live[dest] = True  # (written inside a custom Function's forward)
        self._carry_mixing(value, dest)
        self._written_through_view(dest, had)

    def _carry_mixing(self, source: Tensor, dest: Tensor) -> None:
        """``dest`` now holds values of ``source`` (written into it, or into a view of it):
        so it mixes samples where ``source`` does (found while autograd does not record: kept
        so too, for a custom Function's forward that returns ``dest``)."""
        reason = self._mixing(source) or (
            self._mixed_quietly.get(source) if not torch.is_grad_enabled() else None
        )
        if reason is None:
            return
        if torch.is_grad_enabled() and dest.requires_grad:
            self._mixed[dest] = reason
        else:
            self._mixed_quietly[dest] = reason

    def _written_through_view(self, t: Tensor, before: Info | None) -> None:
        """An op wrote values into ``t`` in place, a view of another tensor, where ``t``'s
        batch was at ``before``: a tensor that carried no batch carries it where ``t``'s lands
        (see ``base_result``); one that did keeps it where it was unless the write moved the
        view's."""
        base = t._base
        info = self.info(t) if base is not None else None
        if info is None:
            return
        self._carry_mixing(t, base)
        had = self.info(base)
        if had is None:
            self._info[base] = base_result(t, base, info)
        elif info != before:
            self._info[base] = Lost(
                "values of other samples, or of samples in another place, written into a view "
                "of a tensor that carries the batch"
            )

    def batched_only(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> list[tuple[int | str, Tensor, Info]] | None:
        """The operands of an op that carry the batch, numbered as :meth:`propagate` numbers
        them, where none of its tensors is a tracked parameter or derives from one (the op
        then uses no parameter: nothing to capture or watch, only where the batch goes, by
        :meth:`propagate_batched`); None where one may (by id: a dead tensor's id reused
        answers None too), or while edges are kept (see :meth:`_recover`): the careful way.

        On every op of the forward: one pass over the operands, by ids first."""
        if self._edges_kept:
            return None
        info_ids, derived, params = self._info.ids, self._derived.ids, self._param_ids
        batched: list[tuple[int | str, Tensor, Info]] = []
        for i, a in enumerate(args):
            for j, t in enumerate(a) if isinstance(a, list | tuple) else ((0, a),):
                if not isinstance(t, Tensor):
                    continue
                key = id(t)
                if key in derived or key in params:
                    return None
                if key in info_ids:
                    info = self._info.get(t)
                    if info is not None:  # (a list's j-th tensor counts as argument i + j)
                        batched.append((i + j, t, info))
        for key, v in kwargs.items():
            if isinstance(v, list | tuple) and any(isinstance(t, Tensor) for t in v):
                return None  # (torch.cat(tensors=[...]): the careful way reads them)
            if isinstance(v, Tensor) and (id(v) in derived or id(v) in params):
                return None
            if isinstance(v, Tensor) and id(v) in info_ids:
                info = self._info.get(v)
                if info is not None:
                    batched.append((_position_of(key), v, info))
        return batched

    def propagate_batched(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any,
        batched: list[tuple[int | str, Tensor, Info]], replay: bool,
    ) -> None:  # fmt: skip
        """:meth:`propagate` for an op whose operands carrying the batch are ``batched`` (from
        :meth:`batched_only`: no operand derives from a parameter): the same result, without
        looking at the operands again. Where saved-tensor hooks other than a checkpoint's are
        in effect (edges are kept for the tensors): :meth:`propagate`."""
        if not replay and saved_tensor_hooks_in_effect() == "other":
            self.propagate(func, args, kwargs, out, replay)
            return
        name = op_name(func)
        if name in NON_TENSOR or name in FACTORIES:
            return
        if name == "setitem":
            self._assigned(args)
            return
        outs = _tensor_outputs(out)
        batched = by_value(name, args, kwargs, batched) if outs else []
        if batched:
            writes = _writes(func, kwargs)
            before = self.info(outs[0]) if writes else None
            self._record(name, args, kwargs, outs, batched, False, replay)
            if writes:
                self._written_through_view(outs[0], before)

    def _record(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], outs: list[Tensor],
        batched: list[tuple[int | str, Tensor, Info]], by_edge: bool, replay: bool,
    ) -> None:  # fmt: skip
        """Where the batch of the operands ``batched`` (position or keyword, tensor, info)
        went in each of the op's tensor outputs ``outs``: recorded."""
        self._quiet = not torch.is_grad_enabled()
        try:
            self._record_op(name, args, kwargs, outs, batched, by_edge, replay)
        finally:
            self._quiet = False

    def _record_op(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], outs: list[Tensor],
        batched: list[tuple[int | str, Tensor, Info]], by_edge: bool, replay: bool,
    ) -> None:  # fmt: skip
        """:meth:`_record` (``self._quiet`` set for it)."""
        n = self.n if self.n is not None else 0
        if self._quiet and any(self._live(t) for _, t, _ in batched):
            for o in outs:
                self._quiet_live[o] = True
        # (picks put together: cat([o[:2], o[2:]]) holds the batch again, in order; a pair's
        # halves side by side, stack([l[:k], l[k:]], 1), its samples over two dimensions)
        parts = None
        if name in SIDE_BY_SIDE and any(
            type(info) in (Selected, Grouped) for _, _, info in batched
        ):
            try:
                ids = joined(name, args, kwargs, batched)
                parts = read(ids, REJOINED, n) if ids is not None else None
            except _UNREADABLE:
                parts = None
        every = batched
        for k, o in enumerate(outs):
            if name in ONE_OUTPUT_EACH and len(outs) > 1:  # (atleast_2d(a, b): output k is
                batched = [b for b in every if b[0] == k]  # input k's alone)
            results, constants = set(), None  # (constants: batch statistics without grad)
            held = set()  # (what became of the operands that hold samples: held differently,
            # their samples meet; and why the output mixes them: an operand's history first)
            mixing = self._mixed_before(batched) if self._mixed or self._mixed_quietly else None
            # (an operand that requires grad concatenated with others along the batch)
            joined_rows = False
            for i, t, info in () if parts is not None else batched:
                if type(info) is BatchDim and not (
                    info.inner == 1
                    and name in ORDER_OPS
                    and reorders(name, args, kwargs, t, info.dim)
                ):  # (the batch in a dimension, kept in order: most operands of a forward)
                    try:
                        r = result_dim(name, args, kwargs, i, t, info, o, k, n, self)
                    except _UNREADABLE:
                        r = Lost(f"'{name}' with arguments leanprop cannot read: it {MAY_MIX}")
                    if type(r) is Lost:  # (a moving op that loses it: o.repeat(2, 1))
                        r = replayed(name, args, kwargs, i, t, info, o, k, MOVED, n) or r
                    if type(r) is not BatchDim and self._live(t):
                        mixing = mixing or mixes_itself(name, i, info, r, o)
                        joined_rows = joined_rows or _joins(r)
                else:
                    r, mixes, concatenated = self._operand_result(
                        name, args, kwargs, i, t, info, o, k, n, batched
                    )
                    mixing = mixing or mixes
                    joined_rows = joined_rows or concatenated
                if type(r) is Combined and not self._live(t) and (o.requires_grad or self._quiet):
                    constants = {r}  # (o - o.mean(0).detach(): still each sample's values)
                else:
                    results.add(r)
                at = info if isinstance(r, Combined) else r  # (a reduction: as they came)
                lined_up = not isinstance(r, Combined) or name in POINTWISE_LOSSES
                if holds_samples(at) and (
                    self._live(t) or (type(at) is not Selected and lined_up)
                ):  # (without grad too: another sample's data where the op lines it up with
                    # these, h * x.flip(0), mse_loss(h, y.flip(0)); not a pick of them, a
                    # detached partner: SimSiam's; nor a reduction's operands, compared as
                    # they came: ctc_loss's targets)
                    held.add(at)
            results = results or constants or {parts}
            if (
                name in SIDE_BY_SIDE
                and len(results) > 1
                and all(type(r) is Selected for r in results)
            ):  # (cat([o[:k], o[k:]]): each value still one sample's, in no known place)
                results = {Lost(REJOINED)}
            res = results.pop() if len(results) == 1 else merge_infos(results)
            self._info[o] = res
            if o.requires_grad or self._quiet:
                # (one operand mixes nothing by meeting: only an op of its own or its history)
                if mixing is None and len(batched) > 1:
                    mixing = mixing_by_joining(name, batched, res, held, self._live)
                if mixing is None and joined_rows:  # (SimCLR's cat([z1, z2]), then z @ z.T)
                    mixing = (
                        "rows of the batch concatenated with other rows along it: what "
                        "follows would take them for samples of one batch"
                    )
                if mixing is not None and not self._quiet:
                    self._mixed[o] = mixing
                elif mixing is not None:
                    self._mixed_quietly[o] = mixing
            if by_edge:
                self._remember_edge(o, res)
            if name in CURVED_ELEMENTWISE and o.grad_fn is not None and not replay:
                self._keep(o.grad_fn, _CURVED, 0, res)

    def _operand_result(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str,
        t: Tensor, info: Info, o: Tensor, k: int, n: int,
        batched: list[tuple[int | str, Tensor, Info]],
    ) -> tuple[Info, str | None, bool]:  # fmt: skip
        """Where operand ``which`` (``t``, its batch at ``info``: other than in a dimension
        the op keeps in order, which :meth:`_record` follows itself) puts the batch in output
        ``k`` (``o``); why the op mixes that operand's samples (None where it does not, or
        ``t`` requires no grad); and whether it concatenates them with other rows along the
        batch."""
        grad = self._live(t)
        try:
            if isinstance(info, BatchDim):  # (an index or a flip along it: an order)
                info = Reordered(REORDERED, info.dim, tuple(range(t.shape[info.dim])))
            if isinstance(info, Reordered | Packed):
                r = ordered_result(name, args, kwargs, which, t, info, o, k, n, self)
                if not grad or not isinstance(info, Reordered) or type(r) is BatchDim:
                    return r, None, False
                return r, mixes_itself(name, which, BatchDim(info.dim), r, o), _joins(r)
            if type(info) is Selected and info.dim is not None:  # (as a batch of them)
                r, raw = selected_result(name, args, kwargs, which, t, info, o, k, self)
                if not grad or raw is None or type(raw) is BatchDim:
                    return r, None, False
                return r, mixes_itself(name, which, BatchDim(info.dim), raw, o), _joins(raw)
            if type(info) is Grouped:  # (dimension by dimension)
                r, each = grouped_result(name, args, kwargs, which, t, info, o, k, self)
                reasons = (
                    mixes_itself(name, which, bd, r_d, o)
                    for bd, r_d in each
                    if grad and type(r_d) is not BatchDim
                )
                return r, next((m for m in reasons if m is not None), None), False
            if name in STRIDED_VIEWS and type(info) is Selected:  # (one sample's: read by
                # its layout, which may reach the others)
                r = replayed(name, args, kwargs, which, t, info, o, k, info.reason, n)
                return r or Lost(STRIDED_LOST), None, False
            return self._lost_result(name, args, kwargs, which, t, info, batched)
        except _UNREADABLE:
            r = Lost(f"'{name}' with arguments leanprop cannot read: it {MAY_MIX}")
            return r, (r.reason if grad else None), False

    def _lost_result(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str,
        t: Tensor, info: Lost, batched: list[tuple[int | str, Tensor, Info]],
    ) -> tuple[Info, str | None, bool]:  # fmt: skip
        """:meth:`_operand_result` for an operand whose samples are in no known place: summed
        together by a reduction over everything, else as they are. Mixing where a non-linear
        op reads a value summed over the samples, or an op acting along some dimension reads
        samples whose places leanprop cannot tell."""
        combined = combines(name, args, kwargs) and not isinstance(info, Combined)
        picked = isinstance(info, Selected) or getattr(info, "of_pick", False)
        r = Combined(f"'{name}' over {info.reason}", of_pick=picked) if combined else info
        if type(r) is Combined and r.summed and not r.of_pick and t.numel() == 1:
            r = Combined(r.reason, summed=False)  # (made of totals: stack([l1, l2]))
        if not self._live(t):
            return r, None, False
        if type(info) is Combined and info.summed and t.numel() > 1:
            return r, reads_summed(name, which, info, batched), False
        return r, mixes_unplaced(name, info, t.numel()), False

    def _mixed_before(self, batched: list[tuple[int | str, Tensor, Info]]) -> str | None:
        """Why one of the operands ``batched`` mixes samples already (None where none does)."""
        for _, t, _ in batched:
            reason = self._mixing(t)
            if reason is not None:
                return reason
        return None

    def propagate_layer(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Tensor, replay: bool
    ) -> Info | None:
        """:meth:`propagate` for a layer's op whose one batched operand is its input
        ``args[0]`` (a replaced op's: ``fused.py``; its other operands are the layer's
        parameters): the same result, without going through every operand (a few µs per layer
        and step). Anything else (another batched operand, saved-tensor hooks that copy):
        :meth:`propagate`. Returns where the batch is in ``out``."""
        x, info = args[0], self._info.get(args[0]) if isinstance(args[0], Tensor) else None
        others = (*args[1:], *kwargs.values())
        if (
            not isinstance(info, BatchDim)
            or any(self._info.get(t) is not None for t in others if isinstance(t, Tensor))
            or (not replay and saved_tensor_hooks_in_effect() == "other")
        ):
            self.propagate(func, args, kwargs, out, replay)
            return self.info(out)
        name = op_name(func)
        try:
            res = result_dim(name, args, kwargs, 0, x, info, out, 0, self.n or 0, self)
        except (IndexError, TypeError, ValueError, KeyError):
            res = Lost(f"'{name}' with arguments leanprop cannot read: it {MAY_MIX}")
        self._info[out] = res
        return res


def _position_of(key: str) -> int | str:
    """An operand passed by keyword, numbered by position where torch's signatures put it
    first (``input``, ``self``: the data, ``torch.renorm(input=o, ...)``), so that the rules
    and the mixing checks read it as passed by position."""
    return 0 if key in ("input", "self") else key


# what an op's arguments may raise where leanprop reads them other than the op does
_PAST_REENTRANT = (
    "per_sample: a tensor computed from parameters alone meets the batch after passing "
    "through checkpoint(use_reentrant=True): the checkpointed function returned it, or "
    "something it was computed from (a position bias made in the first block or passed "
    "through each, as HF T5's blocks return it). Its graph back to the parameters is "
    "recomputed only when that checkpoint's backward runs, so leanprop cannot take its "
    "parameters' per-sample gradients through it. Use use_reentrant=False, or compute the "
    "tensor outside the checkpoints and pass it to each without returning it."
)
_UNREADABLE = (IndexError, TypeError, ValueError, KeyError, RuntimeError, ZeroDivisionError)


def _joins(r: Info) -> bool:
    """Whether an operand's result ``r`` says it was concatenated with others along the
    batch."""
    return type(r) is Lost and r.reason == CONCATENATED


# the keys of what a tracker keeps in an autograd node's metadata (see BatchTracker._keep)
_EDGES, _CURVED = "leanprop.batch_of_outputs", "leanprop.curved_output"


@dataclass(frozen=True, eq=False)
class Lookup:
    """``F.embedding(ids, weight, padding_idx)``: rows of a parameter at batch-free ``ids``."""

    ids: Tensor
    weight: nn.Parameter
    padding_idx: int | None


def _lookup(args: Sequence[Any], kwargs: dict[str, Any], params: set) -> Lookup | None:
    """``F.embedding``'s call as a :class:`Lookup` (None where its gradient is not a plain
    scatter of rows: scaled by frequency, or sparse)."""
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq")
    bound = dict(zip(names, args, strict=False)) | kwargs
    ids, weight = bound.get("input"), bound.get("weight")
    if not isinstance(ids, Tensor) or weight not in params or ids.is_floating_point():
        return None
    if bound.get("scale_grad_by_freq") or bound.get("sparse") or weight.dim() != 2:
        return None
    padding = bound.get("padding_idx")
    if padding is not None and padding < 0:
        padding += weight.shape[0]
    return Lookup(ids, weight, padding)


def _writes(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` writes into its first argument in place (``x.copy_(y)``, ``x += y``)
    or into ``out=``."""
    return in_place(func) or "out" in kwargs


def _tensor_outputs(out: Any) -> list[Tensor]:
    """An op's tensor outputs, flattened."""
    return [out] if isinstance(out, Tensor) else [o for o in _flat(out) if isinstance(o, Tensor)]


def _flat(out: Any) -> list[Any]:
    if isinstance(out, list | tuple):
        return [y for x in out for y in _flat(x)]
    return [out]


def _from_custom_function(t: Tensor) -> bool:
    """Whether ``t`` is an output of a custom autograd Function (its node is the Function's)."""
    return isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction)
