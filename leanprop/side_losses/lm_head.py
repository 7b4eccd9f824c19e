"""``chunked_linear_cross_entropy``: the LM-head loss without ever holding the ``[N, V]``
logits, computed a chunk of rows at a time (the eager principle applied to the head)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from .._torch_compat import saveable
from ..errors import LeanpropValueError, UnsupportedModelError
from .eager import is_count


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
            ctx.save_for_backward(*map(saveable, (h, weight, bias, target)))
            return losses.to(h.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grads = _empty_grads(h, weight, bias, need_h, need_w, need_b)
        total = h.new_zeros((), dtype=acc)
        for start, stop, g, loss in logit_grads(h, weight, bias, target, chunk, spec, acc):
            total = total + loss.sum()  # g: d loss_sum / d logits  [c, V]
            _add_grads(grads, g, h, weight, bias, start, stop)
        denom, keep = None, None
        if reduction == "mean":  # NaN over no rows, as torch
            keep = target != spec.ignore_index
            denom = spec.row_weights(target, keep, acc).sum()
        ctx.grads, ctx.denom, ctx.keep = grads, denom, keep
        return (total if denom is None else _mean(total, denom)).to(h.dtype)

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
        if ctx.denom is None:
            scales = [go] * 3
        else:  # a mean over a total weight of 0, as torch: NaN where a row was kept, else 0
            scale = _mean(go, ctx.denom)
            kept = ctx.keep.any()
            whole = torch.where(kept, scale, 0)
            scales = [torch.where(ctx.keep, scale, 0)[:, None], whole, whole]
        grads = [
            None if g is None else g.mul_(s.to(g.dtype)) for g, s in zip(grads, scales, strict=True)
        ]
        return (*grads, None, None, None, None)


def _mean(total: Tensor, denom: Tensor) -> Tensor:
    """``total / denom``, NaN where ``denom`` is 0 (a mean over nothing, as torch; not inf)."""
    return torch.where(denom == 0, torch.nan, total / denom)


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
    if chunk_size is not None and not is_count(chunk_size):
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
