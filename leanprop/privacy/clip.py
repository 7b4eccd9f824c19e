"""Per-sample clipping in one backward pass: :func:`clip_per_sample`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import nn

from ..errors import LeanpropValueError, UnsupportedModelError, checked_number
from ..per_sample.capture import ConvAlgorithm, PerSample
from ..per_sample.clipping import Clipping

MaxGradNorm = float | Sequence[float] | Mapping[str, float]


def refuse_distributed(
    model: nn.Module, owner: str, process_group: bool = True, fix: str | None = None
) -> None:
    """Refuse a DDP model (its all-reduce would add the unclipped gradients), and with
    ``process_group`` any process group of several ranks; ``fix``: what to do instead."""
    in_group = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
    if isinstance(model, nn.parallel.DistributedDataParallel) or (process_group and in_group):
        raise UnsupportedModelError(
            f"{owner} does not take a DistributedDataParallel model"
            f"{' or a process group' if process_group else ''}: DDP's all-reduce would add the "
            "unclipped gradients. "
            + (
                fix
                if fix is not None
                else "Train privately in one process."
                if process_group
                else "Clip the unwrapped model on each rank and use "
                "DPOptimizer(..., distributed=True), which adds the clipped sums of all ranks "
                "and the noise once."
            )
        )


def clipping_of(
    model: nn.Module, max_grad_norm: MaxGradNorm, loss_reduction: str
) -> Clipping:  # fmt: skip
    """The clipping ``max_grad_norm`` asks for on ``model``'s trainable parameters.

    Args:
        model: the model (its trainable parameters, for per-parameter thresholds).
        max_grad_norm: a threshold, or one per trainable parameter (a list in the order of
            ``model.parameters()``, or a dict by name).
        loss_reduction: ``"mean"`` or ``"sum"``.

    Raises:
        LeanpropValueError: a threshold that is not a positive finite number, thresholds that
            do not match the parameters, or another reduction.
    """
    if loss_reduction not in ("mean", "sum"):
        raise LeanpropValueError(
            f"clip_per_sample() got loss_reduction={loss_reduction!r}; allowed: 'mean' (the "
            "loss averages over the samples) or 'sum'. It tells how the loss reduces, so that "
            "each sample's own gradient is clipped."
        )
    if not isinstance(max_grad_norm, Sequence | Mapping) or isinstance(max_grad_norm, str):
        c = checked_number("clip_per_sample()", "max_grad_norm", max_grad_norm)
        return Clipping(c, None, loss_reduction)
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    if isinstance(max_grad_norm, Mapping):
        names = {k for k, _ in named}
        keys = list(max_grad_norm)
        unknown = [k if isinstance(k, str) else _shown(k) for k in keys if k not in names]
        missing = sorted(names - {k for k in keys if isinstance(k, str)})
        if unknown or missing:
            raise LeanpropValueError(
                "clip_per_sample() got per-parameter thresholds that do not match the model's "
                f"trainable parameters: unknown {sorted(map(str, unknown))}, missing {missing}. "
                "Give one threshold per trainable parameter name (model.named_parameters()), "
                "keyed by the name, not by the parameter."
            )
        per = {
            p: checked_number("clip_per_sample()", f"max_grad_norm[{k!r}]", max_grad_norm[k])
            for k, p in named
        }
    else:
        if len(max_grad_norm) != len(named):
            raise LeanpropValueError(
                f"clip_per_sample() got {len(max_grad_norm)} per-parameter thresholds for "
                f"{len(named)} trainable parameters; give one per parameter, in the order of "
                "model.parameters() (frozen ones left out), or a dict by parameter name."
            )
        per = {
            p: checked_number("clip_per_sample()", f"max_grad_norm[{i}]", c)
            for i, ((_, p), c) in enumerate(zip(named, max_grad_norm, strict=True))
        }
    return Clipping(None, per, loss_reduction)


def _shown(key: object) -> str:
    """A dict key that is not a name, for a message (a tensor: its kind and shape)."""
    if isinstance(key, torch.Tensor):
        return f"<{type(key).__name__} of shape {tuple(key.shape)}>"
    return repr(key)


def clip_per_sample(
    model: nn.Module,
    max_grad_norm: MaxGradNorm,
    *,
    loss_reduction: Literal["mean", "sum"] = "mean",
    conv_algorithm: ConvAlgorithm = "auto",
    max_workspace_mib: float | None = None,
    batch_dim: int = 0,
    batch_dims: Mapping[str | int, int | None] | None = None,
) -> PerSample:
    """Clip each sample's gradient during the backward passes run inside the context.

    With ``g_n`` the gradient of sample n's own loss (``N`` times its contribution for a
    mean-reduced loss), each backward adds to every trainable parameter's ``.grad``

        sum_n min(1, C / (||g_n|| + 1e-6)) g_n

    instead of ``sum_n g_n`` (or ``mean``): the clipped sum of DP-SGD, before noise
    (:class:`DPOptimizer` adds the noise and averages). ``||g_n||`` is the norm over the
    trainable parameters the backward accumulates into (flat clipping, ``max_grad_norm=C``),
    or over each parameter alone with its own threshold (per-parameter clipping). The
    ``1e-6`` is Opacus'. ``torch.autograd.grad`` inside the block returns the ordinary
    gradients and leaves ``.grad`` alone.

    One backward pass: the norms come from each layer's input and output gradient (closed
    forms), and each parameter's clipped gradient is then formed from the same two tensors
    with one of them scaled per sample (the smaller one, where either will do), so Linear,
    Conv, Embedding layers (and parameters used by linear/matmul/addmm ops, such as HF's
    ``Conv1D``) never hold the ``[N, *p.shape]`` individual gradients. Other parameters (norm
    layers, elementwise uses, modules that go through the ``torch.func`` fallback) do, one
    parameter at a time. The
    layers' inputs and output gradients are kept until the end of backward (about one more
    copy of the activations at that point). Several backward passes before a step add up
    (gradient accumulation over micro-batches), each through a forward of its own.

    Refused with a clear error, since each would be silently unprivate: a second backward
    through one forward (a sample would count twice), a ``.grad`` that holds a gradient the
    clipping did not leave, another hook that sees the gradient as it is accumulated (an
    optimizer stepping inside backward).

    Example:
        >>> import torch, leanprop
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> with leanprop.clip_per_sample(model, max_grad_norm=1.0) as clip:
        ...     torch.nn.functional.cross_entropy(model(x), y).backward()
        >>> clip.last_norms.shape  # each sample's gradient norm before clipping
        torch.Size([5])

    Args:
        model: any model :func:`leanprop.per_sample` supports. The model must not mix samples
            (BatchNorm in training mode is refused).
        max_grad_norm: the clipping threshold ``C`` (flat); or one threshold per trainable
            parameter, as a list in the order of ``model.parameters()`` or a dict by name.
        loss_reduction: how the loss reduces over the samples: ``"mean"`` or ``"sum"``.
        conv_algorithm, max_workspace_mib, batch_dim, batch_dims: as for
            :func:`leanprop.per_sample`.

    Returns:
        The context (reusable: enter it for each step). ``last_norms``: the per-sample
        gradient norms ``[N]`` over all parameters before clipping, of the last backward.

    Raises:
        LeanpropValueError: a bad threshold or reduction.
        UnsupportedModelError: a model wrapped in DistributedDataParallel (clip the model
            itself on each rank; see :class:`DPOptimizer`'s ``distributed``).
    """
    if not isinstance(model, nn.Module):
        raise LeanpropValueError(
            f"clip_per_sample() needs the model (an nn.Module) first, got {type(model).__name__}."
        )
    refuse_distributed(model, "clip_per_sample()", process_group=False)
    clipping = clipping_of(model, max_grad_norm, loss_reduction)
    ctx = PerSample(
        model,
        conv_algorithm=conv_algorithm,
        max_workspace_mib=max_workspace_mib,
        check=True,
        batch_dim=batch_dim,
        batch_dims=batch_dims,
    )
    ctx.set_clipping(clipping)
    return ctx
