"""Symmetric factors of a loss's Hessian with respect to the model output.

For a loss ``L = loss_fn(f, y)`` with model output ``f`` of shape ``[N, *S]`` (K = prod(S)
values per sample), the Hessian of ``L`` with respect to ``f`` is block diagonal over samples:
``H_n`` of shape ``[K, K]``. A factor ``V`` of shape ``[M, N, *S]`` satisfies, for each n,
``sum_m V[m, n] V[m, n]^T = H_n`` exactly (M = K columns, or C for cross-entropy), or in
expectation for the Monte-Carlo factors (M = ``mc_samples`` columns drawn from the model's
predictive distribution). Backpropagating each column through the network gives the square
root of the generalized Gauss-Newton matrix ``G = J^T H J``.

Supported losses, with ``reduction="mean"`` or ``"sum"`` (the factor includes the loss's own
normalisation, as BackPACK's does):

* ``nn.CrossEntropyLoss``: output ``[N, C]``, class-index targets ``[N]``, or ``[N, C, *D]``
  with targets ``[N, *D]`` (a class per position: tokens); ``weight``, ``ignore_index`` and
  ``label_smoothing`` as torch defines them. ``H_n = s_n / d * (diag(p_n) - p_n p_n^T)`` with
  ``p_n = softmax(f_n)``, a block per position (M = C columns per position: ``C * prod(D)``;
  the Monte-Carlo factor draws every position's class in each of its columns).
* ``nn.MSELoss``: any output shape; ``H_n = 2 / d * I``.
* ``nn.BCEWithLogitsLoss`` (without ``weight``/``pos_weight``): ``H_n = diag(σ(1 - σ)) / d``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...errors import LeanpropValueError

SUPPORTED = (nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss)


def check_loss(loss_fn: object, output: Tensor, target: Tensor) -> None:
    """Raise a clear error for a loss, reduction or shape the factors do not cover."""
    names = ", ".join(f"nn.{c.__name__}" for c in SUPPORTED)
    if type(loss_fn) not in SUPPORTED:
        raise LeanpropValueError(
            f"curvature needs the loss as one of {names} (the module, as BackPACK's extended "
            f"loss), got {type(loss_fn).__name__}. Its Hessian with respect to the output is "
            "what the GGN is built from."
        )
    reduction = loss_fn.reduction
    if reduction not in ("mean", "sum"):
        raise LeanpropValueError(
            f"curvature needs {type(loss_fn).__name__}(reduction='mean' or 'sum'), got "
            f"reduction={reduction!r}: the curvature of one scalar loss is computed."
        )
    if not output.requires_grad:
        raise LeanpropValueError(
            "curvature: the output does not require grad; pass the model's output computed "
            "inside the per_sample block (before any .detach())."
        )
    if output.dim() < 1 or output.shape[0] == 0:
        raise LeanpropValueError(
            f"curvature: the output must be [N, ...] with N >= 1 samples, got shape "
            f"{tuple(output.shape)}."
        )
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        positions = output.shape[:1] + output.shape[2:]
        if output.dim() < 2 or target.shape != positions or target.is_floating_point():
            raise LeanpropValueError(
                "curvature: nn.CrossEntropyLoss is supported for output [N, C] with class-index "
                "targets [N], or [N, C, d1, ...] (torch's layout of sequences: classes second) "
                f"with targets [N, d1, ...]; got output {tuple(output.shape)}, target "
                f"{tuple(target.shape)} of dtype {target.dtype}. Logits of sequences [N, T, C] "
                "go in as logits.transpose(1, 2) (as torch's loss takes them); rows flattened "
                "over tokens [N*T, C] are not the samples."
            )
    elif isinstance(loss_fn, nn.BCEWithLogitsLoss) and (
        loss_fn.weight is not None or loss_fn.pos_weight is not None
    ):
        raise LeanpropValueError(
            "curvature: nn.BCEWithLogitsLoss with weight or pos_weight is not supported "
            "(its Hessian then depends on the targets); use it without them."
        )
    if not isinstance(loss_fn, nn.CrossEntropyLoss) and target.shape != output.shape:
        raise LeanpropValueError(
            f"curvature: {type(loss_fn).__name__} needs a target of the output's shape "
            f"{tuple(output.shape)}, got {tuple(target.shape)} (no broadcasting)."
        )


def _cross_entropy_scale(loss_fn: nn.CrossEntropyLoss, target: Tensor, c: int) -> Tensor:
    """``s_n / d`` of each sample ``[N]``: its weight in the Hessian over the mean's divisor."""
    w = loss_fn.weight
    ignored = target == loss_fn.ignore_index
    keep = (~ignored).double()
    if w is None:  # (every class weighs 1: so does each kept position, smoothed or not)
        return keep / keep.sum() if loss_fn.reduction == "mean" else keep
    safe = torch.where(ignored, torch.zeros_like(target), target)
    w_y = w[safe].double() * keep
    eps = loss_fn.label_smoothing
    s = (1 - eps) * w_y + eps * (w.double().sum() / c) * keep
    return s / w_y.sum() if loss_fn.reduction == "mean" else s


