"""Eager side losses and gradient transforms.

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
(the original forward's graph already carries its gradient), so results stay exact there too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from ._eager import eager_backward
from ._offload import Parked, park
from ._torch_compat import in_reentrant_checkpoint_backward
from .errors import LeanpropValueError, UnsupportedModelError


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
    if not _is_count(chunk_size):
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
    return [
        (slice(a, min(a + chunk_size, n)), (min(a + chunk_size, n) - a) / n if reduction ==
         "mean" else 1.0)
        for a in range(0, n, chunk_size)
    ]  # fmt: skip


def _is_count(x: Any) -> bool:
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


@contextmanager
def _leaf_hooks_off(params: list[Tensor]) -> Iterator[None]:
    """Suspend the ``register_hook`` hooks of ``params`` while their gradients are captured:
    autograd runs a leaf's hooks on captured gradients too, and the main backward, through
    which the gradients are handed over, runs them again (once, on the whole gradient, as
    the combined loss would)."""
    saved = [(p, p._backward_hooks) for p in params if p._backward_hooks]
    try:
        for p, _ in saved:
            p._backward_hooks = None
        yield
    finally:
        for p, hooks in saved:
            p._backward_hooks = hooks


def _keep(t: Tensor) -> Tensor:
    return t


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass (checkpoint recomputation)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _scalar(v: Any) -> Tensor:
    if not isinstance(v, Tensor) or v.numel() != 1:
        shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
        raise LeanpropValueError(
            f"side_loss(): fn must return a scalar tensor (the penalty), got {shape}; reduce "
            "it, e.g. with .mean() or .sum()."
        )
    return v.reshape(())


class _TransformGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.fn = fn
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        out = ctx.fn(g)
        if not isinstance(out, Tensor) or out.shape != g.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise LeanpropValueError(
                f"transform_grad(): fn(grad) returned {got} for a gradient of shape "
                f"{tuple(g.shape)}; it must return the new gradient, a tensor of the same shape "
                "(return grad itself to leave it unchanged, torch.zeros_like(grad) to stop it)."
            )
        return out, None


def transform_grad(h: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Identity in forward; in backward the gradient ``g`` flowing into ``h`` becomes ``fn(g)``.

    ``fn`` is written with differentiable ops if ``create_graph=True`` is used.
    """
    if not isinstance(h, Tensor) or not callable(fn):
        raise LeanpropValueError(
            "transform_grad(h, fn) needs a tensor h and a callable fn(grad) -> grad."
        )
    return _TransformGrad.apply(h, fn)


def scale_grad(h: Tensor, s: float | Tensor) -> Tensor:
    """Identity in forward; backward multiplies the gradient by ``s``: a number, a scalar
    tensor, or per-sample factors ``[N]`` (broadcast over ``h``'s other dims)."""
    if not isinstance(h, Tensor):
        raise LeanpropValueError(f"scale_grad() needs a tensor h, got {type(h).__name__}.")
    if not (isinstance(s, Tensor) or (isinstance(s, int | float) and not isinstance(s, bool))):
        raise LeanpropValueError(
            f"scale_grad() got s={s!r}; it must be a number, a scalar tensor or per-sample "
            f"factors [{h.shape[0] if h.dim() else 1}]."
        )
    if isinstance(s, Tensor) and s.dim() == 1 and h.dim() > 1:
        if s.shape[0] != h.shape[0]:
            raise LeanpropValueError(
                f"scale_grad() got per-sample factors of shape {tuple(s.shape)} for h of shape "
                f"{tuple(h.shape)}; they need one factor per sample, [{h.shape[0]}]."
            )
        s = s.reshape(-1, *([1] * (h.dim() - 1)))
    elif isinstance(s, Tensor) and s.dim() > 0:
        try:
            ok = torch.broadcast_shapes(s.shape, h.shape) == h.shape
        except RuntimeError:
            ok = False
        if not ok:
            raise LeanpropValueError(
                f"scale_grad() got factors of shape {tuple(s.shape)} for h of shape "
                f"{tuple(h.shape)}; they must broadcast to h's shape (a scalar, or one factor "
                "per sample)."
            )
    return transform_grad(h, lambda g: g * s)


