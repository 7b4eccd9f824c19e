"""Bucket steps by direct kernel calls: bit-identical to the plain optimizer, and
``Optimizer.step()`` wherever the direct call would not be the same."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from leanprop.optim import InBackward
from leanprop.optim.kernels import DirectKernels

DIRECT = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "maximize": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.01, "foreach": True, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01, "fused": True}),
]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).to(dtype)


def _groups(model):
    return [
        {"params": list(model[0].parameters()), "lr": 0.05},
        {"params": [*model[2].parameters(), *model[4].parameters()]},
    ]


def _train(model, opt, steps=5, on_step=None):
    """``steps`` steps on fixed data with a scheduler; counts ``opt.inner.step`` calls."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = torch.randn(steps, 6, 4, generator=torch.Generator().manual_seed(1)).to(
        next(model.parameters()).dtype
    )
    for s in range(steps):
        model(data[s]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if on_step is not None:
            on_step(s)


def _count_inner_steps(opt):
    calls = []
    step = opt.inner.step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    opt.inner.step = counted
    return calls


def _equal(a, b):
    for (k, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{k}: max difference {(p - q).abs().max().item():.3e}"


@pytest.mark.parametrize("bucket_mb", [1e-6, 25.0], ids=["bucket-per-tensor", "one-bucket"])
@pytest.mark.parametrize(("opt_class", "kwargs"), DIRECT, ids=str)
def test_direct_kernel_steps_are_bit_identical(opt_class, kwargs, bucket_mb):
    ref, ours = _model(), _model()
    plain = opt_class(_groups(ref), **kwargs)
    _train(ref, plain)
    opt = InBackward(_groups(ours), opt_class, bucket_mb=bucket_mb, **kwargs)
    calls = _count_inner_steps(opt)
    _train(ours, opt)
    _equal(ours, ref)
    # each bucket's first step is step()'s (state, fused checks); then no step() runs at all
    first = 1 if bucket_mb == 25.0 else len(list(ours.parameters()))
    assert len(calls) == first, calls
    opt.remove()


def test_complex_parameters_adam():
    torch.manual_seed(0)
    ref = nn.Parameter(torch.randn(5, dtype=torch.complex64))
    ours = nn.Parameter(ref.detach().clone())
    plain = torch.optim.Adam([ref], lr=0.01)
    opt = InBackward([ours], torch.optim.Adam, lr=0.01)
    calls = _count_inner_steps(opt)
    for s in range(4):
        for p, o in ((ref, plain), (ours, opt)):
            (p * (s + 1)).abs().square().sum().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(ours, ref)
    assert len(calls) == 1
    opt.remove()


@pytest.mark.parametrize("where", ["global", "own"])
def test_step_hooks_run_through_step(where):
    """A step hook is run by ``Optimizer.step()``: with one registered, each bucket is stepped
    by it (and the hook sees each)."""
    ref, ours = _model(), _model()
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01)
    _train(ref, plain)
    opt = InBackward(ours.parameters(), torch.optim.AdamW, lr=0.01)
    seen = []
    target = opt.inner if where == "own" else None
    register = target.register_step_post_hook if target else register_optimizer_step_post_hook
    handle = register(lambda o, *a: seen.append(1) if o is opt.inner else None)
    try:
        _train(ours, opt)
    finally:
        handle.remove()
        opt.remove()
    _equal(ours, ref)
    assert len(seen) == 5  # one bucket a step, each through step()


def test_load_state_dict_mid_training():
    """State loaded mid-training replaces the state the prebuilt buckets hold."""
    ref, ours = _model(), _model()
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = InBackward(ours.parameters(), torch.optim.Adam, lr=0.01)
    saved = {}

    def save(s, o, key):
        if s == 1:
            saved[key] = _copy_state(o.state_dict())
        if s == 3:
            o.load_state_dict(saved[key])

    _train(ref, plain, on_step=lambda s: save(s, plain, "ref"))
    _train(ours, opt, on_step=lambda s: save(s, opt, "ours"))
    _equal(ours, ref)
    opt.remove()


def _copy_state(sd):
    return {
        "state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }


def test_tensor_lr_and_sparse_gradients_go_through_step():
    ref, ours = _model(), _model()
    lr = torch.tensor(0.01)
    plain = torch.optim.Adam(ref.parameters(), lr=lr.clone())
    _train(ref, plain)
    opt = InBackward(ours.parameters(), torch.optim.Adam, lr=lr.clone())
    calls = _count_inner_steps(opt)
    _train(ours, opt)
    _equal(ours, ref)
    assert len(calls) == 5
    opt.remove()

    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    ref_emb = nn.Embedding(10, 3, sparse=True)
    ref_emb.load_state_dict(emb.state_dict())
    plain = torch.optim.SGD(ref_emb.parameters(), lr=0.1)
    opt = InBackward(emb.parameters(), torch.optim.SGD, lr=0.1)
    calls = _count_inner_steps(opt)
    for s in range(3):
        idx = torch.tensor([s, s + 1, 7])
        for m, o in ((ref_emb, plain), (emb, opt)):
            m(idx).square().sum().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(emb.weight, ref_emb.weight)
    assert len(calls) == 3
    opt.remove()


def test_other_optimizers_and_newer_options_are_not_called_directly():
    p = [nn.Parameter(torch.zeros(2))]
    assert DirectKernels(torch.optim.RMSprop(p)).kernel is None

    class MyAdam(torch.optim.Adam):  # its step() may do anything
        pass

    assert DirectKernels(MyAdam(p)).kernel is None
    opt = torch.optim.Adam(p)
    opt.defaults["an_option_of_a_newer_torch"] = True
    assert DirectKernels(opt).kernel is None
    assert DirectKernels(torch.optim.Adam(p)).kernel is not None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m, o: o.state.clear(),
        lambda m, o: o.state.__delitem__(m[2].weight),
        lambda m, o: o.state.__setitem__(m[2].weight, {}),
        lambda m, o: o.param_groups.__setitem__(0, {**o.param_groups[0], "lr": 0.5}),
    ],
    ids=["state.clear", "del state[p]", "state[p] = {}", "group replaced"],
)
def test_state_and_groups_replaced_mid_training(mutate):
    """The direct path reads each group and each parameter's state at every step: state reset
    (step() creates it again) and a group dict replaced are followed as by the plain loop."""
    ref, ours = _model(), _model()
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = InBackward(ours.parameters(), torch.optim.Adam, lr=0.01, bucket_mb=1e-6)
    for model, o in ((ref, plain), (ours, opt)):
        data = torch.randn(6, 6, 4, generator=torch.Generator().manual_seed(1))
        for s in range(6):
            if s == 3:
                mutate(model, o)
            model(data[s]).square().mean().backward()
            o.step()
            o.zero_grad()
    _equal(ours, ref)
    opt.remove()
