"""Per-sample quantities across the ranks of a data-parallel job.

Under ``DistributedDataParallel`` each rank runs :func:`leanprop.per_sample` on its own shard
of ``N_r`` samples, so after ``backward`` its quantities describe its shard only, scaled as
contributions to its *local* gradient. DDP then sets ``p.grad`` to the average of the ranks'
local gradients over the ``W`` ranks, so sample ``n`` of rank ``r`` contributes
``c_rn / W`` to it. :func:`all_reduce_quantities` turns every rank's quantities into those of
all ``N = sum_r N_r`` samples in that global convention:

* ``sum_grad_squared = sum_r sum_n (c_rn / W)²``: one all-reduce (sum), divided by ``W²``;
* ``variance = 1/N sum_rn (c_rn / W - m)²`` with ``m`` the global mean contribution: the
  ranks' centred sums of squares are combined with the spread of their means around ``m``
  (Chan et al.), never as ``E[c²] - E[c]²``; two all-reduces;
* ``grad_batch /= W`` and ``batch_l2 /= W²``: they stay per rank (gathering ``[N, *p.shape]``
  on every rank would cost ``W`` times the memory); their sum over all ranks is DDP's
  ``p.grad``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import LeanpropValueError, UnsupportedModelError
from .capture import PerSample
from .quantities import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance


def all_reduce_quantities(ctx: PerSample, group: dist.ProcessGroup | None = None) -> None:
    """Make the quantities of the last backward describe the samples of all ranks.

    Call it on every rank after ``backward``, inside the ``per_sample`` block (it needs the
    context's record of that backward). See the module docstring for the definitions.

    Example (on each rank of a ``torchrun`` job; ``examples/distributed_training.py``)::

        with leanprop.per_sample(model, SumGradSquared(), Variance()) as ps:
            ddp(x).square().mean().backward()
            leanprop.all_reduce_quantities(ps)  # p.variance: over all ranks' samples

    Args:
        ctx: the active context returned by ``leanprop.per_sample(...)``.
        group: the process group DDP averages over (default: the world).

    Raises:
        LeanpropValueError: no process group is initialised, ``ctx`` is not an active
            per-sample context, or no backward ran in it.
        UnsupportedModelError: the ranks hold quantities for different parameters.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise LeanpropValueError(
            "all_reduce_quantities() needs an initialised process group "
            "(torch.distributed.init_process_group); on a single process the quantities "
            "already describe the whole batch."
        )
    if not isinstance(ctx, PerSample) or not ctx.active:
        raise LeanpropValueError(
            "all_reduce_quantities() needs the active context of `with leanprop.per_sample(...) "
            f"as ctx:`, got {type(ctx).__name__}; call it inside that block, after backward."
        )
    if ctx.last_n is None:
        raise LeanpropValueError(
            "all_reduce_quantities(): no backward has run in this per_sample block yet."
        )
    kinds = ctx.kinds
    params = [p for p in ctx.model.parameters() if _carries(p, kinds)]
    world = dist.get_world_size(group)
    _check_same_parameters(params, group)
    with torch.no_grad():
        for p in params:
            if BatchGrad in kinds:
                p.grad_batch = p.grad_batch / world
            if BatchL2Grad in kinds:
                p.batch_l2 = p.batch_l2 / world**2
            if BatchDotGrad in kinds:  # (between this rank's samples)
                p.batch_dot = p.batch_dot / world**2
        if SumGradSquared in kinds:
            flat = _all_reduce_flat([p.sum_grad_squared for p in params], group)
            for p, total in zip(params, flat, strict=True):
                p.sum_grad_squared = total / world**2
        if Variance in kinds:
            _variance(ctx, params, world, group)


def _carries(p: Tensor, kinds: frozenset) -> bool:
    return all(hasattr(p, k.attr) for k in kinds)


def _check_same_parameters(params: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Every rank must reduce the same tensors in the same order (else collectives mismatch)."""
    mine = torch.tensor([len(params), sum(p.numel() for p in params)], dtype=torch.int64)
    mine = mine.to(_device(params))
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(theirs, mine, group=group)
    if any(not torch.equal(t, mine) for t in theirs):
        seen = sorted({tuple(t.tolist()) for t in theirs})
        raise UnsupportedModelError(
            "all_reduce_quantities(): the ranks hold quantities for different parameters "
            f"(count, elements per rank: {seen}). Every rank must run the same model and "
            "request the same quantities."
        )


def _device(params: list[Tensor]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


def _all_reduce_flat(tensors: list[Tensor], group: dist.ProcessGroup | None) -> list[Tensor]:
    """Sum each tensor over the ranks with one collective; returns new tensors."""
    if not tensors:
        return []
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]),
                                                tensors, strict=True)]  # fmt: skip


def _variance(
    ctx: PerSample, params: list[Tensor], world: int, group: dist.ProcessGroup | None
) -> None:
    """Chan's combination of the ranks' (count, mean, centred sum of squares)."""
    n = ctx.last_n or 0
    missing = [p for p in params if p not in ctx.last_sums]
    if missing:
        raise UnsupportedModelError(
            f"all_reduce_quantities(): {len(missing)} parameter(s) carry a variance without "
            "the sum of their individual gradients from the last backward; run forward and "
            "backward again inside this per_sample block before calling it."
        )
    # contributions to DDP's gradient are c / W: local sum / W and local M2 / W²
    sums = [ctx.last_sums[p].detach() / world for p in params]
    m2 = [torch.nan_to_num(p.variance.detach(), nan=0.0) * (n / world**2) for p in params]
    count = torch.tensor([float(n)], dtype=sums[0].dtype, device=sums[0].device)
    reduced = _all_reduce_flat([count, *sums], group)
    total_n, global_sums = reduced[0].item(), reduced[1:]
    local_mean_weight = 1.0 / n if n else 0.0
    spread = []
    for s, g, m in zip(sums, global_sums, m2, strict=True):
        delta = s * local_mean_weight - g / total_n if total_n else torch.zeros_like(s)
        spread.append(m + n * delta.square())  # this rank's M2 around the global mean
    for p, total in zip(params, _all_reduce_flat(spread, group), strict=True):
        p.variance = total / total_n if total_n else torch.full_like(total, float("nan"))
