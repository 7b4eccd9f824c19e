"""``side_loss``: a penalty added to the objective now, its graph freed at once.

``h = side_loss(h, fn, weight=alpha)`` adds ``alpha * fn(h)`` to the training objective without
keeping ``fn``'s sub-graph alive until the final backward: ``fn`` is evaluated on a detached
copy of ``h`` and differentiated at once (its activations are freed right away), and the
returned ``h`` (the same values) hands the stored gradients back during the main backward:
``d(alpha * fn)/dh`` where the penalty would have entered, and ``d(alpha * fn)/dθ`` to every
parameter ``θ`` that ``fn`` uses. Parameters therefore receive all their gradient inside the
main backward, as with the combined loss, so hooks that watch gradient accumulation (DDP's
reducer, :class:`leanprop.InBackward`, gradient accumulation) see nothing unusual.

Exactness: parameter gradients are bit-identical to one backward of ``main + alpha * fn(h)``
when ``h`` has at most one other consumer and ``fn``'s parameters are used only inside ``fn``
(the sum of two gradients does not depend on order). With several other consumers, or a
parameter shared between ``fn`` and the model, autograd's summation order can differ: equal up
to rounding. Inside non-reentrant activation checkpointing the recomputation skips the penalty
(the original forward's graph already carries its gradient); inside a reentrant one the
penalty is applied in the recomputation, whose graph that backward differentiates (the original
forward ran without grad). Results stay exact in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from .._eager import eager_backward
from .._torch_compat import (
    current_graph_task_id,
    in_reentrant_checkpoint_backward,
    leaf_hooks_suspended,
)
from ..errors import LeanpropValueError, UnsupportedModelError
from .offload import Parked, park


class _InjectGrad(torch.autograd.Function):
    """Identity on ``hs``; backward adds the stored gradients to ``hs`` and hands the stored
    parameter gradients to ``params`` (inputs only so that autograd routes them there)."""

    @staticmethod
    def forward(ctx: Any, stored: Parked, n_h: int, *hs_and_params: Tensor) -> tuple[Tensor, ...]:
        ctx.stored, ctx.n_h = stored, n_h
        return tuple(h.view_as(h) for h in hs_and_params[:n_h])

    @staticmethod
    def backward(ctx: Any, *gos: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise UnsupportedModelError(
                "side_loss: backward(create_graph=True) through an eager side loss is not "
                "supported: its gradient was computed without a graph. Add the penalty to the "
                "loss instead (main + weight * fn(h)) when you need higher derivatives."
            )
        stored, ctx.stored = ctx.stored, None  # each stored gradient is used once
        if stored is None:
            raise UnsupportedModelError(
                "side_loss: a second backward through the same side loss; its stored gradient "
                "was handed out by the first. Run forward again for each backward."
            )
        grads = stored.take()
        h_grads = grads[: ctx.n_h]
        out = [go if g is None else go + g for go, g in zip(gos, h_grads, strict=True)]
        return (None, None, *out, *grads[ctx.n_h :])


def side_loss(
    h: Tensor | Sequence[Tensor],
    fn: Callable[..., Tensor],
    weight: float | Tensor = 1.0,
    *,
    log: list[Tensor] | None = None,
    scale: float | Tensor | None = None,
    chunk_size: int | None = None,
    chunk_reduction: str = "mean",
    offload: bool = False,
) -> Any:
    """Add ``weight * fn(*h)`` to the objective now, and free its graph.

    Example:
        >>> import torch, leanprop
        >>> lin = torch.nn.Linear(4, 4)
        >>> x = torch.randn(8, 4)
        >>> values = []
        >>> h = leanprop.side_loss(lin(x), lambda t: t.square().mean(), weight=0.1, log=values)
        >>> h.sum().backward()  # lin gets d(h.sum() + 0.1 * mean(h²))
        >>> len(values)
        1

    Args:
        h: a tensor ``[N, ...]`` or a sequence of tensors (then ``fn`` takes them all).
        fn: the penalty, returning a scalar. Its parameters get their gradients during the main
            backward (computed now, handed over there), like ``h``'s producers.
        weight: the penalty's weight ``alpha``.
        log: if given, the detached value ``weight * fn(h)`` is appended (for logging).
        scale: loss scale to apply inside the eager backward (fp16 ``GradScaler``: pass
            ``scaler.get_scale()``) so the penalty's gradients are scaled like the main loss's.
        chunk_size: evaluate and differentiate ``fn`` on this many samples (dim 0 of every
            tensor in ``h``) at a time, so only one chunk's penalty activations exist at once.
            The penalty is then ``sum_c w_c * fn(h_c)`` over the chunks ``h_c``, with
            ``w_c = len(h_c) / N`` for ``chunk_reduction="mean"`` and ``1`` for ``"sum"``:
            the same as ``fn(h)`` when ``fn`` is a mean (or sum) of per-sample terms, e.g.
            ``pen(t).square().mean()``; a different penalty for one that mixes samples (a Gram
            matrix, batch statistics). Gradients equal the unchunked ones up to rounding. Not
            with :func:`leanprop.per_sample` tracking the penalty's modules (they would see
            batches of chunk size).
        chunk_reduction: ``"mean"`` or ``"sum"``, see ``chunk_size``.
        offload: CUDA only (ignored for CPU tensors): keep the stored gradients (``h``'s and
            the penalty parameters') in pinned host memory until the main backward needs them,
            instead of in GPU memory. Copies run on their own streams: each side loss moves the
            previous one's gradients out (the newest stays, the backward needs it first), and
            the backward fetches the next one's while it works on the current. Worth it when
            the penalty has large parameters or there are many side losses; costs PCIe
            traffic, twice the stored bytes per step.

    Returns:
        ``h`` (the same values; a tuple for a sequence), through which the main backward adds
        the penalty's gradient. Use it downstream instead of the original.

    Raises:
        LeanpropValueError: ``h`` holds no tensors, ``fn`` is not callable or does not return a
            scalar, or a bad ``chunk_size`` / ``chunk_reduction`` / batch size /
            ``offload``.
        UnsupportedModelError: a later ``backward(create_graph=True)`` through it, or a second
            backward through the same returned ``h``.
    """
    single = isinstance(h, Tensor)
    hs = (h,) if single else tuple(h) if isinstance(h, Sequence) else ()
    if not hs or not all(isinstance(t, Tensor) for t in hs):
        raise LeanpropValueError(
            f"side_loss() needs a tensor or a sequence of tensors as h, got {type(h).__name__}."
        )
    if not callable(fn):
        raise LeanpropValueError(f"side_loss() needs a callable fn, got {type(fn).__name__}.")
    if not (
        (isinstance(weight, Tensor) and weight.numel() == 1)
        or (isinstance(weight, int | float) and not isinstance(weight, bool))
    ):
        raise LeanpropValueError(
            f"side_loss() got weight={weight!r}; it must be a number or a one-element tensor "
            "(the penalty's weight, e.g. 0.1)."
        )
    if not isinstance(offload, bool):
        raise LeanpropValueError(f"side_loss() got offload={offload!r}; it must be True or False.")
    chunks = _chunks(hs, chunk_size, chunk_reduction)
    replaying = in_reentrant_checkpoint_backward()
    if _recomputing() and not replaying:
        # non-reentrant checkpointing re-runs forward inside backward: the original forward
        # already applied the penalty and its graph keeps the gradient. (A reentrant one ran
        # the original forward without grad, and differentiates this recomputation instead.)
        return h
    if replaying:
        log = None  # logged by the original forward
    if not torch.is_grad_enabled():
        with torch.no_grad():
            value = sum(_value(fn, weight, w, _cut(hs, sl)) for sl, w in chunks)
        if log is not None:
            log.append(value.detach())
        return h
    if offload:  # the previous side losses' gradients leave while this one computes
        park(hs[0].device)
    total: Tensor | None = None
    h_grads: list[Tensor | None] = [None] * len(hs)
    param_grads: dict[int, tuple[Tensor, Tensor | None]] = {}  # id -> (parameter, gradient)
    owned: set[int] = set()  # parameters whose summed gradient this function allocated
    for sl, w in chunks:
        detached = [t.detach().requires_grad_(t.requires_grad) for t in _cut(hs, sl)]
        # plain saved tensors: the penalty's graph is private (e.g. not recorded by an enclosing
        # activation checkpoint, whose recomputation skips it) and freed by its backward
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            value = _value(fn, weight, w, detached)
            total = value.detach() if total is None else total + value.detach()
            if not value.requires_grad:  # fn used neither h nor a parameter
                continue
            params = _leaves(value, exclude=detached)
            wrt = [d for d in detached if d.requires_grad] + params
            # per_sample keeps its cycle open for the main backward; parameter hooks run there
            with eager_backward(), _leaf_hooks_off(params):
                grads = iter(torch.autograd.grad(value if scale is None else value * scale, wrt,
                                                 allow_unused=True))  # fmt: skip
        for i, d in enumerate(detached):
            g = next(grads) if d.requires_grad else None
            if g is not None and sl is None:
                h_grads[i] = g
            elif g is not None:
                if h_grads[i] is None:
                    h_grads[i] = torch.zeros_like(hs[i])
                h_grads[i][sl] = g
        for p, g in zip(params, grads, strict=True):
            _, before = param_grads.get(id(p), (p, None))
            if before is None or g is None:
                param_grads[id(p)] = (p, g if before is None else before)
            elif id(p) in owned:  # a sum this loop made: add in place, no third buffer
                before.add_(g)
            else:  # autograd's own tensor (it may be shared or expanded): a new sum
                param_grads[id(p)] = (p, before + g)
                owned.add(id(p))
    if log is not None and total is not None:
        log.append(total)
    if not param_grads and all(g is None for g in h_grads):
        return h
    params = [p for p, _ in param_grads.values()]
    grads_all = [*h_grads, *(g for _, g in param_grads.values())]
    out = _InjectGrad.apply(Parked(grads_all, offload), len(hs), *hs, *params)
    return out[0] if single else out


def _chunks(
    hs: tuple[Tensor, ...], chunk_size: int | None, reduction: str
) -> list[tuple[slice | None, float | None]]:
    """``(samples, weight)`` per chunk; ``[(None, None)]`` for the whole batch at once."""
    if chunk_size is None:
        return [(None, None)]
    if not is_count(chunk_size):
        raise LeanpropValueError(
            f"side_loss() got chunk_size={chunk_size!r}; it must be a positive number of samples "
            "or None (the whole batch at once)."
        )
    if reduction not in ("mean", "sum"):
        raise LeanpropValueError(
            f"side_loss() got chunk_reduction={reduction!r}; allowed: 'mean', 'sum'."
        )
    sizes = {t.shape[0] if t.dim() else None for t in hs}
    if len(sizes) != 1 or None in sizes:
        shapes = [tuple(t.shape) for t in hs]
        raise LeanpropValueError(
            f"side_loss(chunk_size=...) splits every tensor of h along dim 0 (samples), so they "
            f"need the same batch size; got shapes {shapes}."
        )
    n = sizes.pop()
    if n == 0:  # no samples: fn on the whole (empty) batch, as the unchunked penalty
        return [(None, None)]
    return [
        (slice(a, min(a + chunk_size, n)), (min(a + chunk_size, n) - a) / n if reduction ==
         "mean" else 1.0)
        for a in range(0, n, chunk_size)
    ]  # fmt: skip


def is_count(x: Any) -> bool:
    """A positive whole number (``True`` is not one)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _cut(hs: tuple[Tensor, ...], sl: slice | None) -> tuple[Tensor, ...]:
    return hs if sl is None else tuple(t[sl] for t in hs)


def _value(fn: Callable[..., Tensor], weight: Any, w: float | None, hs: Sequence[Tensor]) -> Tensor:
    """``weight * fn(*hs)``, times the chunk's weight ``w`` when chunked."""
    v = _scalar(fn(*hs))
    return weight * v if w is None else weight * (w * v)


def _leaves(value: Tensor, exclude: Sequence[Tensor]) -> list[Tensor]:
    """The leaf tensors (parameters) that ``value``'s graph accumulates into, except ``exclude``.

    Found by walking the graph to its ``AccumulateGrad`` nodes; order of first discovery.
    Every visited node object is held until the walk ends: some torch versions hand out a
    temporary Python object per access, whose id a later one reuses once it is freed (nodes
    would be taken for visited, their parameters missed).
    """
    skip = {id(t) for t in exclude}
    found: dict[int, Tensor] = {}
    seen: dict[int, Any] = {}  # id -> the node object itself (kept alive)
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, Tensor):
            if id(leaf) not in skip:
                found.setdefault(id(leaf), leaf)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions)
    return list(found.values())


def _leaf_hooks_off(params: list[Tensor]) -> AbstractContextManager[None]:
    """Suspend the ``register_hook`` hooks of ``params`` while their gradients are captured:
    autograd runs a leaf's hooks on captured gradients too, and the main backward, through
    which the gradients are handed over, runs them again (once, on the whole gradient, as
    the combined loss would)."""
    return leaf_hooks_suspended(params)


def _keep(t: Tensor) -> Tensor:
    return t


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass (checkpoint recomputation)."""
    return torch.is_grad_enabled() and current_graph_task_id() != -1


def _scalar(v: Any) -> Tensor:
    if not isinstance(v, Tensor) or v.numel() != 1:
        shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
        raise LeanpropValueError(
            f"side_loss(): fn must return a scalar tensor (the penalty), got {shape}; reduce "
            "it, e.g. with .mean() or .sum()."
        )
    return v.reshape(())
