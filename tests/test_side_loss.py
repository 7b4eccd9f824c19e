"""Eager side losses and gradient transforms, bit-identical to the combined loss."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import leanprop
from leanprop import (
    LeanpropValueError,
    UnsupportedModelError,
    scale_grad,
    side_loss,
    transform_grad,
)
from leanprop.optim import InBackward


def build(layers=3, d=6):
    torch.manual_seed(0)
    backbone = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(layers)])
    pens = nn.ModuleList(
        [nn.Sequential(nn.Linear(d, 12), nn.GELU(), nn.Linear(12, 1)) for _ in range(layers)]
    )
    head = nn.Linear(d, 1)
    return nn.ModuleList([backbone, pens, head])


def penalty(pen):
    return lambda t: pen(t).square().mean()


def objective(model, x, eager, alpha=0.1, free_penalty=False, log=None, scale=None, offload=False):
    """The training loss of ``build()``'s model: combined, or with eager side losses."""
    backbone, pens, head = model
    h, extra = x, []
    for blk, pen in zip(backbone, pens, strict=True):
        h = blk(h)
        fn = (lambda t: t.square().mean()) if free_penalty else penalty(pen)
        if eager:
            h = side_loss(h, fn, weight=alpha, log=log, scale=scale, offload=offload)
        else:
            extra.append(alpha * fn(h))
    return head(h).square().mean() + sum(extra) if extra else head(h).square().mean()


def step(model, x, eager, **kwargs):
    objective(model, x, eager, **kwargs).backward()


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("free_penalty", [False, True], ids=["penalty-params", "param-free"])
def test_bit_identical_to_combined_loss(free_penalty):
    x = torch.randn(5, 6)
    a, b = build(), build()
    step(a, x, eager=False, free_penalty=free_penalty)
    values = []
    step(b, x, eager=True, free_penalty=free_penalty, log=values)
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.equal(ga[k], gb[k]), f"{k}: {(ga[k] - gb[k]).abs().max().item():.3e}"
    assert len(values) == 3 and all(v.dim() == 0 and not v.requires_grad for v in values)


def test_gradient_accumulation_and_bf16():
    xs = torch.randn(2, 5, 6)
    a, b = build(), build()
    for x in xs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step(a, x, eager=False)
    for x in xs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step(b, x, eager=True)
    for k, g in grads(a).items():
        assert torch.equal(g, grads(b)[k]), k


def test_several_tensors_at_once():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(3, 4), nn.Linear(3, 4)
    x = torch.randn(5, 3)

    def fn(u, v):
        return (u * v).mean()

    h1, h2 = lin1(x), lin2(x)
    ((h1 + h2).sum() + 0.5 * fn(h1, h2)).backward()
    ref = [p.grad.clone() for p in [*lin1.parameters(), *lin2.parameters()]]
    for p in [*lin1.parameters(), *lin2.parameters()]:
        p.grad = None
    h1, h2 = side_loss((lin1(x), lin2(x)), fn, weight=0.5)
    (h1 + h2).sum().backward()
    for r, p in zip(ref, [*lin1.parameters(), *lin2.parameters()], strict=True):
        assert torch.equal(r, p.grad)


def test_penalty_parameters_stepped_once_with_in_backward():
    x = torch.randn(5, 6)
    a, b = build(), build()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    step(a, x, eager=False)
    opt_a.step()
    opt_b = InBackward(b.parameters(), torch.optim.SGD, lr=0.1)
    step(b, x, eager=True)
    opt_b.remove()
    for (k, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), k


def test_create_graph_is_refused_and_no_grad_logs_only():
    lin = nn.Linear(3, 3)
    h = side_loss(lin(torch.randn(2, 3)), lambda t: t.square().sum())
    with pytest.raises(UnsupportedModelError, match="create_graph"):
        h.sum().backward(create_graph=True)
    values = []
    with torch.no_grad():
        x = torch.randn(2, 3)
        out = side_loss(lin(x), lambda t: t.sum(), weight=2.0, log=values)
    assert torch.equal(values[0], 2.0 * lin(x).sum().detach()) and not out.requires_grad


