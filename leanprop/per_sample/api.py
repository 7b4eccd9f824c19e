"""Public entry point for per-sample quantities."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .capture import ConvAlgorithm, PerSample
from .quantities import Quantity


def per_sample(
    model: nn.Module,
    *quantities: Quantity,
    conv_algorithm: ConvAlgorithm = "auto",
    max_workspace_mib: float | None = None,
    check: bool = True,
    batch_dim: int = 0,
    batch_dims: Mapping[str | int, int | None] | None = None,
) -> PerSample:
    """Compute per-sample quantities during the backward passes run inside the context.

    Run the forward pass *and* ``backward`` inside the ``with`` block. When each backward pass
    ends, every trainable parameter that received a gradient carries the requested quantities
    as attributes (``grad_batch``, ``batch_l2``, ``sum_grad_squared``, ``variance``); see
    ``leanprop/per_sample/quantities.py`` for the definitions and the mean/sum scaling. Each
    backward replaces the previous results.

    Example:
        >>> import torch, leanprop
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> x, y = torch.randn(5, 3), torch.randn(5, 2)
        >>> with leanprop.per_sample(model, leanprop.BatchGrad(), leanprop.Variance()):
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        >>> model[0].weight.grad_batch.shape  # [N, O, I]
        torch.Size([5, 2, 3])

    Args:
        model: any module graph (residual connections, modules called several times, sequence
            inputs ``[N, T, ...]``). Linear, Conv1d/2d/3d, Embedding, LayerNorm and GroupNorm use
            closed-form rules; a parameter used directly in any other op is captured at that
            op (closed forms for linear/matmul/addmm and elementwise uses, else a batched
            vector-Jacobian product of the op); RNNs go through a ``torch.func`` fallback.
            Frozen parameters (``requires_grad=False``) are skipped.
        *quantities: instances of ``BatchGrad``, ``BatchL2Grad``, ``BatchDotGrad``,
            ``SumGradSquared``, ``Variance``. None: the forward is recorded for
            :func:`leanprop.ggn` (curvature) and backward computes nothing extra.
        conv_algorithm: individual weight gradients of convolutions: ``"unfold"`` (im2col),
            ``"grouped"`` (Rochette et al. 2019, no im2col buffer), ``"weight_backward"`` (the
            backend's weight-gradient kernel on one convolution grouped by sample, no im2col
            buffer) or ``"auto"``: a layer shape's first calls try those whose scratch memory
            fits ``max_workspace_mib`` in turn (three calls each, timed as they run, their
            results used), then keep the fastest (for this process). All are exact; they
            differ in rounding, so pick one for bit-reproducible runs.
        max_workspace_mib: scratch memory per layer; samples are processed in chunks so that
            a layer's temporary buffers stay below it (the results themselves are not bounded).
            Default: 16 MiB on CPU, 64 MiB on GPUs.
        check: after each backward, verify that the individual gradients add up to the batch
            gradient autograd computed, and raise if not (a use of a parameter that escaped
            the hooks). One host synchronisation per backward.
        batch_dim: the dimension of the model's input tensors that holds the samples (0 for
            ``[N, ...]``, 1 for sequence-first ``[T, N, ...]``). From there leanprop follows the
            batch op by op, so a rule always knows which dimension of its input holds the
            samples (another dimension of the same size is never taken for it), and a
            parameter whose output is broadcast over the batch (a position embedding looked up
            with ``arange(T)``) gets its exact per-sample contributions.
        batch_dims: per-input exceptions, by argument name or position: ``{"src_key_padding_mask":
            0}`` for a batch-first mask of a sequence-first model, ``None`` for an input without
            batch.

    Returns:
        The context manager; it removes every hook and releases every captured tensor on
        exit, also on exceptions.

    Raises:
        LeanpropValueError: unknown quantity or option.
        BatchError: an input without batch dimension, modules seeing different batch sizes, or
            a module whose input lost track of the samples (e.g. samples flattened together).
        UnsupportedModelError: BatchNorm in training mode, or a failed sum check.

    ``loss.backward(create_graph=True)`` makes the quantities differentiable.
    """
    return PerSample(
        model,
        *quantities,
        conv_algorithm=conv_algorithm,
        max_workspace_mib=max_workspace_mib,
        check=check,
        batch_dim=batch_dim,
        batch_dims=batch_dims,
    )
