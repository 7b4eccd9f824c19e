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
from typing import Any

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from ._eager import eager_backward
from ._offload import Parked, park
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
    if _recomputing():  # non-reentrant checkpointing re-runs forward inside backward: the
        return h  # original forward already applied the penalty and its graph keeps the gradient
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
    """
    skip = {id(t) for t in exclude}
    found: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
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


def logit_grads(
    h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, chunk: int,
    ignore_index: int, acc: torch.dtype,
) -> Iterator[tuple[int, int, Tensor, Tensor]]:  # fmt: skip
    """Chunks of ``cross_entropy(h Wᵀ + b, target, reduction="sum")``: for each chunk of rows
    ``start:stop``, the gradient with respect to its logits ``[rows, V]`` (in ``h.dtype``) and
    its summed loss (in ``acc``). The only vocabulary-sized buffers are one chunk's."""
    for start in range(0, h.shape[0], chunk):
        hc, tc = h[start : start + chunk], target[start : start + chunk]
        logits = hc @ weight.mT  # [c, V]
        if bias is not None:
            logits = logits + bias
        keep = tc != ignore_index
        safe = torch.where(keep, tc, 0)
        lse = torch.logsumexp(logits.to(acc), dim=1)
        picked = logits.gather(1, safe[:, None])[:, 0].to(acc)
        loss = ((lse - picked) * keep).sum()
        g = (logits.to(acc) - lse[:, None]).exp_()  # softmax
        del logits, lse, picked  # one vocabulary-sized buffer at a time
        g[torch.arange(len(tc), device=g.device), safe] -= 1.0
        g = (g * keep[:, None]).to(h.dtype)
        yield start, start + len(tc), g, loss
        del g


class _ChunkedLinearCE(torch.autograd.Function):
    """Loss and gradients of ``cross_entropy(h Wᵀ + b, target)`` computed chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                chunk: int, mean: bool, ignore_index: int) -> Tensor:  # fmt: skip
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        total = h.new_zeros((), dtype=torch.float32 if h.dtype != torch.float64 else h.dtype)
        valid = (target != ignore_index).sum()
        for start, stop, g, loss in logit_grads(
            h, weight, bias, target, chunk, ignore_index, total.dtype
        ):
            total = total + loss  # g: d loss_sum / d logits  [c, V]
            if need_h:
                grad_h[start:stop] = g @ weight
            if need_w:
                grad_w.addmm_(g.mT, h[start:stop])  # no [V, D] temporary
            if need_b:
                grad_b += g.sum(0)
        denom = valid.clamp(min=1).to(total.dtype) if mean else None
        ctx.grads, ctx.denom = (grad_h, grad_w, grad_b), denom
        return (total / denom if mean else total).to(h.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, go: Tensor) -> tuple[Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None  # computed in forward, handed out once
        if grads is None:
            raise UnsupportedModelError(
                "chunked_linear_cross_entropy: a second backward through the same loss; its "
                "gradients were handed out by the first. Run forward again for each backward."
            )
        scale = go if ctx.denom is None else go / ctx.denom
        grads = [None if g is None else g.mul_(scale.to(g.dtype)) for g in grads]  # ours
        return (*grads, None, None, None, None)


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
) -> Tensor:
    """``cross_entropy(h @ weight.T + bias, target)`` without ever holding the ``[N, V]`` logits.

    The loss and its gradients are computed a chunk of rows at a time during forward (the
    eager principle of :func:`side_loss` applied to the LM head); backward only scales them.
    Equal to the plain loss within floating-point rounding (different summation order).

    Example:
        >>> import torch, leanprop
        >>> h = torch.randn(6, 4, requires_grad=True)
        >>> w = torch.randn(10, 4, requires_grad=True)
        >>> loss = leanprop.chunked_linear_cross_entropy(h, w, torch.randint(0, 10, (6,)))
        >>> loss.backward()  # h.grad, w.grad as for F.cross_entropy(h @ w.T, target)

    Args:
        h: hidden states ``[N, D]`` (or ``[..., D]``, flattened).
        weight: output projection ``[V, D]``; bias: ``[V]`` or None.
        target: class indices ``[N]`` (or ``[...]``); ``ignore_index`` entries do not count.
        chunk_size: rows per chunk. None (default): as many rows as keep one chunk's float32
            logits ``[rows, V]`` within ``chunk_mib``, so the scratch memory does not grow with
            the vocabulary (about three such buffers exist at once).
        chunk_mib: the budget for one chunk's logits when ``chunk_size`` is None.
        reduction: ``"mean"`` (over non-ignored rows) or ``"sum"``.
    """
    tensors = (h, weight, target) if bias is None else (h, weight, target, bias)
    if has_torch_function(tensors):  # e.g. per_sample's op interception sees it as one op
        return handle_torch_function(
            chunked_linear_cross_entropy, tensors, h, weight, target, bias,
            chunk_size=chunk_size, chunk_mib=chunk_mib, reduction=reduction,
            ignore_index=ignore_index,
        )  # fmt: skip
    if reduction not in ("mean", "sum"):
        raise LeanpropValueError(
            f"chunked_linear_cross_entropy() got reduction={reduction!r}; allowed: 'mean', 'sum'."
        )
    if chunk_size is not None and not _is_count(chunk_size):
        raise LeanpropValueError(
            f"chunked_linear_cross_entropy() got chunk_size={chunk_size!r}; it must be a "
            "positive number of rows, or None (chosen from chunk_mib)."
        )
    if not chunk_mib > 0:
        raise LeanpropValueError(
            f"chunked_linear_cross_entropy() got chunk_mib={chunk_mib!r}; it must be a positive "
            "number of MiB."
        )
    h2, t1 = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    if h2.shape[0] != t1.shape[0] or weight.dim() != 2 or weight.shape[1] != h2.shape[1]:
        raise LeanpropValueError(
            f"chunked_linear_cross_entropy() got h {tuple(h.shape)}, weight {tuple(weight.shape)}"
            f", target {tuple(target.shape)}; expected h [..., D], weight [V, D], target [...]."
        )
    chunk_size = rows_per_chunk(weight, chunk_size, chunk_mib)
    return _ChunkedLinearCE.apply(
        h2, weight, bias, t1, chunk_size, reduction == "mean", ignore_index
    )
