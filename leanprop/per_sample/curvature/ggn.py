"""The generalized Gauss-Newton matrix (and the Hessian's diagonal) through the per-sample
engine.

One forward recorded by a :func:`leanprop.per_sample` context; the loss's Hessian factor
``V`` ``[M, N, *S]`` (``loss_hessian.py``); then one backward pass through the retained graph
per column ``V[m]``, each computing per-sample quantities with the context's rules: backward
pass m gives each sample's ``J_n^T V[m, n]``, so the GGN's square root, its diagonal
(``sum_{m,n}`` of squares) and each sample's share follow. Any layer the context supports is
covered (closed-form rules, op-level capture, the torch.func fallback), sequences and weight
sharing included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from ..._torch_compat import graph_nodes, is_checkpoint_error, through_reentrant_checkpoint
from ...errors import LeanpropValueError, UnsupportedModelError
from ..capture import PerSample
from ..quantities import ALL_QUANTITIES, BatchGrad, SumGradSquared, subsample
from ..stats import widen
from .batched_columns import (
    add_diagonals,
    column_results,
    covers,
    kronecker_layer,
    linear_layer,
    linear_layers,
    residual_squares,
)
from .contexts import own_work
from .hessian import (
    Curved,
    activation_gradients,
    curved_activations,
    layer_term,
    residual,
    residual_columns,
    unit_columns,
)
from .hessian_products import (
    gradient_functions,
    parameters_snapshot,
    positive_curvature_terms,
    product_functions,
)
from .kfra import kfra_factors
from .kronecker import KroneckerFactors
from .loss_hessian import check_loss, sqrt_hessian
from .quantities import ALL_CURVATURE, KFRA, CurvatureQuantity

T = TypeVar("T")


def validate_curvature(
    quantities: Sequence[object],
) -> dict[int | None, list[CurvatureQuantity]]:
    """The curvature quantities by Monte-Carlo sample count (None: exact); clear errors for
    anything else."""
    allowed = ", ".join(f"{q.__name__}()" for q in ALL_CURVATURE)
    if not quantities:
        raise LeanpropValueError(f"ggn() got no quantity; pass at least one of: {allowed}.")
    by_mc: dict[int | None, list[CurvatureQuantity]] = {}
    for q in quantities:
        if isinstance(q, type):
            raise LeanpropValueError(
                f"ggn() got the class {q.__name__}; pass an instance: {q.__name__}()."
            )
        if not isinstance(q, ALL_CURVATURE):
            raise LeanpropValueError(
                f"ggn() got {q!r} of type {type(q).__name__}; allowed: {allowed} (first-order "
                "quantities go to per_sample(...) and come with loss.backward())."
            )
        by_mc.setdefault(q.mc, []).append(q)
    fields = [q.savefield for q in quantities]
    twice = sorted({f for f in fields if fields.count(f) > 1})
    if twice:
        raise LeanpropValueError(
            f"ggn(): several quantities would store their results in p.{twice[0]}; ask each "
            "once, or give products of one kind different savefield= names (PCHMP("
            "modify='clip', savefield='pchmp_clip'), PCHMP(modify='abs', savefield='pchmp_abs'))."
        )
    if len([mc for mc in by_mc if mc is not None]) > 1:
        raise LeanpropValueError(
            "ggn(): the Monte-Carlo quantities asked for different mc_samples "
            f"({sorted(mc for mc in by_mc if mc is not None)}); they share one draw of "
            "targets: ask for the same mc_samples, or call ggn() once per value."
        )
    return by_mc


def ggn(
    context: PerSample,
    output: Tensor,
    loss_fn: nn.Module,
    target: Tensor,
    *quantities: CurvatureQuantity,
    generator: torch.Generator | None = None,
    create_graph: bool = False,
) -> None:
    """Compute GGN quantities of ``loss_fn(output, target)`` for the context's parameters.

    Call it inside the ``per_sample`` block, after the forward that produced ``output`` and
    before (or instead of) ``loss.backward()``: it runs one backward pass per factor column
    through the retained graph (C for cross-entropy, the output size for MSE and BCE,
    ``mc_samples`` for MC). Each parameter that the output depends on gets the quantities as
    attributes (``diag_ggn_exact``, ...; see :mod:`leanprop.per_sample.curvature.quantities`);
    the others lose those of an earlier call. The passes are ``autograd.grad`` calls: no
    ``.grad`` changes, no hook of an optimizer stepping in backward fires; the context's
    first-order results are left as they were. The output must hold the samples in one
    dimension (the one leanprop followed from the inputs, e.g. ``[T, N, C]`` with
    ``batch_dim=1``).

    Example:
        >>> import torch, leanprop
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        >>> x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
        >>> loss_fn = torch.nn.CrossEntropyLoss()
        >>> with leanprop.per_sample(model, leanprop.BatchGrad()) as ctx:
        ...     out = model(x)
        ...     leanprop.ggn(ctx, out, loss_fn, y, leanprop.DiagGGNExact())
        ...     loss_fn(out, y).backward()
        >>> model[0].weight.diag_ggn_exact.shape
        torch.Size([4, 3])

    Args:
        context: the entered ``per_sample`` context that recorded the forward.
        output: the model output ``[N, ...]`` the loss takes.
        loss_fn: ``nn.CrossEntropyLoss``, ``nn.MSELoss`` or ``nn.BCEWithLogitsLoss``
            (reduction ``"mean"`` or ``"sum"``; see ``loss_hessian.py``).
        target: the loss's targets.
        *quantities: ``DiagGGNExact()``, ``DiagGGNMC(mc_samples)``, ``BatchDiagGGNExact()``,
            ``BatchDiagGGNMC(mc_samples)``, ``SqrtGGNExact()``, ``SqrtGGNMC(mc_samples)``,
            ``GGNMP()``, ``KFLR()``, ``KFAC(mc_samples)``, ``KFRA()`` (chains of linear
            layers: ``kfra.py``), ``DiagHessian()``,
            ``BatchDiagHessian()`` (the Hessian's: ``hessian.py``), ``HMP()``,
            ``PCHMP(modify)`` (products with the Hessian's and the positive-curvature
            Hessian's blocks: ``hessian_products.py``; then run the backward with
            ``retain_graph=True``).
        generator: random numbers of the Monte-Carlo targets.
        create_graph: the quantities as differentiable functions of the parameters (through
            the Jacobians and the loss Hessian's factor; Monte-Carlo draws fixed): the GGN's
            diagonals, square roots, ``GGNMP``, the Kronecker factors (KFLR, KFAC, KFRA)
            and the Hessian's diagonals (through the activations' ``δ`` and ``σ''(z)`` too);
            ``HMP`` and ``PCHMP`` give differentiable products (one more order of
            differentiation). Without it they carry no graph.

    Raises:
        LeanpropValueError: an unknown quantity, a loss or shape not supported, a context
            that is not entered.
        UnsupportedModelError: ``DiagHessian`` of a model whose Hessian has terms besides the
            GGN and the curved activations' (refused before any pass where the graph shows
            them, during the passes for an activation inside a module hooked as a whole);
            curvature through ``torch.utils.checkpoint``; an output whose forward's records
            are gone (a later forward after a backward through it), or what the recorded
            forward would refuse (BatchNorm in training mode).
    """
    by_mc = validate_curvature(quantities)
    if not isinstance(context, PerSample) or not context.active:
        raise LeanpropValueError(
            "ggn() needs the entered per_sample context that recorded the forward: "
            "`with leanprop.per_sample(model, ...) as ctx: out = model(x); leanprop.ggn(ctx, "
            "out, loss_fn, y, ...)`."
        )
    compute_ggn([context], output, loss_fn, target, by_mc, generator, create_graph)


def compute_ggn(
    contexts: Sequence[PerSample],
    output: Tensor,
    loss_fn: nn.Module,
    target: Tensor,
    by_mc: dict[int | None, list[CurvatureQuantity]],
    generator: torch.Generator | None,
    create_graph: bool = False,
) -> None:
    """:func:`ggn` for the parameters of several entered contexts whose forwards ``output``
    depends on (the BackPACK facade: one per extended model); ``by_mc``: the quantities by
    Monte-Carlo sample count (None: exact)."""
    if create_graph and not torch.is_grad_enabled():
        raise LeanpropValueError(
            "leanprop.ggn(create_graph=True) was called with autograd off (torch.no_grad() "
            "or inference mode): the quantities would carry no graph. Call it with "
            "autograd on, or without create_graph."
        )
    # (reading shapes and the graph: work of ours, not ops of the model's to follow)
    with own_work(contexts):
        check_loss(loss_fn, output, target)
        bd = _output_batch_dim(contexts, output)
        # the factor is formed with the samples first, then laid out as the output
        output_front = output.movedim(bd, 0)
        target_front = target.movedim(bd, 0) if target.dim() > bd else target
        # (a reentrant checkpoint's block ran under no_grad: its layers were not recorded,
        # and a pass that skips them would leave their parameters without quantities, unsaid)
        reentrant = through_reentrant_checkpoint(output)
    params = list({p: None for c in contexts for p in c.model.parameters() if p.requires_grad})
    asked = {q.savefield for qs in by_mc.values() for q in qs}
    names = list(dict.fromkeys([*(q.attr for q in ALL_QUANTITIES), *sorted(asked)]))
    saved_attrs = [{a: getattr(p, a) for a in names if hasattr(p, a)} for p in params]
    results: list[dict[str, object]] = [{} for _ in params]
    hessian = [q for q in by_mc.get(None, []) if q.hessian]
    second_order = [q for q in by_mc.get(None, []) if q.second_order]
    recomputed = sum(c.recomputed for c in contexts)

    def refuse_recomputation(cause: BaseException | None = None) -> None:
        checkpointed = (
            cause is not None
            and not isinstance(cause, UnsupportedModelError)
            and is_checkpoint_error(cause)
        )
        if checkpointed or sum(c.recomputed for c in contexts) != recomputed or reentrant:
            for c in contexts:  # (the recomputation left records a backward cannot use)
                c.forget_forward()
            raise UnsupportedModelError(
                "leanprop.ggn: the passes recomputed part of the forward (a checkpoint, "
                "torch.utils.checkpoint): its curvature is not supported through one; run the "
                "forward without checkpointing to compute curvature."
            ) from cause

    if reentrant:
        refuse_recomputation()
    try:
        # (reading what autograd saved: a checkpoint may refuse it, see below)
        curved = curved_activations(contexts, output, params) if hessian else []
        for mc, qs in by_mc.items():
            qs = [q for q in qs if not q.second_order]
            averaged, qs = [q for q in qs if q.averaged], [q for q in qs if not q.averaged]
            if qs or averaged:
                with own_work(contexts):
                    front = sqrt_hessian(
                        loss_fn, output_front, target_front, mc, generator, create_graph
                    )
                    factor = front.movedim(1, bd + 1)
            if averaged:  # KFRA: its own recursion
                for c in contexts:
                    c.raise_pending_refusal()
                at = {id(p): i for i, p in enumerate(params)}
                found = kfra_factors(contexts, output, front, bd, params, create_graph)
                for p, factors in found.items():
                    results[at[id(p)]][KFRA.attr] = factors
            if qs:
                layers, done = None, None
                if covers(qs) and not create_graph:  # (Kronecker factors: of convolutions too)
                    accept = kronecker_layer if all(q.kronecker for q in qs) else linear_layer
                    with own_work(contexts):
                        layers = linear_layers(output.grad_fn, params, accept)
                if layers is not None:  # an MLP (or a CNN): the columns batched
                    for c in contexts:  # (what the passes would refuse)
                        c.raise_pending_refusal()
                    done = _batched(
                        column_results, contexts, output, factor, layers, params, qs, results
                    )
                if done is None:
                    _passes(contexts, output, factor, params, qs, results, create_graph)
        refuse_recomputation()
        loss = None
        if second_order or (curved and hessian):
            # (the BackPACK facade runs this inside a backward, and hooks its loss modules'
            # calls: its forward alone)
            with torch.enable_grad():
                loss = loss_fn.forward(output, target)
        if second_order:  # (HMP: the gradients as functions, while the graph is whole)
            grads = gradient_functions(contexts, loss, params)
            refuse_recomputation()
            snapshot = parameters_snapshot(contexts, params)  # (one for all the products)
            for q in second_order:  # (PCHMP: the Hessian's plus its activations' terms)
                terms = (
                    positive_curvature_terms(contexts, loss, curved, q.modify, create_graph)
                    if q.hessian
                    else ()
                )
                products = product_functions(contexts, params, grads, snapshot, terms, create_graph)
                for i, f in products.items():  # (none where the output does not depend on it)
                    results[i][q.savefield] = f
            refuse_recomputation()
        hessian = [q for q in hessian if not q.second_order]
        if curved and hessian:
            _residual_passes(contexts, loss, curved, params, hessian, results, create_graph)
            refuse_recomputation()
    except RuntimeError as e:  # (torch's own refusals inside a checkpoint's backward, and
        refuse_recomputation(e)  # those of a pass through what a checkpoint recomputed)
        raise
    finally:  # the passes' first-order results are not the loss's: back to what was there
        for p, attrs in zip(params, saved_attrs, strict=True):
            for a in names:
                if a in attrs:
                    setattr(p, a, attrs[a])
                elif hasattr(p, a):
                    delattr(p, a)
    if not any(results) and _depends_on(output, params):
        raise UnsupportedModelError(_NOTHING_FOUND)
    for p, res in zip(params, results, strict=True):
        for attr in asked:  # (a parameter the output does not depend on: none, not stale)
            if attr in res:
                setattr(p, attr, res[attr])
            elif hasattr(p, attr):
                delattr(p, attr)


_NOTHING_FOUND = (
    "leanprop.ggn: the output depends on the context's parameters, but the passes reached "
    "none of their uses: the records of the forward that produced it were dropped (a later "
    "forward started a new cycle after a backward through it), or it was computed outside "
    "the block. Call ggn right after the forward of the output, before the next forward."
)


def _depends_on(output: Tensor, params: list[nn.Parameter]) -> bool:
    """Whether ``output``'s graph reaches the gradient accumulator of one of ``params``."""
    ids = {id(p) for p in params}
    with torch.no_grad():  # (reading the graph only)
        return any(
            id(getattr(node, "variable", None)) in ids for node in graph_nodes([output.grad_fn])
        )