def rows_per_chunk(weight: Tensor, chunk_size: int | None, chunk_mib: float) -> int:
    """``chunk_size``, or as many rows as keep one chunk's float32 logits within the budget."""
    if chunk_size is not None:
        return chunk_size
    return max(1, int(chunk_mib * 2**20) // (4 * weight.shape[0]))


@dataclass(frozen=True)
class LossSpec:
    """What ``chunked_linear_cross_entropy`` computes besides the projection:
    ``cross_entropy(logits, target, weight=class_weight, ignore_index=...,
    label_smoothing=...)`` per row."""

    ignore_index: int = -100
    class_weight: Tensor | None = None  # [V]
    label_smoothing: float = 0.0

    def row_weights(self, target: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
        """Each row's weight in a mean (its class's weight, 0 if ignored): ``[rows]``."""
        if self.class_weight is None:
            return keep.to(dtype)
        safe = torch.where(keep, target, 0)
        return self.class_weight.to(dtype)[safe] * keep.to(dtype)


def logit_grads(
    h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, chunk: int,
    spec: LossSpec, acc: torch.dtype,
) -> Iterator[tuple[int, int, Tensor, Tensor]]:  # fmt: skip
    """Chunks of the per-row losses of ``cross_entropy(h Wᵀ + b, target, reduction="none")``
    (with ``spec``'s class weights and label smoothing): for each chunk of rows
    ``start:stop``, the gradient of its summed loss with respect to its logits ``[rows, V]``
    (in ``h.dtype``) and its row losses ``[rows]`` (in ``acc``). The only vocabulary-sized
    buffers are one chunk's."""
    eps = spec.label_smoothing
    vocab = weight.shape[0]
    cw = None if spec.class_weight is None else spec.class_weight.to(acc)
    cw_sum = float(vocab) if cw is None else cw.sum()
    for start in range(0, h.shape[0], chunk):
        hc, tc = h[start : start + chunk], target[start : start + chunk]
        logits = hc @ weight.mT  # [c, V]
        if bias is not None:
            logits = logits + bias
        keep = tc != spec.ignore_index
        safe = torch.where(keep, tc, 0)
        kept = keep.to(acc)  # (a bool times a float would be in the default dtype)
        z = logits.to(acc)
        del logits
        lse = torch.logsumexp(z, dim=1)
        w_y = spec.row_weights(tc, keep, acc)  # [c]
        losses = (1 - eps) * (lse - z.gather(1, safe[:, None])[:, 0]) * w_y
        if eps:  # the uniform part: sum_j w_j (lse - z_j) / V
            spread = lse * cw_sum - (z.sum(1) if cw is None else z @ cw)
            losses = losses + (eps / vocab) * spread * kept
        # d losses / d z = (1-eps) w_y (p - onehot) + eps/V (sum(w) p - w)
        g = (z - lse[:, None]).exp_()  # softmax; one vocabulary-sized buffer at a time
        del z, lse
        g.mul_(((1 - eps) * w_y + (eps / vocab) * cw_sum * kept)[:, None])
        g[torch.arange(len(tc), device=g.device), safe] -= (1 - eps) * w_y
        if eps:
            g -= (eps / vocab) * (kept[:, None] if cw is None else kept[:, None] * cw)
        yield start, start + len(tc), g.to(h.dtype), losses
        del g


class _ChunkedLinearCE(torch.autograd.Function):
    """Loss and gradients of ``cross_entropy(h Wᵀ + b, target, ...)`` chunk by chunk: for a
    mean or sum computed in forward (backward only scales them); for ``reduction="none"``
    recomputed in backward, scaled row by row."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                chunk: int, reduction: str, spec: LossSpec) -> Tensor:  # fmt: skip
        acc = torch.float32 if h.dtype != torch.float64 else h.dtype
        ctx.chunk, ctx.spec, ctx.reduction = chunk, spec, reduction
        if reduction == "none":
            losses = torch.cat(
                [loss for *_, loss in logit_grads(h, weight, bias, target, chunk, spec, acc)]
                or [h.new_zeros(0, dtype=acc)]
            )
            ctx.save_for_backward(h, weight, bias, target)
            return losses.to(h.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grads = _empty_grads(h, weight, bias, need_h, need_w, need_b)
        total = h.new_zeros((), dtype=acc)
        for start, stop, g, loss in logit_grads(h, weight, bias, target, chunk, spec, acc):
            total = total + loss.sum()  # g: d loss_sum / d logits  [c, V]
            _add_grads(grads, g, h, weight, bias, start, stop)
        denom = None
        if reduction == "mean":  # NaN over no rows, as torch (its gradients are zeros)
            denom = spec.row_weights(target, target != spec.ignore_index, acc).sum()
        ctx.grads, ctx.denom = grads, denom
        return (total if denom is None else total / denom).to(h.dtype)

    @staticmethod
    def backward(ctx: Any, go: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise UnsupportedModelError(
                "chunked_linear_cross_entropy: backward(create_graph=True) (second derivatives) "
                "is not supported: its gradients are computed chunk by chunk outside the graph. "
                "Use F.cross_entropy(F.linear(h, W, b), target) where you need them."
            )
        if ctx.reduction == "none":
            return (*_recomputed_grads(ctx, go), None, None, None, None)
        grads, ctx.grads = ctx.grads, None  # computed in forward, handed out once
        if grads is None:
            raise UnsupportedModelError(
                "chunked_linear_cross_entropy: a second backward through the same loss; its "
                "gradients were handed out by the first. Run forward again for each backward."
            )
        scale = go if ctx.denom is None else go / ctx.denom.clamp(min=1e-30)
        grads = [None if g is None else g.mul_(scale.to(g.dtype)) for g in grads]  # ours
        return (*grads, None, None, None, None)


def _empty_grads(
    h: Tensor, weight: Tensor, bias: Tensor | None, need_h: bool, need_w: bool, need_b: bool
) -> list[Tensor | None]:
    return [
        torch.empty_like(h) if need_h else None,
        torch.zeros_like(weight) if need_w else None,
        torch.zeros_like(bias) if need_b else None,
    ]


def _add_grads(
    grads: list[Tensor | None], g: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None,
    start: int, stop: int,
) -> None:  # fmt: skip
    """Add one chunk's logit gradients ``g [rows, V]`` to the gradients of h, W and b."""
    grad_h, grad_w, grad_b = grads
    if grad_h is not None:
        grad_h[start:stop] = g @ weight
    if grad_w is not None:
        grad_w.addmm_(g.mT, h[start:stop])  # no [V, D] temporary
    if grad_b is not None:
        grad_b += g.sum(0).sum_to_size(grad_b.shape)  # (a bias [1] is broadcast)


def _recomputed_grads(ctx: Any, go: Tensor) -> list[Tensor | None]:
    """``reduction="none"``: each chunk's logit gradients again, scaled by its rows' output
    gradients ``go [rows]``."""
    h, weight, bias, target = ctx.saved_tensors
    need_b = bias is not None and ctx.needs_input_grad[2]
    grads = _empty_grads(h, weight, bias, ctx.needs_input_grad[0], ctx.needs_input_grad[1], need_b)
    acc = torch.float32 if h.dtype != torch.float64 else h.dtype
    go = go.reshape(-1)
    for start, stop, g, _ in logit_grads(h, weight, bias, target, ctx.chunk, ctx.spec, acc):
        g.mul_(go[start:stop, None].to(g.dtype))
        _add_grads(grads, g, h, weight, bias, start, stop)
    return grads


def chunked_linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    chunk_size: int | None = None,
    chunk_mib: float = 32.0,
    reduction: str = "mean",
    ignore_index: int = -100,
    class_weight: Tensor | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """``cross_entropy(h @ weight.T + bias, target, ...)`` without ever holding the ``[N, V]``
    logits.

    For ``"mean"`` and ``"sum"`` the loss and its gradients are computed a chunk of rows at a
    time during forward (the eager principle of :func:`side_loss` applied to the LM head);
    backward only scales them. For ``"none"`` the per-row losses come from forward and the
    gradients are recomputed a chunk at a time in backward (each row's own output gradient
    scales it). Equal to ``F.cross_entropy(F.linear(h, weight, bias), target, weight=
    class_weight, ignore_index=ignore_index, label_smoothing=label_smoothing,
    reduction=reduction)`` within floating-point rounding (different summation order),
    including NaN for a mean over no rows.

    Example:
        >>> import torch, leanprop
        >>> h = torch.randn(6, 4, requires_grad=True)
        >>> w = torch.randn(10, 4, requires_grad=True)
        >>> loss = leanprop.chunked_linear_cross_entropy(h, w, torch.randint(0, 10, (6,)))
        >>> loss.backward()  # h.grad, w.grad as for F.cross_entropy(h @ w.T, target)

    Args:
        h: hidden states ``[N, D]`` (or ``[..., D]``, flattened).
        weight: output projection ``[V, D]``; bias: ``[V]`` (or ``[1]``) or None.
        target: class indices ``[N]`` (or ``[...]``), any integer dtype; ``ignore_index``
            entries do not count. (Class probabilities are not supported.)
        chunk_size: rows per chunk. None (default): as many rows as keep one chunk's float32
            logits ``[rows, V]`` within ``chunk_mib``, so the scratch memory does not grow with
            the vocabulary (about three such buffers exist at once).
        chunk_mib: the budget for one chunk's logits when ``chunk_size`` is None.
        reduction: ``"mean"`` (weighted by the rows' class weights, over non-ignored rows),
            ``"sum"`` or ``"none"`` (a loss per row, shaped as ``target``).
        class_weight: ``[V]``, torch's ``weight`` of ``F.cross_entropy``.
        label_smoothing: in ``[0, 1]``, as in ``F.cross_entropy``.
    """
    tensors = tuple(t for t in (h, weight, target, bias, class_weight) if isinstance(t, Tensor))
    if has_torch_function(tensors):  # e.g. per_sample's op interception sees it as one op
        return handle_torch_function(
            chunked_linear_cross_entropy, tensors, h, weight, target, bias,
            chunk_size=chunk_size, chunk_mib=chunk_mib, reduction=reduction,
            ignore_index=ignore_index, class_weight=class_weight,
            label_smoothing=label_smoothing,
        )  # fmt: skip
    target = _check_lm_head_input(
        h, weight, target, bias, chunk_size, chunk_mib, reduction, class_weight, label_smoothing
    )
    h2, t1 = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    _check_targets(t1, weight.shape[0], ignore_index)
    spec = LossSpec(ignore_index, class_weight, float(label_smoothing))
    chunk = rows_per_chunk(weight, chunk_size, chunk_mib)
    out = _ChunkedLinearCE.apply(h2, weight, bias, t1, chunk, reduction, spec)
    return out.view(target.shape) if reduction == "none" else out


def _check_lm_head_input(
    h: Any, weight: Any, target: Any, bias: Any, chunk_size: Any, chunk_mib: Any,
    reduction: Any, class_weight: Any, label_smoothing: Any,
) -> Tensor:  # fmt: skip
    """Clear errors for bad arguments of chunked_linear_cross_entropy; the target as int64."""
    name = "chunked_linear_cross_entropy()"
    for what, t in (("h", h), ("weight", weight), ("target", target)):
        if not isinstance(t, Tensor):
            raise LeanpropValueError(f"{name} needs a tensor {what}, got {type(t).__name__}.")
    if reduction not in ("mean", "sum", "none"):
        raise LeanpropValueError(
            f"{name} got reduction={reduction!r}; allowed: 'mean', 'sum', 'none'."
        )
    if chunk_size is not None and not _is_count(chunk_size):
        raise LeanpropValueError(
            f"{name} got chunk_size={chunk_size!r}; it must be a positive number of rows, or "
            "None (chosen from chunk_mib)."
        )
    if not (
        isinstance(chunk_mib, int | float) and not isinstance(chunk_mib, bool)
        and 0 < chunk_mib < float("inf")
    ):  # fmt: skip
        raise LeanpropValueError(
            f"{name} got chunk_mib={chunk_mib!r}; it must be a positive, finite number of MiB."
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise LeanpropValueError(
            f"{name} got a target of dtype {target.dtype}; it takes class indices (an integer "
            "dtype). Class probabilities are not supported: use F.cross_entropy for those."
        )
    h_rows = h.reshape(-1, h.shape[-1]).shape[0] if h.dim() else -1
    if h.dim() == 0 or h_rows != target.numel() or weight.dim() != 2 or (
        weight.shape[1] != h.shape[-1]
    ):  # fmt: skip
        raise LeanpropValueError(
            f"{name} got h {tuple(h.shape)}, weight {tuple(weight.shape)}, target "
            f"{tuple(target.shape)}; expected h [..., D], weight [V, D], target [...]."
        )
    vocab = weight.shape[0]
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape not in ((vocab,), (1,))):
        got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise LeanpropValueError(f"{name} got a bias {got}; it must be [{vocab}] or [1].")
    if class_weight is not None and (
        not isinstance(class_weight, Tensor) or class_weight.shape != (vocab,)
    ):
        got = tuple(class_weight.shape) if isinstance(class_weight, Tensor) else class_weight
        raise LeanpropValueError(
            f"{name} got class_weight {got}; it must be a tensor [{vocab}] (one per class)."
        )
    if not (
        isinstance(label_smoothing, int | float) and not isinstance(label_smoothing, bool)
        and 0.0 <= label_smoothing <= 1.0
    ):  # fmt: skip
        raise LeanpropValueError(
            f"{name} got label_smoothing={label_smoothing!r}; it must be a number in [0, 1]."
        )
    return target.long()


def _check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Out-of-range class indices raise as in torch (one host synchronisation)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise IndexError(
            f"Target {value} is out of bounds. chunked_linear_cross_entropy: class indices "
            f"must be in [0, {vocab}) or ignore_index ({ignore_index})."
        )
