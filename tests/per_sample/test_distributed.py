"""per_sample under torch.distributed: each rank's quantities under DDP, and
all_reduce_quantities combining them into those of all samples (gloo backend, 2 CPU processes).

Each test spawns fresh processes (tests/distributed.py); the worker bodies are module-level
functions so they can be pickled by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from leanprop import LeanpropValueError, UnsupportedModelError
from tests import distributed
from tests.distributed import TiedNet


def _shard(rank):
    gen = torch.Generator().manual_seed(200 + rank)
    n = 3 + 2 * rank  # uneven shards: 3 and 5 samples
    return torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=gen
    )


def _ce(out, y, reduction):
    return nn.functional.cross_entropy(out, y, reduction=reduction)


def _per_sample_ddp_worker(rank, world_size):
    import leanprop
    from leanprop import BatchGrad, BatchL2Grad, SumGradSquared, Variance
    from leanprop.testing import individual_gradients, quantities_from_individual
    from tests.helpers import assert_close

    torch.manual_seed(0)
    model = TiedNet().double()
    oracle_model = copy.deepcopy(model)
    ddp = DDP(model)
    x, y = _shard(rank)
    with leanprop.per_sample(ddp, BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()) as ps:
        _ce(ddp(x), y, "mean").backward()
        local = {k: p.variance.clone() for k, p in model.named_parameters()}
        leanprop.all_reduce_quantities(ps)
    # oracle: every sample of every rank, contributing c / W to DDP's averaged gradient
    shards = [individual_gradients(oracle_model, _ce, *_shard(r)) for r in range(world_size)]
    for k, p in model.named_parameters():
        everything = torch.cat([s[k] for s in shards]) / world_size
        want = quantities_from_individual(everything)
        mine = shards[rank][k] / world_size
        assert_close(p.grad_batch, mine, f"rank {rank} {k} grad_batch", 1e-9, 1e-12)
        assert_close(p.batch_l2, mine.flatten(1).square().sum(1), f"{k} batch_l2", 1e-9, 1e-14)
        for attr in ("sum_grad_squared", "variance"):
            assert_close(getattr(p, attr), want[attr], f"rank {rank} {k} {attr}", 1e-9, 1e-14)
        want_local = quantities_from_individual(shards[rank][k])["variance"]
        assert_close(local[k], want_local, f"rank {rank} {k} local variance", 1e-9, 1e-14)
        summed = p.grad_batch.sum(0)
        dist.all_reduce(summed)
        assert_close(summed, p.grad, f"rank {rank} {k}: grad_batch over ranks vs DDP", 1e-9, 1e-14)


def test_per_sample_under_ddp_and_all_reduce_quantities():
    """Each rank computes its own shard's quantities (uneven shards); all_reduce_quantities
    makes them those of all samples (float64 oracle: a per-sample loop over every shard)."""
    distributed.run(_per_sample_ddp_worker)


def _all_reduce_errors_worker(rank, world_size):
    import leanprop
    from leanprop import SumGradSquared

    model = TiedNet()
    with pytest.raises(LeanpropValueError, match="active context"):
        leanprop.all_reduce_quantities(model)
    if rank == 0:
        model.out.weight.requires_grad_(False)  # rank 0 tracks fewer parameters
    with leanprop.per_sample(model, SumGradSquared()) as ps:
        with pytest.raises(LeanpropValueError, match="no backward"):
            leanprop.all_reduce_quantities(ps)
        model(torch.randn(2, 6)).sum().backward()
        with pytest.raises(UnsupportedModelError, match="different parameters"):
            leanprop.all_reduce_quantities(ps)


def test_all_reduce_quantities_errors():
    distributed.run(_all_reduce_errors_worker)


def test_all_reduce_quantities_needs_a_process_group():
    import leanprop
    from leanprop import Variance

    model = TiedNet()
    with leanprop.per_sample(model, Variance()) as ps:
        model(torch.randn(2, 6)).sum().backward()
        with pytest.raises(LeanpropValueError, match="process group"):
            leanprop.all_reduce_quantities(ps)