def sqrt_hessian(
    loss_fn: nn.Module,
    output: Tensor,
    target: Tensor,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    differentiable: bool = False,
) -> Tensor:
    """The factor ``V`` ``[M, N, *S]`` of the loss's Hessian with respect to ``output``.

    Args:
        loss_fn: one of :data:`SUPPORTED` (checked by :func:`check_loss`).
        output: the model output ``[N, *S]`` (only its values are used).
        target: the targets the loss was called with.
        mc_samples: None for the exact factor; else the number of Monte-Carlo columns, each
            the gradient of the loss at a target drawn from the model's prediction.
        generator: random numbers of the Monte-Carlo draws.
        differentiable: ``V`` as a function of ``output`` (the Monte-Carlo draws fixed).

    Returns:
        ``V`` in the output's dtype, detached unless ``differentiable``.
    """
    f = output if differentiable else output.detach()
    n = f.shape[0]
    m = mc_samples
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        c, t = f.shape[1], f[0, 0].numel()  # classes, positions per sample (1 for [N, C])
        p = torch.softmax(f.double(), dim=1).reshape(n, c, t)  # [N, C, T]
        scale = _cross_entropy_scale(loss_fn, target, c).to(f.device).sqrt().reshape(n, 1, t)
        if m is None:  # column j of diag(√p) - p √pᵀ at each position: [C, N, C, T]
            sq = p.sqrt()
            diag = torch.diag_embed(sq.mT).permute(3, 0, 2, 1)  # [C, N, C, T]: δ_ij √p_j
            v = diag - p[None] * sq.transpose(0, 1)[:, :, None]
            if t > 1:  # positions are blocks of H_n of their own: a column per class and position
                v = v[:, None] * torch.eye(t, dtype=v.dtype, device=v.device)[None, :, None, None]
                v = v.reshape(c * t, n, c, t)
        else:  # p - onehot(ŷ), ŷ ~ Categorical(p) at each position (drawn independently)
            flat = p.transpose(1, 2).reshape(n * t, c)
            draws = torch.multinomial(flat, m, replacement=True, generator=generator)  # [N T, M]
            onehot = nn.functional.one_hot(draws.t().reshape(m, n, t), c).double()  # [M,N,T,C]
            v = p[None] - onehot.transpose(2, 3)
            scale = scale / m**0.5
        return (v * scale[None]).reshape(v.shape[0], *f.shape).to(f.dtype)
    d = f.numel() if loss_fn.reduction == "mean" else 1
    k = f[0].numel()
    if isinstance(loss_fn, nn.MSELoss):
        if m is None:
            eye = torch.eye(k, dtype=f.dtype, device=f.device) * (2.0 / d) ** 0.5
            return eye[:, None, :].expand(k, n, k).reshape(k, *f.shape).clone()
        z = torch.randn((m, *f.shape), dtype=f.dtype, device=f.device, generator=generator)
        return z * (2.0 / (d * m)) ** 0.5
    sig = torch.sigmoid(f.double())
    if m is None:
        diag = (sig * (1 - sig) / d).sqrt().reshape(n, k)  # [N, K]
        v = torch.diag_embed(diag).permute(2, 0, 1)  # [K, N, K]
        return v.reshape(k, *f.shape).to(f.dtype)
    u = torch.rand((m, *f.shape), dtype=torch.float64, device=f.device, generator=generator)
    drawn = (u < sig[None]).double()
    return ((sig[None] - drawn) / (d * m) ** 0.5).to(f.dtype)
