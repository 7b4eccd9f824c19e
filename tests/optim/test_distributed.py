"""InBackward under torch.distributed: DDP and FSDP2, gloo backend, 2 CPU processes each; and
the torchrun example (examples/distributed_training.py).

Each test spawns fresh processes (tests/distributed.py); the worker bodies are module-level
functions so they can be pickled by name.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from leanprop import LeanpropValueError, UnsupportedModelError
from leanprop.optim import InBackward
from tests import distributed
from tests.distributed import TiedNet, same_on_all_ranks


def _in_backward_ddp_worker(rank, world_size):
    torch.manual_seed(0)
    model = TiedNet()
    ref = copy.deepcopy(model)
    ddp_ref = DDP(ref)  # ordinary DDP, default settings
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.004)  # ~a bucket per layer
    opt = InBackward(ddp.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1, ddp=ddp)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (plain, opt)]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    at_backward_start = []

    def probe(g):  # runs in backward before any bucket but the output layer's is filled
        at_backward_start.append(opt.ddp_bucket_bytes)
        return g

    for step in range(5):
        xs = torch.randn(2, 4, 6, generator=gen)
        micro = 2 if step == 3 else 1  # step 3 accumulates a micro-batch with no_sync()
        for m in range(micro):
            last = m == micro - 1
            with ddp_ref.no_sync() if not last else nullcontext():
                ddp_ref(xs[m]).square().mean().backward()
            with ddp.no_sync() if not last else nullcontext():
                ddp(xs[m], probe=probe).square().mean().backward()
        plain.step()
        plain.zero_grad()
        opt.step()  # no-op
        for s in scheds:
            s.step()
        for (k, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q), f"rank {rank}, step {step}, {k}"
            assert q.grad is None, f"rank {rank}, step {step}, {k}: gradient not freed"
        assert opt.ddp_bucket_bytes == 0  # bucket memory released between backward passes
        assert 0 < opt.ddp_bucket_peak_bytes <= total
    # when backward starts (activations at their peak) the buckets hold no memory but the
    # output layer's (its gradient is final first); not so in step 1, when DDP rebuilds them
    assert max(at_backward_start[2:]) < total / 4, (at_backward_start, total)
    assert same_on_all_ranks(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert opt.state_dict()["state"].keys() == plain.state_dict()["state"].keys()

    opt.remove()  # an ordinary optimizer again; DDP gets its buckets back
    x = torch.randn(4, 6, generator=gen)
    for d, o in ((ddp_ref, plain), (ddp, opt)):
        d(x).square().mean().backward()
        o.step()
        o.zero_grad()
    for (k, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), f"rank {rank}, after remove(), {k}"


def test_in_backward_under_ddp_bit_identical_and_buckets_freed():
    """Steps once each bucket is all-reduced; parameters equal ordinary DDP + AdamW after
    every step (scheduler, tied weight, a no_sync micro-batch); gradients and bucket memory
    are freed; remove() hands DDP back its buckets."""
    distributed.run(_in_backward_ddp_worker)


def _in_backward_ddp_errors_worker(rank, world_size):
    model = TiedNet()
    for kwargs, match in (
        ({}, "gradient_as_bucket_view=True"),
        ({"gradient_as_bucket_view": True, "find_unused_parameters": True},
         "find_unused_parameters=False"),
    ):  # fmt: skip
        with pytest.raises(LeanpropValueError, match=match):
            InBackward(model.parameters(), torch.optim.SGD, lr=0.1, ddp=DDP(model, **kwargs))
    ddp = DDP(model, gradient_as_bucket_view=True)
    with pytest.raises(LeanpropValueError, match="not the same set"):
        InBackward(model.mid.parameters(), torch.optim.SGD, lr=0.1, ddp=ddp)
    with pytest.raises(LeanpropValueError, match="DistributedDataParallel module"):
        InBackward(model.parameters(), torch.optim.SGD, lr=0.1, ddp=model)
    opt = InBackward(ddp.parameters(), torch.optim.SGD, lr=0.1, ddp=ddp)
    loss = ddp(torch.randn(2, 6)).sum()
    with pytest.raises(UnsupportedModelError, match="clipped_backward"):
        opt.clipped_backward(loss, 1.0)
    with pytest.raises(UnsupportedModelError, match="no_sync"), opt.accumulate():
        pass
    with pytest.raises(LeanpropValueError, match="not both"):
        InBackward(model.parameters(), torch.optim.SGD, lr=0.1, ddp=ddp, fsdp=model)
    opt.remove()


def test_in_backward_under_ddp_errors():
    distributed.run(_in_backward_ddp_errors_worker)


def _fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 32), nn.Tanh(),
        *[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)],
        nn.Linear(32, 3),
    )  # fmt: skip
    for block in list(model)[2:5]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit: first and last layers
    return model


def _in_backward_fsdp_worker(rank, world_size, clip):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    ref, model = _fsdp_model(mesh), _fsdp_model(mesh)
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = InBackward(model.parameters(), torch.optim.AdamW, lr=0.01, fsdp=model)
    calls = []
    step_bucket = opt.step_bucket

    def counted_step(params, *args, **kwargs):
        if params:  # (the end of backward steps what is left: nothing here)
            calls.append(len(params))
        return step_bucket(params, *args, **kwargs)

    opt.step_bucket = counted_step
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        x = torch.randn(4, 6, generator=gen)
        loss = ref(x).square().mean()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        plain.step()
        plain.zero_grad()
        calls.clear()
        loss = model(x).square().mean()
        if clip:
            opt.clipped_backward(loss, 0.05)
        else:
            loss.backward()
        assert calls == [2, 2, 2, 4], calls  # one call per unit: 3 blocks, then the root
        for (k, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.full_tensor()), f"rank {rank}, step {step}, {k}"
            assert q.grad is None
    opt.remove()


class _HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h):
        return torch.tanh(self.used(h))


def _half_used_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _HalfUsed(), nn.Linear(8, 3))
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_end_of_backward_worker(rank, world_size):
    """A unit with a parameter that gets no gradient is stepped at the end of each backward,
    and approximate clipping clips (both need the end-of-backward step, which FSDP2's sharded
    parameters reach through the post-accumulate hook only)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    model, ref = _half_used_model(mesh), _half_used_model(mesh)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1, fsdp=model)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(2):
        x = torch.randn(4, 6, generator=gen)
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        plain.step()
        plain.zero_grad()
        for (k, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.full_tensor()), f"rank {rank}, step {step}, {k}"
            assert q.grad is None, k
    opt.remove()
    clipped, free = _half_used_model(mesh), _half_used_model(mesh)
    opt_c = InBackward(clipped.parameters(), torch.optim.SGD, lr=0.1, fsdp=clipped,
                       clip_grad_norm=1e-3)  # fmt: skip
    opt_f = InBackward(free.parameters(), torch.optim.SGD, lr=0.1, fsdp=free)
    for _ in range(3):
        x = torch.randn(4, 6, generator=gen)
        clipped(x).square().mean().backward()
        free(x).square().mean().backward()
    assert opt_c.last_grad_norm is not None
    assert any(
        not torch.equal(p.full_tensor(), q.full_tensor())
        for p, q in zip(clipped.parameters(), free.parameters(), strict=True)
    ), "clip_grad_norm never clipped"
    opt_c.remove()
    opt_f.remove()