def _output_batch_dim(contexts: Sequence[PerSample], output: Tensor) -> int:
    """Where ``output`` holds the samples, as the contexts followed them from the inputs (the
    loss's factor is per sample: its columns must not mix or split samples)."""
    found = [c.batch_dim_of(output) for c in contexts]
    problems = [f for f in found if isinstance(f, str)]
    dims = {f for f in found if isinstance(f, int)}
    if problems or len(dims) > 1:
        raise LeanpropValueError(
            f"ggn(): the output {tuple(output.shape)} does not hold the samples in one "
            f"dimension ({problems[0] if problems else f'dimensions {sorted(dims)}'}); its "
            "curvature per sample is not defined. Pass the output with the samples in one "
            "dimension (e.g. the logits [N, C], not [N*T, C])."
        )
    if not dims and any(c.batch_dim != 0 for c in contexts):
        raise LeanpropValueError(
            "ggn(): leanprop did not follow the samples to the output (computed outside the "
            "block?), and the model's inputs hold them in dimension "
            f"{contexts[0].batch_dim}: pass the model's output computed inside the block."
        )
    bd = dims.pop() if dims else 0
    n = {c.samples for c in contexts} - {None}
    if bd >= output.dim() or any(output.shape[bd] != k for k in n):
        raise LeanpropValueError(
            f"ggn(): the output {tuple(output.shape)} does not have the forward's "
            f"{sorted(n)} samples in dimension {bd}; pass the model's output for the batch "
            "(the samples in one dimension, e.g. the logits [N, C], not [N*T, C])."
        )
    return bd


