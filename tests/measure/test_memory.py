"""The peak-memory tracker counts exactly the tensor bytes of known allocations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import leanprop
from leanprop import LeanpropValueError, track_memory


def test_peak_of_known_allocations_is_exact():
    with track_memory() as mem:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500, dtype=torch.float64)  # 4000 B -> 8000 live
        del a
        c = torch.empty(250)  # 1000 B -> 5000 live
        d = torch.ones(3000, dtype=torch.uint8)  # 3000 B -> 8000 live again
    assert mem.peak_bytes == 8000
    del b, c, d


def test_current_bytes_counts_what_is_alive_now():
    with track_memory() as mem:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500)  # 2000 B
        assert mem.current_bytes == 6000
        del a
        assert mem.current_bytes == 2000
    assert mem.peak_bytes == 6000
    with pytest.raises(LeanpropValueError, match="inside the block"):
        mem.current_bytes  # noqa: B018
    del b


def test_views_inplace_and_preexisting_are_not_counted():
    x = torch.randn(100, 100)  # 40000 B, pre-existing
    with track_memory(existing=[x]) as mem:
        v = x.view(-1)  # view: 0
        x.add_(1)  # in-place: 0
        t = x.t()  # view: 0
        w = x * 2  # new: 40000
        del w
        u = t.contiguous()  # new: 40000 (w already freed)
    assert mem.peak_bytes == 40000
    del v, u


def test_preexisting_registration_covers_modules():
    model = nn.Linear(10, 10)
    with track_memory(existing=[model]) as mem:
        model.weight.data.mul_(1.0)
        model.weight.detach()
    assert mem.peak_bytes == 0


def test_freed_memory_inside_a_training_step():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    x = torch.randn(64, 256)
    with track_memory(existing=[model, x]) as mem:
        model(x).sum().backward()
    grads = sum(p.numel() * 4 for p in model.parameters())
    activations = 64 * 256 * 4  # the hidden layer, at least
    assert mem.peak_bytes >= grads + activations
    assert mem.peak_mib == mem.peak_bytes / 2**20


def test_per_sample_scratch_kept_between_steps_is_counted_in_each_step():
    """per_sample keeps its CPU scratch buffers from one backward for the next: a step
    measured after another must count them (they were hidden, and the benchmarks reported
    BatchL2Grad at the plain step's peak where it held a chunk of individual gradients)."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    x = torch.randn(32, 64, 64)  # (long sequences: the individual weight gradients are formed)

    def step() -> int:
        with (
            track_memory(existing=[model, x]) as mem,
            leanprop.per_sample(model, leanprop.BatchL2Grad()),
        ):
            model(x).square().sum().backward()
        for p in model.parameters():
            p.grad = None
        return mem.peak_bytes

    first, second = step(), step()
    scratch = 32 * 128 * 64 * 4  # one layer's individual weight gradients, one chunk
    assert first >= scratch
    assert second == first


def test_bad_device():
    with pytest.raises(LeanpropValueError, match=r"got device 'meta'"):
        track_memory("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_gpu():
    with pytest.raises(LeanpropValueError, match="no CUDA device"):
        track_memory("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_of_known_allocation():
    with leanprop.track_memory("cuda") as mem:
        a = torch.empty(2**20, device="cuda")  # 4 MiB, a multiple of the allocator's blocks
        del a
    assert mem.peak_bytes == 4 * 2**20


def test_storage_grown_by_resize_or_out_is_counted():
    """resize_ and results written through out= into empty tensors (were 40 bytes and 0)."""
    a, b = torch.randn(100, 100), torch.randn(100, 100)
    with track_memory(existing=[a, b]) as mem:
        t = torch.empty(0)
        t.resize_(100_000)  # 400 kB
    assert mem.peak_bytes == 400_000
    with track_memory(existing=[a, b]) as mem:
        out = torch.empty(0)
        torch.mm(a, b, out=out)  # 40 kB written into it
    assert mem.peak_bytes == 40_000
    del t, out


@pytest.mark.parametrize("device", [123, None, 1.5])
def test_device_must_be_a_string_or_device(device):
    with pytest.raises(LeanpropValueError, match=r"string or torch\.device"):
        track_memory(device)