def test_in_backward_under_fsdp2_ends_each_backward():
    distributed.run(_fsdp_end_of_backward_worker)


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped_backward"])
def test_in_backward_under_fsdp2_steps_each_unit_once(clip):
    """FSDP2 (fully_shard, CPU mesh): one optimizer call per unit as soon as its gradients are
    reduce-scattered; parameters bit-identical to FSDP2 with the ordinary optimizer (also with
    exact clipping against clip_grad_norm_)."""
    distributed.run(_in_backward_fsdp_worker, clip)


def _approximate_clipping_ddp_worker(rank, world_size):
    torch.manual_seed(0)
    model = TiedNet()
    ref = copy.deepcopy(model)
    ddp_ref = DDP(ref)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.004)
    opt = InBackward(ddp.parameters(), torch.optim.SGD, lr=0.1, clip_grad_norm=0.01, ddp=ddp)
    gen = torch.Generator().manual_seed(100 + rank)
    coef = None
    for step in range(3):
        x = torch.randn(4, 6, generator=gen)
        ddp_ref(x).square().mean().backward()
        grads = [p.grad for p in ref.parameters()]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        if coef is not None:  # the rule: clip with the previous step's global norm
            torch._foreach_mul_(grads, coef)
        coef = torch.clamp(0.01 / (norm + 1e-6), max=1.0)
        plain.step()
        plain.zero_grad()
        ddp(x).square().mean().backward()
        assert torch.equal(opt.last_grad_norm, norm), f"rank {rank}, step {step}"
        for (k, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q), f"rank {rank}, step {step}, {k}"
    opt.remove()


