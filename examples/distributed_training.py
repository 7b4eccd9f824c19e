"""Data-parallel training with leanprop: DDP, the optimizer stepped inside backward, an eager
side loss and the gradient variance over all ranks' samples.

Run (CPU processes with gloo, or one GPU per process with NCCL):

    torchrun --nproc-per-node 2 examples/distributed_training.py

Each rank trains on its own shard. In every backward pass, DDP all-reduces each bucket of
gradients; as soon as a bucket is averaged, AdamW steps its parameters and the bucket's memory
is released (``InBackward(..., ddp=ddp)``). A decorrelation penalty on the hidden features is
differentiated during forward (``side_loss``), so its [N, N] intermediates never wait for the
main backward. Every few steps, ``per_sample`` measures the gradient noise: each rank computes
the variance of its samples' gradients, and ``all_reduce_quantities`` combines them into the
variance over all samples of all ranks.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import leanprop
from leanprop import Variance


def decorrelation(h: torch.Tensor) -> torch.Tensor:
    """Parameter-free penalty with an [N, N] intermediate: similarity between samples."""
    z = nn.functional.normalize(h, dim=1)
    return (z @ z.T - torch.eye(len(h), device=h.device)).square().mean()


class Net(nn.Module):
    def __init__(self, d_in: int = 32, d: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = leanprop.side_loss(self.body(x), decorrelation, weight=0.1)
        return self.head(h)


def main(steps: int = 6, batch: int = 64) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)  # the same initial model on every rank
    model = Net().to(device)
    ddp = DDP(model, gradient_as_bucket_view=True)  # InBackward(ddp=) needs bucket views
    opt = leanprop.InBackward(ddp.parameters(), torch.optim.AdamW, lr=1e-3, ddp=ddp)
    gen = torch.Generator().manual_seed(rank)  # each rank its own shard
    try:
        for step in range(steps):
            x = torch.randn(batch, 32, generator=gen).to(device)
            y = torch.randint(0, 10, (batch,), generator=gen).to(device)
            if step % 3 == 2:  # measure gradient noise on this step
                with leanprop.per_sample(ddp, Variance()) as ps:
                    nn.functional.cross_entropy(ddp(x), y).backward()  # all-reduce + step
                    leanprop.all_reduce_quantities(ps)
                    noise = sum(p.variance.sum() for p in model.parameters())
                if rank == 0:
                    print(f"step {step}: total gradient variance over {world * batch} samples "
                          f"{noise:.3e}")  # fmt: skip
            else:
                loss = nn.functional.cross_entropy(ddp(x), y)
                loss.backward()  # all-reduce + AdamW step per bucket; gradients freed
                if rank == 0:
                    print(f"step {step}: loss {loss.item():.4f}")
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        copies = [torch.empty_like(weights) for _ in range(world)]
        dist.all_gather(copies, weights)
        if not all(torch.equal(c, weights) for c in copies):
            raise RuntimeError("the ranks' models diverged")
        if rank == 0:
            print(f"{world} ranks hold identical weights after {steps} steps")
    finally:
        opt.remove()
        # DDP keeps its process group in a reference cycle: free both now, so the group's
        # communication threads are joined before Python shuts down (else a thread can still
        # release a tensor while the interpreter exits, and the process aborts)
        del ddp, opt, model
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
