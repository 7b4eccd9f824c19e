"""side_loss(offload=True): stored gradients parked in host memory and fetched back one ahead
in backward, bit-identical to the combined loss (simulated on CPU, real on CUDA)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from leanprop import LeanpropValueError, side_loss

from .helpers import build, grads, objective, step


@pytest.fixture
def simulated_offload(monkeypatch):
    """CPU tensors take the offload path, with copies instead of CUDA transfers; returns the
    log of transfers and weak references to the gradients that were moved out."""
    from leanprop.side_losses import offload as _offload

    log, moved_out = [], []

    def to_host(grads, device, after):
        assert after == "complete"
        log.append("to_host")
        moved_out.extend(weakref.ref(g) for g in grads if g is not None)
        return [None if g is None else g.clone() for g in grads], "host-copy"

    def to_device(host, device, after):
        assert after == "host-copy"
        log.append("to_device")
        return [None if h is None else h.clone() for h in host], "device-copy"

    def ready(grads, device, done):
        assert done == "device-copy"
        log.append("ready")

    monkeypatch.setattr(_offload, "MOVED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(_offload, "mark", lambda device: "complete")
    monkeypatch.setattr(_offload, "copy_to_host", to_host)
    monkeypatch.setattr(_offload, "copy_to_device", to_device)
    monkeypatch.setattr(_offload, "ready_here", ready)
    return log, moved_out


def test_offload_parks_all_but_the_newest_and_fetches_one_ahead(simulated_offload):
    log, moved_out = simulated_offload
    x = torch.randn(5, 6)
    a, b = build(), build()
    step(a, x, eager=False)
    loss = objective(b, x, eager=True, offload=True)
    # three side losses: the first two left for host memory, the newest stays
    assert log == ["to_host", "to_host"]
    gc.collect()
    assert moved_out and all(r() is None for r in moved_out), "moved gradients still held"
    loss.backward()
    # the backward takes the newest as it is, fetching the second one ahead, and so on
    assert log == ["to_host", "to_host", "to_device", "ready", "to_device", "ready"]
    for k, g in grads(a).items():
        assert torch.equal(g, grads(b)[k]), k


def test_offload_taken_out_of_order_or_abandoned(simulated_offload):
    log, _ = simulated_offload
    x1, x2 = torch.randn(2, 5, 6)
    a, b = build(), build()
    objective(b, x1, eager=True, offload=True)  # a forward without backward: freed
    gc.collect()
    log.clear()
    first = objective(b, x1, eager=True, offload=True)
    second = objective(b, x2, eager=True, offload=True)  # parks the first one's newest too
    assert log.count("to_host") == 5
    first.backward()  # its newest was moved out: fetched when taken
    second.backward()
    for x in (x1, x2):
        step(a, x, eager=False)
    for k, g in grads(a).items():
        assert torch.equal(g, grads(b)[k]), k


def test_offload_is_a_no_op_for_cpu_tensors():
    x = torch.randn(5, 6)
    a, b = build(), build()
    step(a, x, eager=False)
    step(b, x, eager=True, offload=True)
    for k, g in grads(a).items():
        assert torch.equal(g, grads(b)[k]), k
    with pytest.raises(LeanpropValueError, match="offload="):
        side_loss(x, lambda t: t.sum(), offload="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda_is_exact_and_frees_device_memory():
    torch.manual_seed(0)
    x = torch.randn(512, 128, device="cuda")
    combined, plain, moved = (build(layers=3, d=128).cuda() for _ in range(3))
    for _ in range(3):  # several steps: pinned buffers and streams are reused
        for model in (combined, plain, moved):
            model.zero_grad(set_to_none=True)
        step(combined, x, eager=False)
        step(plain, x, eager=True)
        step(moved, x, eager=True, offload=True)
        for k, g in grads(combined).items():
            assert torch.equal(g, grads(plain)[k]), k
            assert torch.equal(g, grads(moved)[k]), k
    # at the end of forward only the newest side loss's gradients stay on the GPU
    parked = {}
    for name, offload in (("kept", False), ("moved", True)):
        moved.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = objective(moved, x, eager=True, offload=offload)
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # lets the allocator free blocks whose copies are done
        parked[name] = torch.cuda.memory_allocated() - before
        loss.backward()
        del loss
    stored = sum(p.numel() * 4 for p in moved[1][0].parameters()) + x.numel() * 4
    assert parked["kept"] - parked["moved"] >= 2 * stored  # two of the three side losses
