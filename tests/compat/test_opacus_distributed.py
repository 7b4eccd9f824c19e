"""The Opacus facade data parallel over two processes (gloo): the model wrapped in
``DifferentiallyPrivateDistributedDataParallel`` (the facade's or Opacus' own), each rank's
loader taking its share; the same steps as one process on the whole batch with the same noise,
and Opacus' own distributed loop's parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from leanprop import UnsupportedModelError
from leanprop.compat.opacus import DPDDP, PrivacyEngine
from leanprop.privacy.sampling import PoissonBatchSampler

from ..distributed import run, same_on_all_ranks
from .test_opacus import _Net

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),  # (Opacus' hooks)
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Optimal order is the"),
]


def _data():
    torch.manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randint(0, 20, (16, 5)), torch.randint(0, 3, (16,)))


def _loop(engine, model, loader, noise: float, seed: int, wrap=None):
    """Two epochs of an Opacus loop; returns the trained parameters."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    module = model if wrap is None else wrap(model)
    module, optimizer, loader = engine.make_private(
        module=module, optimizer=optimizer, data_loader=loader, noise_multiplier=noise,
        max_grad_norm=0.3, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(module(x), y).backward()
            optimizer.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _net(seed: int) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _worker(rank: int, world: int, single: dict, opacus_single: dict) -> None:
    data = _data()
    # each rank's share of each batch of 8: the single process's batch (rank 0: even indices)
    sampler = torch.utils.data.DistributedSampler(data, world, rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    # the replicas start apart: DPDDP broadcasts rank 0's parameters
    ours = _loop(PrivacyEngine(), _net(0 if rank == 0 else 5), loader, 1.0,
                 seed=7 if rank == 0 else 99, wrap=DPDDP)  # fmt: skip
    for k, p in ours.items():  # rank 0's noise only, once
        assert torch.allclose(p, single[k], rtol=1e-5, atol=1e-6), (rank, k)
    assert same_on_all_ranks(torch.cat([p.flatten() for p in ours.values()]))
    opacus = pytest.importorskip("opacus")
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as TheirDPDDP

    theirs = _loop(opacus.PrivacyEngine(), _net(0), loader, 0.0, seed=1, wrap=TheirDPDDP)
    mine = _loop(PrivacyEngine(), _net(0), loader, 0.0, seed=1, wrap=TheirDPDDP)
    for k in theirs:  # Opacus' own wrapper works with the facade, and agrees with Opacus
        assert torch.allclose(mine[k], theirs[k], rtol=1e-5, atol=1e-6), (rank, k)
        assert torch.allclose(mine[k], opacus_single[k], rtol=1e-5, atol=1e-6), (rank, k)
    with pytest.raises(UnsupportedModelError, match="DifferentiallyPrivateDistributedDataParallel"):
        PrivacyEngine().make_private(
            module=_net(0), optimizer=torch.optim.SGD(_net(0).parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        )  # fmt: skip
    assert dist.get_world_size() == world


def test_two_ranks_give_the_single_process_steps_with_the_noise_added_once():
    data = _data()
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    single = _loop(PrivacyEngine(), _net(0), loader, 1.0, seed=7)
    opacus_single = _loop(PrivacyEngine(), _net(0), loader, 0.0, seed=1)
    run(_worker, single, opacus_single)


def test_poisson_shares_of_the_ranks_make_one_poisson_batch():
    """Each rank samples its own share of the indices; together every index once per draw."""
    shares = [PoissonBatchSampler(10, 1.0, steps=2, rank=r, world_size=3) for r in range(3)]
    for batches in zip(*shares, strict=True):
        assert sorted(i for b in batches for i in b) == list(range(10))
    with pytest.raises(Exception, match="range\\(world_size\\)"):
        PoissonBatchSampler(10, 0.5, rank=3, world_size=3)


def _poisson_worker(rank: int, world: int) -> None:
    data = _data()
    torch.manual_seed(0)  # every rank seeded alike, as scripts do
    model = _net(0)
    _, _, loader = PrivacyEngine().make_private(
        module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=True,
    )  # fmt: skip
    sampler = loader.batch_sampler
    masks = torch.stack([torch.isin(sampler.shard, torch.tensor(b, dtype=torch.long))
                         for b in sampler])  # fmt: skip
    gathered = [torch.empty_like(masks) for _ in range(world)]
    dist.all_gather(gathered, masks)
    assert not torch.equal(gathered[0], gathered[1])  # each rank draws its own inclusions


def test_poisson_sampling_draws_differ_between_ranks_seeded_alike():
    run(_poisson_worker)


def _one_rank_worker(rank: int, world: int) -> None:
    model = _net(0)
    loader = torch.utils.data.DataLoader(_data(), batch_size=8)
    PrivacyEngine().make_private(  # (a group of one: as one process, as with Opacus)
        module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
    )  # fmt: skip


def test_a_process_group_of_one_rank_is_one_process():
    run(_one_rank_worker, world_size=1)
