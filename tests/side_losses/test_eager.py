"""Eager side losses (side_loss), bit-identical to the combined loss: accumulation, autocast
and loss scaling, activation checkpointing, InBackward, DDP, per_sample, chunked penalties."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import leanprop
from leanprop import LeanpropValueError, UnsupportedModelError, scale_grad, side_loss
from leanprop.optim import InBackward

from .helpers import build, grads, objective, penalty, step


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