def ggn_matrix_product(root: Tensor, mat: Tensor) -> Tensor:
    """``G_pp mat`` for a parameter's GGN block given by its square root ``root``
    ``[M, N, *shape]``; ``mat``: ``[V, *shape]`` (V vectors), returns ``[V, *shape]``."""
    shape = root.shape[2:]
    if mat.shape[1:] != shape:
        raise LeanpropValueError(
            f"ggnmp(mat): mat must be [V, *p.shape] = [V, {', '.join(map(str, shape))}], got "
            f"{tuple(mat.shape)}."
        )
    s = root.flatten(2).flatten(0, 1)  # [M N, P]
    return ((mat.flatten(1) @ s.mT) @ s).reshape(mat.shape)


def _batched(compute: Callable[..., T], *args: Any) -> T | None:
    """``compute(*args)`` of the batched columns (``batched_columns.py``), or None where vmap
    cannot run the backward (an op without a batching rule in this torch): the passes one
    column at a time then give the same values."""
    try:
        return compute(*args)
    except (RuntimeError, NotImplementedError) as e:
        if is_checkpoint_error(e):
            raise
        return None


def _both_signs(
    contexts: Sequence[PerSample], act: Curved, r: Tensor, layers: list[Any]
) -> list[tuple[float, list[Tensor | None]]]:
    """The positive and the negative part of an activation's residual term, batched."""
    return [(sign, residual_squares(contexts, act, r, sign, layers)) for sign in (1.0, -1.0)]


