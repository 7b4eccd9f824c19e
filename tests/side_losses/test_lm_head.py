"""chunked_linear_cross_entropy against F.cross_entropy on the full logits (every option,
float64), its errors, and the memory it holds (never the logits)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import leanprop
from leanprop import LeanpropValueError, UnsupportedModelError


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", ["none", "full", "scalar"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class-weights"])
def test_chunked_linear_cross_entropy_matches_plain(reduction, bias, smoothing, weighted):
    """Every F.cross_entropy option, float64, loss and gradients (output gradient not 1)."""
    torch.manual_seed(0)
    h = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    size = {"none": None, "full": 11, "scalar": 1}[bias]
    b = None if size is None else torch.randn(size, dtype=torch.float64, requires_grad=True)
    cw = torch.rand(11, dtype=torch.float64) + 0.5 if weighted else None
    t = torch.randint(0, 11, (2, 7))
    t[0, 3] = t[1, 0] = -100  # ignored
    ref = nn.functional.cross_entropy(
        nn.functional.linear(h, w, b).flatten(0, 1), t.flatten(), weight=cw,
        label_smoothing=smoothing, reduction=reduction,
    )  # fmt: skip
    loss = leanprop.chunked_linear_cross_entropy(
        h, w, t, b, chunk_size=4, reduction=reduction, class_weight=cw, label_smoothing=smoothing
    )
    if reduction == "none":
        assert loss.shape == t.shape
        ref = ref.view(t.shape)
    go = torch.rand_like(ref) + 0.5
    inputs = [x for x in (h, w, b) if x is not None]
    ref_grads = torch.autograd.grad(ref, inputs, go)
    grads = torch.autograd.grad(loss, inputs, go)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "case", ["all-ignored", "empty", "zero-class-weights", "zero-class-weights-smoothed"]
)
def test_chunked_cross_entropy_mean_over_nothing_is_nan(case):
    """A mean over a total weight of 0: NaN loss, and torch's gradients (zeros where rows are
    ignored or there are none; NaN where rows of zero class weight were kept)."""
    torch.manual_seed(0)
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    t = torch.full((3,), -100)
    kwargs = {}
    if case == "empty":
        h, t = h[:0], t[:0]
    if case.startswith("zero-class-weights"):
        t = torch.tensor([0, 1, -100])
        kwargs = {"weight": torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])}
    if case == "zero-class-weights-smoothed":
        kwargs["label_smoothing"] = 0.1
    ref = nn.functional.cross_entropy(h @ w.T, t, **kwargs)
    ref_grads = torch.autograd.grad(ref, (h, w))
    if "weight" in kwargs:
        kwargs["class_weight"] = kwargs.pop("weight")
    loss = leanprop.chunked_linear_cross_entropy(h, w, t, **kwargs)
    assert ref.isnan() and loss.isnan()
    for got, want in zip(torch.autograd.grad(loss, (h, w)), ref_grads, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_chunked_cross_entropy_takes_any_integer_targets(dtype):
    torch.manual_seed(0)
    h, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    t = torch.randint(0, 9, (6,))
    ref = nn.functional.cross_entropy(h @ w.T, t)
    got = leanprop.chunked_linear_cross_entropy(h, w, t.to(dtype))
    torch.testing.assert_close(got, ref)


def test_chunked_cross_entropy_bad_input():
    h, w, t = torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4,))
    call = leanprop.chunked_linear_cross_entropy
    with pytest.raises(LeanpropValueError, match="reduction='avg'"):
        call(h, w, t, reduction="avg")
    with pytest.raises(LeanpropValueError, match=r"expected h \[..., D\]"):
        call(h, w, t[:3])
    with pytest.raises(LeanpropValueError, match="chunk_size=0"):
        call(h, w, t, chunk_size=0)
    for bad in (0, "32", float("inf"), True):
        with pytest.raises(LeanpropValueError, match="chunk_mib="):
            call(h, w, t, chunk_mib=bad)
    with pytest.raises(LeanpropValueError, match="tensor h, got list"):
        call([h], w, t)
    with pytest.raises(LeanpropValueError, match="Class probabilities are not supported"):
        call(h, w, t.float())
    with pytest.raises(IndexError, match="Target 11 is out of bounds"):
        call(h, w, torch.tensor([0, 11, 1, 2]))
    with pytest.raises(IndexError, match="Target -3 is out of bounds"):
        call(h, w, torch.tensor([0, -3, 1, 2]))
    with pytest.raises(LeanpropValueError, match=r"bias \(4,\); it must be \[5\] or \[1\]"):
        call(h, w, t, torch.randn(4))
    with pytest.raises(LeanpropValueError, match=r"class_weight \(3,\)"):
        call(h, w, t, class_weight=torch.ones(3))
    with pytest.raises(LeanpropValueError, match=r"label_smoothing=1\.5"):
        call(h, w, t, label_smoothing=1.5)
    loss = call(h.requires_grad_(), w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(UnsupportedModelError, match="second backward"):
        loss.backward()
    for reduction in ("mean", "none"):  # second derivatives: refused (were silently dropped)
        out = call(h, w.requires_grad_(), t, reduction=reduction).sum()
        with pytest.raises(UnsupportedModelError, match="create_graph=True"):
            torch.autograd.grad(out, h, create_graph=True)


def test_chunked_cross_entropy_never_holds_the_logits():
    from leanprop import track_memory

    torch.manual_seed(0)
    n, d, v = 256, 16, 4096
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    t = torch.randint(0, v, (n,))
    with track_memory(existing=[h, w, t]) as mem:
        leanprop.chunked_linear_cross_entropy(h, w, t, chunk_size=16).backward()
    logits = n * v * 4
    assert mem.peak_bytes < logits / 2  # gradients [V, D] + [N, D] + a few [16, V] chunks


def test_chunked_cross_entropy_scratch_does_not_grow_with_the_vocabulary():
    from leanprop import track_memory

    torch.manual_seed(0)
    n, d, budget_mib = 512, 16, 0.25
    scratch = {}
    for v in (2048, 16384):
        h = torch.randn(n, d, requires_grad=True)
        w = torch.randn(v, d, requires_grad=True)
        t = torch.randint(0, v, (n,))
        with track_memory(existing=[h, w, t]) as mem:
            leanprop.chunked_linear_cross_entropy(h, w, t, chunk_mib=budget_mib).backward()
        scratch[v] = mem.peak_bytes - (v * d + n * d) * 4  # minus the two gradients
        assert scratch[v] < n * v * 4 / 4  # well below the logits
    assert max(scratch.values()) <= 4 * budget_mib * 2**20, scratch