def test_bad_input():
    with pytest.raises(LeanpropValueError, match="scalar"):
        side_loss(torch.randn(2, requires_grad=True), lambda t: t * 2)
    with pytest.raises(LeanpropValueError, match="tensor or a sequence"):
        side_loss([], lambda: 0)
    with pytest.raises(LeanpropValueError, match="callable"):
        side_loss(torch.randn(2), "fn")
    with pytest.raises(LeanpropValueError, match=r"one factor per sample, \[3\]"):
        scale_grad(torch.randn(3, 2), torch.ones(2))
    # up front, not in backward (were: a str multiplied in backward, a shape error there)
    with pytest.raises(LeanpropValueError, match=r"weight='0.1'.*number"):
        side_loss(torch.randn(2, requires_grad=True), lambda t: t.sum(), weight="0.1")
    with pytest.raises(LeanpropValueError, match="tensor or a sequence"):
        side_loss(None, lambda t: t.sum())
    with pytest.raises(LeanpropValueError, match=r"s='2'"):
        scale_grad(torch.randn(3, 2), "2")
    with pytest.raises(LeanpropValueError, match=r"shape \(4, 1\).*broadcast"):
        scale_grad(torch.randn(3, 2), torch.ones(4, 1))


def test_transform_grad_must_return_the_gradient():
    """fn returning None dropped the gradient silently."""
    x = torch.randn(3, 2, requires_grad=True)
    with pytest.raises(LeanpropValueError, match=r"returned NoneType.*same shape"):
        transform_grad(x * 1.0, lambda g: None).sum().backward()
    with pytest.raises(LeanpropValueError, match=r"returned \(2,\)"):
        transform_grad(x * 1.0, lambda g: g[0]).sum().backward()


