"""Run a test body in several processes joined by a gloo process group (CPU), and the
model the distributed tests (tests/per_sample and tests/optim) train."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from leanprop import transform_grad


def run(worker: Callable[..., None], *args: Any, world_size: int = 2) -> None:
    """Call ``worker(rank, world_size, *args)`` in ``world_size`` fresh processes.

    ``worker`` must be a module-level function (it is pickled by name). A failure in any
    process is re-raised here with that process's traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_entry, args=(worker, world_size, init, args), nprocs=world_size, join=True)


def _entry(rank: int, worker: Callable[..., None], world_size: int, init: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        worker(rank, world_size, *args)
        gc.collect()  # DDP modules and their hooks go before the process group they use
        dist.barrier()
    finally:
        dist.destroy_process_group()


def same_on_all_ranks(t: torch.Tensor) -> bool:
    """Whether every rank holds a bit-identical ``t``."""
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


class TiedNet(nn.Module):
    """Every parameter gets a gradient each step (DDP's default needs that); one is used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 32)
        self.mid = nn.Linear(32, 32)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(5)]
        )
        self.out = nn.Linear(32, 3)

    def forward(self, x, probe=None):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h))))  # mid used twice
        h = self.blocks(h)
        return self.out(h if probe is None else transform_grad(h, probe))