def _refuse_unfactored(
    contexts: Sequence[PerSample], params: list[nn.Parameter], reached: list[bool],
    kron: dict[nn.Parameter, list[Tensor]], name: str,
) -> None:  # fmt: skip
    """Kronecker factors asked for: every parameter the output depends on must have them (as
    BackPACK refuses a module its extension does not cover), not be left without a result."""
    missing = [
        _name_of(contexts, p) for p, r in zip(params, reached, strict=True) if r and p not in kron
    ]
    if missing:
        shown = ", ".join(f"'{k}'" for k in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise UnsupportedModelError(
            f"{name}: {len(missing)} parameter(s) the output depends on are not in an nn.Linear "
            "on [N, in_features] inputs or an nn.Conv1d/2d/3d called as a module, where "
            f"Kronecker factors are defined (as in BackPACK): {shown}. Freeze them "
            "(requires_grad_(False)) to get the factors of the others, or ask for "
            "DiagGGNExact or SqrtGGNExact, which cover every layer."
        )


def _name_of(contexts: Sequence[PerSample], p: nn.Parameter) -> str:
    return next((f"{k}" for c in contexts for k, q in c.model.named_parameters() if q is p), "?")


def _residual_passes(
    contexts: Sequence[PerSample],
    loss: Tensor,
    curved: list[Curved],
    params: list[nn.Parameter],
    quantities: list[CurvatureQuantity],
    results: list[dict[str, object]],
    create_graph: bool = False,
) -> None:
    """Add the curved activations' terms to the Hessian quantities in ``results`` (which hold
    the GGN's): one backward per column of each activation's residual, from its input
    (``create_graph``: as functions of the parameters, through ``δ``, ``σ''(z)`` and the
    passes' Jacobians)."""
    per_sample = any(q.per_sample for q in quantities)
    # (create_graph: each sample's values, weighted by its residual: see unit_columns)
    kind = BatchGrad if per_sample or create_graph else SumGradSquared

    def add(i: int, value: Tensor, sign: float, each: bool = per_sample) -> None:
        """``sign * value`` (each sample's, ``[N, *p.shape]``, with ``each``) to parameter i's
        results."""
        for q in quantities:
            if q.attr in results[i]:
                part = value if q.per_sample or not each else value.sum(0)
                results[i][q.attr] = results[i][q.attr] + sign * part

    with ExitStack() as stack:
        for c in contexts:  # (also for the first pass: without the op interception, as in the
            # BackPACK facade, it cannot be told from the model's backward, and must keep the
            # inputs of modules hooked as a whole for the passes after it)
            stack.enter_context(c.computing(frozenset({kind})))
        with ExitStack() as outputs_only:  # (no parameter's gradient in this pass)
            for c in contexts:
                outputs_only.enter_context(c.for_layer_outputs())
            deltas = activation_gradients(loss, curved, create_graph)
        index = {p: i for i, p in enumerate(params)}
        for act, delta in zip(curved, deltas, strict=True):
            r = residual(act, delta, create_graph)
            if act.layer is not None:  # a closed form: no passes
                for p, value in layer_term(act, r, per_sample).items():
                    if p in index:
                        add(index[p], value, 1.0)
                continue
            batched = act.dim == 0 and r.dim() == 2 and not create_graph
            layers = linear_layers(act.z.node, params) if batched else None
            parts = None
            if layers is not None:  # behind it, linear layers only: its columns at once
                parts = _batched(_both_signs, contexts, act, r, layers)
            if parts is not None:
                with own_work(contexts):
                    for sign, squares in parts:
                        add_diagonals(layers, squares, params, quantities, results, sign)
                continue
            if create_graph:  # (smooth in r: each unit's column, weighted by r after)
                work = ((column, r_k, 1.0) for column, r_k in unit_columns(act, r))
            else:  # (fewer passes: each part's square roots, where they are not zero)
                work = (
                    (column, None, sign)
                    for sign in (1.0, -1.0)
                    for column in residual_columns(act, r, sign)
                )
            for column, weight, sign in work:
                for p in params:  # (a value after the pass is that pass's)
                    if hasattr(p, kind.attr):
                        delattr(p, kind.attr)
                try:
                    reached = torch.autograd.grad(
                        [act.z], params, [column], retain_graph=True,
                        create_graph=create_graph, allow_unused=True,
                    )  # fmt: skip
                except UnsupportedModelError as e:
                    raise UnsupportedModelError(
                        f"DiagHessian: a pass from the input of "
                        f"{type(act.node).__name__} (its term of the Hessian) failed; the "
                        "activation may lie inside a module hooked as a whole (a custom "
                        f"or recurrent module), which such a pass cannot start in: {e}"
                    ) from e
                for i, p in enumerate(params):
                    value = getattr(p, kind.attr, None)
                    if value is None and reached[i] is not None:
                        raise UnsupportedModelError(
                            f"DiagHessian: the curved activation "
                            f"{type(act.node).__name__} lies inside a module hooked as a "
                            f"whole (a custom or recurrent module, or a module with a "
                            f"rule of its own), whose parameters ('{_name_of(contexts, p)}') "
                            "get no per-sample values from a pass starting inside it. Use "
                            "the module's parts (layers with rules, activations) directly, "
                            "or DiagGGNExact."
                        )
                    if value is None:
                        continue
                    if weight is not None:  # r_nk (∂z_nk/∂θ)², each sample's
                        shape = (-1,) + (1,) * (value.dim() - 1)
                        add(i, weight.view(shape) * widen(value).square(), sign, each=True)
                    else:
                        add(i, widen(value).square() if per_sample else value, sign)


def _passes(
    contexts: Sequence[PerSample],
    output: Tensor,
    factor: Tensor,
    params: list[nn.Parameter],
    quantities: list[CurvatureQuantity],
    results: list[dict[str, object]],
    create_graph: bool = False,
) -> None:
    """One backward per column of ``factor`` ``[M, N, *S]``; squares and roots accumulated
    (differentiable with ``create_graph``)."""
    need_batch = any(q.per_sample or q.root or q.product for q in quantities)
    kinds = frozenset({BatchGrad} if need_batch else {SumGradSquared})
    kronecker = [q for q in quantities if q.kronecker]
    factors = KroneckerFactors(type(kronecker[0]).__name__) if kronecker else None
    diag: list[Tensor | None] = [None] * len(params)
    batch_diag: list[Tensor | None] = [None] * len(params)
    roots: list[list[Tensor]] = [[] for _ in params]
    inner = {id(m) for c in contexts for m in list(c.model.modules())[1:]}
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c.computing(kinds))
            if factors is not None and id(c.model) not in inner:  # (each layer seen once)
                stack.enter_context(c.observing(factors.observe))
        for m, column in enumerate(factor):
            if factors is not None:
                factors.next_pass()
            try:  # (autograd.grad: nothing accumulates into .grad, nothing steps an optimizer)
                torch.autograd.grad(
                    output, params, column, retain_graph=True, create_graph=create_graph,
                    allow_unused=True,
                )  # fmt: skip
            except UnsupportedModelError as e:
                raise UnsupportedModelError(
                    f"leanprop.ggn: pass {m + 1} of {factor.shape[0]} (one backward per column "
                    f"of the loss Hessian's factor, through the recorded forward) failed: {e}"
                ) from e
            for i, p in enumerate(params):
                if need_batch:
                    gb = getattr(p, BatchGrad.attr, None)
                    if gb is None:
                        continue
                    sq = widen(gb).square()  # (16-bit individual gradients: in float32)
                    roots[i].append(gb)
                    batch_diag[i] = sq if batch_diag[i] is None else batch_diag[i] + sq
                    summed = sq.sum(0)
                else:
                    summed = getattr(p, SumGradSquared.attr, None)
                    if summed is None:
                        continue
                diag[i] = summed if diag[i] is None else diag[i] + summed
    kron = {} if factors is None else factors.results()
    if factors is not None:
        _refuse_unfactored(contexts, params, [d is not None for d in diag], kron, factors.name)
    for i, p in enumerate(params):
        if diag[i] is None:
            continue  # the output does not depend on it
        for q in quantities:
            if q.kronecker:
                if p in kron:
                    results[i][q.attr] = kron[p]
                continue
            if q.product:
                results[i][q.savefield] = functools.partial(
                    ggn_matrix_product, torch.stack(roots[i])
                )
                continue
            if q.root:
                value = subsample(torch.stack(roots[i]), q.subsampling, 1, type(q).__name__)
            elif q.per_sample:
                value = batch_diag[i]
            else:
                value = diag[i]
            results[i][q.attr] = value