def test_in_backward_under_ddp_approximate_clipping():
    """clip_grad_norm= under DDP uses the all-reduced gradients' global norm of the previous
    step, bit-identical to that rule applied by hand to ordinary DDP."""
    distributed.run(_approximate_clipping_ddp_worker)


def test_torchrun_example_runs():
    """examples/distributed_training.py under torchrun with 2 CPU processes."""
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "examples" / "distributed_training.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks hold identical weights after 6 steps" in done.stdout


def test_fsdp_argument_needs_a_sharded_model():
    model = TiedNet()
    with pytest.raises(LeanpropValueError, match="fully_shard"):
        InBackward(model.parameters(), torch.optim.SGD, lr=0.1, fsdp=model)


def _ddp_without_ddp_argument_worker(rank, world_size):
    torch.manual_seed(0)
    model = DDP(TiedNet())
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(UnsupportedModelError, match=r"without ddp=.*ddp=False"):
        model(torch.randn(4, 6)).square().mean().backward()
    opt.remove()
    own = TiedNet()  # not synchronised: each rank trains its own, as it says
    opt = InBackward(own.parameters(), torch.optim.SGD, lr=0.1, ddp=False)
    own(torch.randn(4, 6)).square().mean().backward()
    assert all(p.grad is None for p in own.parameters())  # stepped in backward
    opt.remove()


def test_ddp_without_the_ddp_argument_is_refused_not_stepped_with_local_gradients():
    """Under DDP without ddp=, the hooks stepped each rank's own gradient before DDP averaged
    it: every rank diverged from plain DDP, silently. Now a clear error (a trainer's step()
    gets the gradients held instead); ddp=False for parameters no DDP synchronises."""
    distributed.run(_ddp_without_ddp_argument_worker)


def _accelerate_ddp_worker(rank, world_size, ours, clip, out):
    import os

    accelerate = pytest.importorskip("accelerate")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # fmt: skip
    torch.manual_seed(0)
    model = TiedNet()
    if ours:
        opt = InBackward(model.parameters(), torch.optim.AdamW, lr=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(model, opt)
    assert isinstance(model, DDP)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(4, 6, generator=gen)).square().mean())
            if clip:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    torch.save([p.detach() for p in model.parameters()], f"{out}/{int(ours)}_{rank}.pt")
    if ours:
        opt.optimizer.remove()


@pytest.mark.parametrize("clip", [False, True], ids=["no-clipping", "clipping"])
def test_accelerate_ddp_trains_bit_identically(clip, tmp_path):
    """accelerate's prepare() wraps the model in DDP (2 CPU processes, gloo) after InBackward
    was built: the gradients are held for the loop's step() (DDP averages them after
    backward), bit-identical to the plain optimizer on every rank."""
    pytest.importorskip("accelerate")
    for ours in (False, True):
        distributed.run(_accelerate_ddp_worker, ours, clip, str(tmp_path))
    for rank in range(2):
        plain, ours = (torch.load(tmp_path / f"{k}_{rank}.pt") for k in (0, 1))
        assert all(torch.equal(a, b) for a, b in zip(plain, ours, strict=True))
