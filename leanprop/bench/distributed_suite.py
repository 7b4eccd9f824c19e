"""Optimizer step inside backward under DistributedDataParallel.

Two processes with gloo on CPU (one per GPU with NCCL on CUDA) train the GPT-2-like model of
the ``in-backward`` suite with AdamW, each on its own data:

* ``ddp``: ordinary DDP (default settings; a communication hook that averages exactly as DDP's
  default does notes the bucket storages), ``backward(); step(); zero_grad()``;
* ``ddp bucket-view``: the same with ``gradient_as_bucket_view=True`` (no separate ``.grad``);
* ``leanprop``: ``InBackward(..., ddp=ddp)``: each bucket stepped once all-reduced, its memory
  released between uses.

Time: median (and min) seconds per training step on rank 0, ratios to ``ddp``. Memory:
on CUDA the allocator's peak above the parameters; on CPU, where no tracker sees DDP's internal
buffers, the gradient bytes read from the storages themselves: DDP's buckets plus any separate
``.grad`` (the most at once), and the bucket bytes held when backward starts (when the
activations peak; leanprop's buckets are all held only for a moment at the end of backward,
when the activations are gone). DDP buckets are ``BUCKET_MB`` of the ``in-backward`` suite.
``agrees``: the parameters equal ordinary DDP's exactly after the timed steps.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import leanprop

from .in_backward_suite import BUCKET_MB, LM, SIZES

WORLD = 2


def run(device: str = "cpu", batches: tuple[int, ...] = (), reps: int = 5) -> list[dict]:
    """Rows from rank 0 of a fresh process group; ``batches`` is unused (kept for the CLI)."""
    world = torch.cuda.device_count() if device == "cuda" else WORLD
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_worker, args=(world, init, device, reps, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def _worker(rank: int, world: int, init: str, device: str, reps: int, out: str) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        rows = _measure(rank, device, reps)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        gc.collect()  # DDP holds the process group in a reference cycle: free it first
        dist.destroy_process_group()


VARIANTS = ("ddp", "ddp bucket-view", "leanprop")


class _Trainer:
    """One variant: its model, DDP wrapper and optimizer, and what a probe saw."""

    def __init__(self, name: str, size: str, dev: torch.device) -> None:
        cfg = SIZES[size]
        kernel = {"fused": True} if dev.type == "cuda" else {}
        torch.manual_seed(0)
        self.name = name
        self.model = LM(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"]).to(dev)
        self.ddp = DDP(
            self.model, gradient_as_bucket_view=name != "ddp", bucket_cap_mb=BUCKET_MB[size]
        )
        self.buckets = _BucketProbe()
        if name == "leanprop":
            self.opt: Any = leanprop.InBackward(
                self.ddp.parameters(), torch.optim.AdamW, lr=1e-3, ddp=self.ddp, **kernel
            )
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, **kernel)
            self.ddp.register_comm_hook(self.buckets, _BucketProbe.hook)
        self.at_start = 0  # bucket bytes held when the last backward started
        self.grad_peak = 0  # gradient bytes (buckets + separate .grad), most at once

    def _probe(self, g: torch.Tensor) -> torch.Tensor:
        if self.name == "leanprop":
            self.at_start = self.opt.ddp_bucket_bytes
        else:
            self.at_start = self.buckets.held()
        return g

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        logits = leanprop.transform_grad(self.ddp(x), self._probe)
        nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        if self.name == "leanprop":
            held = self.opt.ddp_bucket_peak_bytes
        else:  # DDP's buckets, plus .grad tensors that are not views of them
            held = self.buckets.held() + self.buckets.separate_grad_bytes(self.model)
        self.grad_peak = max(self.grad_peak, held)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> torch.Tensor:
        if self.name == "leanprop":
            self.opt.remove()
        return torch.cat([p.detach().flatten() for p in self.model.parameters()])


def _measure(rank: int, device: str, reps: int) -> list[dict]:
    size = "small_b1" if device == "cpu" else "gpt2m_b1"
    cfg = SIZES[size]
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(1 + rank)
    steps = reps + 1  # one warm-up step
    data = torch.randint(0, cfg["vocab"], (steps, 2, cfg["batch"], cfg["seq"]), generator=gen)
    data = data.to(dev)
    rows: dict[str, dict[str, Any]] = {}
    # memory: one variant at a time, two steps (the second after DDP rebuilt its buckets)
    for name in VARIANTS:
        trainer = _Trainer(name, size, dev)
        trainer.step(data[0, 0], data[0, 1])
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        trainer.step(data[1, 0], data[1, 1])
        _sync(dev)
        peak = trainer.grad_peak
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev) - base
        rows[name] = {
            "method": f"{size} x{dist.get_world_size()}: {name}",
            "batch": cfg["batch"],
            "peak_mib": peak / 2**20,
            "buckets_at_backward_start_mib": trainer.at_start / 2**20,
        }
        trainer.close()
        del trainer
    # time: all variants side by side, one step each per round; the same data, so the
    # parameters must end up identical
    trainers = [_Trainer(name, size, dev) for name in VARIANTS]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for s in range(steps):
        for t in trainers:
            _sync(dev)
            t0 = time.perf_counter()
            t.step(data[s, 0], data[s, 1])
            _sync(dev)
            if s:
                times[t.name].append(time.perf_counter() - t0)
    finals = {t.name: t.close() for t in trainers}
    for name, row in rows.items():
        row["median_s"] = statistics.median(times[name])
        row["min_s"] = min(times[name])
        row["extra"] = f"buckets at backward start {row['buckets_at_backward_start_mib']:.1f} MiB"
    base_row = rows["ddp"]
    out = []
    for name, row in rows.items():
        row["time_ratio"] = row["median_s"] / base_row["median_s"]
        row["min_ratio"] = row["min_s"] / base_row["min_s"]
        row["mem_ratio"] = row["peak_mib"] / base_row["peak_mib"] if base_row["peak_mib"] else None
        if name != "ddp":
            row["agrees"] = bool(torch.equal(finals[name], finals["ddp"]))
        out.append(row)
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()


class _BucketProbe:
    """DDP's default averaging as a communication hook that also notes the bucket storages."""

    def __init__(self) -> None:
        self.storages: dict[int, torch.UntypedStorage] = {}

    def held(self) -> int:
        return sum(s.nbytes() for s in self.storages.values())

    def separate_grad_bytes(self, model: nn.Module) -> int:
        """Bytes of ``.grad`` tensors that are not views of a bucket."""
        ours = {s.data_ptr() for s in self.storages.values()}
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return sum(g.untyped_storage().nbytes() for g in grads
                   if g.untyped_storage().data_ptr() not in ours)  # fmt: skip

    # no annotations: DDP refuses a hook whose bucket is annotated other than dist.GradBucket
    def hook(self, bucket):
        buffer = bucket.buffer()
        self.storages[bucket.index()] = buffer.untyped_storage()
        buffer.mul_(1.0 / dist.get_world_size())
        fut = dist.all_reduce(buffer, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