def test_scale_and_transform_grad():
    x = torch.randn(3, 2, requires_grad=True)
    scale_grad(x, 3.0).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    s = torch.tensor([1.0, 2.0, 0.0])
    scale_grad(x, s).sum().backward()
    assert torch.equal(x.grad, s[:, None].expand(3, 2))
    x.grad = None
    transform_grad(x * 1.0, lambda g: g.clamp(max=0.5)).mul(2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 0.5))
    assert torch.equal(leanprop.scale_grad(x, 2.0), x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_inside_activation_checkpointing(reentrant):
    """Inside checkpoint(use_reentrant=True) the penalty was dropped (no gradient, no error)."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(5, 6)
    a, b = build(), build()
    step(a, x, eager=False)
    backbone, pens, head = b

    values = []

    def region(h):
        for blk, pen in zip(backbone, pens, strict=True):
            h = side_loss(blk(h), penalty(pen), weight=0.1, log=values)
        return h

    x_in = x.requires_grad_() if reentrant else x  # reentrant needs an input with grad
    head(checkpoint(region, x_in, use_reentrant=reentrant)).square().mean().backward()
    assert grads(a).keys() == grads(b).keys()
    for k, g in grads(a).items():
        torch.testing.assert_close(g, grads(b)[k], rtol=1e-6, atol=1e-8, msg=k)
    assert len(values) == 3  # each penalty logged once


def test_loss_scale_inside_the_eager_backward():
    x = torch.randn(5, 6)
    a, b = build(), build()
    scale = 1024.0
    backbone, pens, head = a
    h, extra = x, []
    for blk, pen in zip(backbone, pens, strict=True):
        h = blk(h)
        extra.append(0.1 * penalty(pen)(h))
    ((head(h).square().mean() + sum(extra)) * scale).backward()
    backbone, pens, head = b
    h = x
    for blk, pen in zip(backbone, pens, strict=True):
        h = side_loss(blk(h), penalty(pen), weight=0.1, scale=scale)
    (head(h).square().mean() * scale).backward()
    for k, g in grads(a).items():
        assert torch.allclose(g, grads(b)[k], rtol=1e-6, atol=1e-9), k


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


@pytest.mark.parametrize("case", ["all-ignored", "empty", "zero-class-weights"])
def test_chunked_cross_entropy_mean_over_nothing_is_nan(case):
    """A mean over a total weight of 0: NaN loss, and torch's gradients (zeros where rows are
    ignored or there are none; NaN where rows of zero class weight were kept)."""
    torch.manual_seed(0)
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    t = torch.full((3,), -100)
    kwargs = {}
    if case == "empty":
        h, t = h[:0], t[:0]
    if case == "zero-class-weights":
        t = torch.tensor([0, 1, -100])
        kwargs = {"weight": torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])}
    ref = nn.functional.cross_entropy(h @ w.T, t, **kwargs)
    ref_grads = torch.autograd.grad(ref, (h, w))
    if "weight" in kwargs:
        kwargs = {"class_weight": kwargs["weight"]}
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


class _PenalizedNet(nn.Module):
    """Backbone with a penalty per layer; forward returns the loss (combined or eager)."""

    def __init__(self):
        super().__init__()
        self.parts = build()

    def forward(self, x, eager):
        return objective(self.parts, x, eager)


def _ddp_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.distributed import same_on_all_ranks

    a, b = _PenalizedNet(), _PenalizedNet()
    ddp_a, ddp_b = DDP(a), DDP(b)  # find_unused_parameters=False: every parameter needs a grad
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own shard
    for _ in range(3):
        x = torch.randn(5, 6, generator=gen)
        ddp_a(x, eager=False).backward()
        ddp_b(x, eager=True).backward()
        for (k, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"rank {rank}, {k}"
        opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()
    assert same_on_all_ranks(torch.cat([p.detach().flatten() for p in b.parameters()]))


def test_distributed_data_parallel_two_processes():
    """Under DDP (gloo, 2 processes) the penalty parameters' gradients enter the main backward,
    so DDP all-reduces them like any other; bit-identical to DDP with the combined loss."""
    from tests import distributed

    distributed.run(_ddp_worker)


def test_fp16_grad_scaler_end_to_end():
    """fp16 autocast + GradScaler: the scale enters the eager backward via ``scale=``; after
    several steps (one of them skipped for an inf) the parameters equal the combined loss's."""
    a, b = _PenalizedNet(), _PenalizedNet()
    runs = []
    for net, eager in ((a, False), (b, True)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
        torch.manual_seed(1)
        for i in range(4):
            x = torch.randn(5, 6) * (1e4 if i == 1 else 1.0)  # step 1 overflows in fp16
            with torch.autocast("cpu", dtype=torch.float16):
                loss = objective(net.parts, x, eager, scale=scaler.get_scale() if eager else None)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(scaler.get_scale())
    assert runs[0] == runs[1] < 2.0**20  # 4 growths without the skipped step
    for (k, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), k


def test_parameter_shared_with_the_model_and_second_backward():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def fn(t):
        return lin(t).square().mean()  # lin is used by the model too

    (lin(lin(x)).sum() + 0.3 * fn(lin(x))).backward()
    ref = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    h = side_loss(lin(x), fn, weight=0.3)
    out = lin(h).sum()
    out.backward(retain_graph=True)
    for r, p in zip(ref, lin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-7)  # summation order differs
    with pytest.raises(UnsupportedModelError, match="second backward"):
        out.backward()


def test_penalty_on_an_input_reaches_only_its_parameters():
    torch.manual_seed(0)
    pen, lin = nn.Linear(4, 1), nn.Linear(4, 2)
    x = torch.randn(3, 4)  # needs no gradient
    (lin(x).sum() + pen(x).square().mean()).backward()
    ref = [p.grad.clone() for p in [*pen.parameters(), *lin.parameters()]]
    for p in [*pen.parameters(), *lin.parameters()]:
        p.grad = None
    lin(side_loss(x, lambda t: pen(t).square().mean())).sum().backward()
    for r, p in zip(ref, [*pen.parameters(), *lin.parameters()], strict=True):
        assert torch.equal(r, p.grad)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_penalty_matches_the_combined_loss(reduction):
    """chunk_size: fn on a few samples at a time; for a per-sample mean (sum) penalty the
    gradients equal the combined loss's up to rounding (float64, uneven last chunk)."""
    torch.manual_seed(0)
    model = build().double()
    backbone, pens, head = model
    x = torch.randn(7, 6, dtype=torch.float64)

    def pen_fn(pen):
        return lambda t: getattr(pen(t).square(), reduction)()

    def run(chunk_size):
        model.zero_grad(set_to_none=True)
        h, extra, values = x, [], []
        for blk, pen in zip(backbone, pens, strict=True):
            h = blk(h)
            if chunk_size is None:
                extra.append(0.1 * pen_fn(pen)(h))
            else:
                h = side_loss(h, pen_fn(pen), weight=0.1, log=values, chunk_size=chunk_size,
                              chunk_reduction=reduction)  # fmt: skip
        (head(h).square().mean() + sum(extra, torch.zeros((), dtype=x.dtype))).backward()
        values = values or [e.detach() for e in extra]
        return grads(model), torch.stack(values)

    ref, ref_values = run(None)
    for chunk_size in (1, 3, 7, 100):
        got, values = run(chunk_size)
        torch.testing.assert_close(values, ref_values, rtol=1e-12, atol=0)
        for k, g in ref.items():
            torch.testing.assert_close(got[k], g, rtol=1e-11, atol=1e-14, msg=k)


def test_chunked_penalty_holds_one_chunk_of_activations():
    """Exact tracker: a wide penalty MLP evaluated in 8 chunks peaks far below all at once."""
    torch.manual_seed(0)
    pen = nn.Sequential(nn.Linear(16, 512), nn.GELU(), nn.Linear(512, 1))
    h = torch.randn(256, 16, requires_grad=True)
    peaks = {}
    for chunk_size in (None, 32):
        with leanprop.track_memory(existing=(pen, h)) as mem:
            out = side_loss(h, lambda t: pen(t).square().mean(), chunk_size=chunk_size)
            del out
        peaks[chunk_size] = mem.peak_bytes
    activations = 2 * 256 * 512 * 4  # the hidden layer before and after GELU, all samples
    assert peaks[None] > activations > 3 * peaks[32], peaks


def test_chunked_penalty_bad_input():
    h = torch.randn(4, 3, requires_grad=True)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(LeanpropValueError, match="chunk_size"):
            side_loss(h, lambda t: t.sum(), chunk_size=bad)
    with pytest.raises(LeanpropValueError, match="chunk_reduction"):
        side_loss(h, lambda t: t.sum(), chunk_size=2, chunk_reduction="max")
    with pytest.raises(LeanpropValueError, match="same batch size"):
        side_loss((h, torch.randn(5, 3)), lambda a, b: a.sum() + b.sum(), chunk_size=2)


def test_per_sample_quantities_of_a_penalty_with_parameters():
    """Inside per_sample, the eager backward computes the penalty parameters' individual
    gradients during forward; they join the main backward's results (not replaced by them)
    and pass the sum check: equal to per_sample on the combined loss (float64)."""
    from leanprop import BatchGrad, BatchL2Grad, SumGradSquared, Variance

    model = build().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    kinds = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    results = []
    for eager in (False, True):
        model.zero_grad(set_to_none=True)
        with leanprop.per_sample(model, *kinds):
            step(model, x, eager)
            named = list(model.named_parameters())
            results.append({(k, q.attr): getattr(p, q.attr).clone() for k, p in named
                            for q in kinds})  # fmt: skip
    assert results[0].keys() == results[1].keys()
    for key, want in results[0].items():
        torch.testing.assert_close(results[1][key], want, rtol=1e-12, atol=1e-15, msg=str(key))


def test_parameter_hooks_run_once_on_the_whole_gradient():
    """A parameter's register_hook (here: doubling its gradient) sees the penalty's gradient
    once, in the main backward, as with the combined loss; not also during the eager pass."""
    x = torch.randn(5, 6)
    runs = []
    for eager in (False, True):
        model = build()
        calls = []
        for p in model.parameters():
            p.register_hook(lambda g, calls=calls: calls.append(1) or g * 2)
        step(model, x, eager=eager)
        runs.append((grads(model), len(calls)))
    (want, want_calls), (got, got_calls) = runs
    assert got_calls == want_calls == len(list(build().parameters()))
    for k, g in want.items():
        assert torch.equal(got[k], g), k


def test_chunked_penalty_with_shared_and_expanded_parameter_gradients():
    """Autograd may hand the same gradient tensor to two parameters (a + b) or an expanded one
    (a sum): summing the chunks must not write into them."""
    torch.manual_seed(0)
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    c = torch.randn((), dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)

    def fn(t):
        return (t * (a + b)).sum() + c * t.shape[0]

    (x.sum() + fn(x)).backward()
    ref = [t.grad.clone() for t in (a, b, c, x)]
    for t in (a, b, c, x):
        t.grad = None
    side_loss(x, fn, chunk_size=2, chunk_reduction="sum").sum().backward()
    for r, t in zip(ref, (a, b, c, x), strict=True):
        torch.testing.assert_close(t.grad, r, rtol=1e-12, atol=1e-14)


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


def test_chunked_penalty_of_an_empty_batch_gives_the_combined_loss_gradients():
    """N=0 with chunk_size: the penalty parameters' .grad was None where the combined loss
    gives zeros."""
    pen = nn.Linear(3, 1)
    h = torch.randn(0, 3, requires_grad=True)
    out = side_loss(h, lambda t: pen(t).sum(), weight=0.1, chunk_size=2)
    out.sum().backward()
    ref = nn.Linear(3, 1)
    ref.load_state_dict(pen.state_dict())
    (0.1 * ref(torch.randn(0, 3)).sum()).backward()
    for p, q in zip(pen.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
