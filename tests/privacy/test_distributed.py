"""DP-SGD over two processes (gloo): each rank clips its half of the batch, the step adds the
ranks' clipped sums and the noise once; the result is the single-process step on the whole
batch with the same noise."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import leanprop

from ..distributed import run, same_on_all_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(24, 3)).double()


def _data():
    torch.manual_seed(1)
    return torch.randn(8, 2, 8, dtype=torch.float64), torch.randint(0, 3, (8,))


def _train(model, clip, opt, parts) -> None:
    for x, y in parts:  # two steps
        with clip:
            F.cross_entropy(model(x), y).backward()  # mean, as the clipping is told
        opt.step()
        opt.zero_grad()


def _options(rank_seed: int) -> dict:
    return {
        "noise_multiplier": 1.0, "expected_batch_size": 8,
        "generator": torch.Generator().manual_seed(rank_seed),
    }  # fmt: skip


def _worker(rank: int, world: int, expected: dict[str, torch.Tensor]) -> None:
    x, y = _data()
    torch.manual_seed(100 + rank)  # the replicas start apart: the optimizer broadcasts rank 0's
    model = _model() if rank == 0 else nn.Sequential(
        nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(24, 3)
    ).double()  # fmt: skip
    clip = leanprop.clip_per_sample(model, 0.5, loss_reduction="mean")
    opt = leanprop.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), clip, distributed=True,
        **_options(7 if rank == 0 else 99),
    )  # fmt: skip
    half = slice(rank * 4, rank * 4 + 4)
    xf, yf = x.flip(0), y.flip(0)
    # a mean-reduced loss over each rank's half: its contributions are its own samples' / 4,
    # clipping takes N=4 for them, the step averages by the 8 of the whole batch
    _train(model, clip, opt, [(x[half], y[half]), (xf[half], yf[half])])
    for k, q in model.named_parameters():
        assert torch.allclose(q, expected[k], rtol=1e-12, atol=1e-14), (rank, k)
    assert same_on_all_ranks(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert dist.get_world_size() == world


def test_two_ranks_give_the_single_process_step_with_the_noise_added_once():
    x, y = _data()
    ref = _model()
    clip = leanprop.clip_per_sample(ref, 0.5, loss_reduction="mean")
    opt = leanprop.DPOptimizer(torch.optim.SGD(ref.parameters(), lr=0.5), clip, **_options(7))
    _train(ref, clip, opt, [(x, y), (x.flip(0), y.flip(0))])  # the whole batch, one process
    run(_worker, {k: p.detach() for k, p in ref.named_parameters()})
