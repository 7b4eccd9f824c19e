"""InBackward: bit-identical to the ordinary loop, and every misuse explained."""

from __future__ import annotations

import contextlib
import copy
import gc
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from leanprop import LeanpropValueError, UnsupportedModelError
from leanprop.optim import InBackward


class Net(nn.Module):
    """Two blocks, a tied output layer, an unused branch, optional checkpointing."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 6, bias=False)
        self.out.weight = nn.Parameter(self.emb.weight.detach().t().contiguous())
        self.tied = nn.Linear(8, 8, bias=False)
        self.unused = nn.Linear(8, 8)
        self.ckpt = ckpt

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        h = checkpoint(self.block, h, use_reentrant=False) if self.ckpt else self.block(h)
        h = self.tied(torch.tanh(self.tied(h)))  # weight used twice
        return self.out(h)


def _groups(model):
    return [
        {"params": [*model.emb.parameters(), *model.block.parameters()], "lr": 0.05},
        {"params": [*model.out.parameters(), *model.tied.parameters(), *model.unused.parameters()],
         "weight_decay": 0.1},
    ]  # fmt: skip


def train(opt_class, kwargs, fused_into_backward, steps=4, micro=1, ckpt=False, bucket_mb=25.0,
          scheduler=True, autocast=False, device="cpu"):  # fmt: skip
    torch.manual_seed(0)
    model = Net(ckpt).to(device)
    if fused_into_backward:
        opt = InBackward(_groups(model), opt_class, bucket_mb=bucket_mb, **kwargs)
    else:
        opt = opt_class(_groups(model), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    data = torch.randn(steps, micro, 5, 6).to(device)
    for s in range(steps):
        for m in range(micro):
            last = m == micro - 1
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = model(data[s, m]).pow(2).mean()
            if fused_into_backward and not last:
                with opt.accumulate():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    if fused_into_backward:
        opt.remove()
    return model, opt


OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01, "foreach": True}),
    (torch.optim.AdamW, {"lr": 0.01, "fused": True}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    (torch.optim.Adagrad, {"lr": 0.1}),
]


def assert_bitwise_equal(a: nn.Module, b: nn.Module) -> None:
    for (k, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{k}: max difference {(p - q).abs().max().item():.3e}"


@pytest.mark.parametrize("bucket_mb", [1e-6, 25.0], ids=["bucket-per-tensor", "one-bucket"])
@pytest.mark.parametrize(
    ("opt_class", "kwargs"), OPTIMIZERS, ids=lambda o: getattr(o, "__name__", "")
)
def test_bit_identical_to_ordinary_training(opt_class, kwargs, bucket_mb):
    ours, _ = train(opt_class, kwargs, True, bucket_mb=bucket_mb)
    ref, _ = train(opt_class, kwargs, False)
    assert_bitwise_equal(ours, ref)
    torch.manual_seed(0)
    start = Net()
    for (k, p), q in zip(ours.named_parameters(), start.parameters(), strict=True):
        assert torch.equal(p, q) == k.startswith("unused"), (
            f"{k}: trained = {not torch.equal(p, q)}"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bucket_mb", [1e-6, 25.0], ids=["bucket-per-tensor", "one-bucket"])
@pytest.mark.parametrize("kwargs", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_bit_identical_on_cuda(kwargs, bucket_mb):
    a, _ = train(torch.optim.AdamW, kwargs, False, device="cuda")
    b, _ = train(torch.optim.AdamW, kwargs, True, bucket_mb=bucket_mb, device="cuda")
    assert_bitwise_equal(a, b)


@pytest.mark.parametrize(
    "variant",
    [{"micro": 3}, {"ckpt": True}, {"autocast": True}],
    ids=["accumulate", "ckpt", "bf16"],
)
@pytest.mark.parametrize("bucket_mb", [1e-6, 25.0], ids=["bucket-per-tensor", "one-bucket"])
def test_bit_identical_variants(variant, bucket_mb):
    kwargs = {"lr": 0.01, "weight_decay": 0.1}
    ours, _ = train(torch.optim.AdamW, kwargs, True, bucket_mb=bucket_mb, **variant)
    ref, _ = train(torch.optim.AdamW, kwargs, False, **variant)
    assert_bitwise_equal(ours, ref)


def test_unused_parameters_untouched_and_gradients_freed():
    torch.manual_seed(0)
    model = Net()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    for k, p in model.named_parameters():
        assert torch.equal(p, before[k]) == k.startswith("unused"), k
    opt.remove()


def test_state_dict_interchangeable_with_plain_optimizer():
    kwargs = {"lr": 0.01, "weight_decay": 0.1}
    torch.manual_seed(0)
    ref_model = Net()
    torch.manual_seed(0)
    model = Net()
    plain = torch.optim.AdamW(ref_model.parameters(), **kwargs)
    ours = InBackward(model.parameters(), torch.optim.AdamW, **kwargs)
    data = torch.randn(4, 5, 6)
    for s in range(4):
        ref_model(data[s]).pow(2).mean().backward()
        plain.step()
        plain.zero_grad()
        model(data[s]).pow(2).mean().backward()
        if s == 1:  # swap states both ways mid-training
            a, b = ours.state_dict(), plain.state_dict()
            ours.load_state_dict(b)
            plain.load_state_dict(a)
    assert_bitwise_equal(model, ref_model)
    ours.remove()


def test_misuse_errors():
    model = nn.Linear(3, 2)
    with pytest.raises(LeanpropValueError, match=r"needs a torch\.optim\.Optimizer class"):
        InBackward(model.parameters(), torch.optim.Adam(model.parameters()))
    with pytest.raises(LeanpropValueError, match=r"closure"):
        InBackward(model.parameters(), torch.optim.LBFGS)
    with pytest.raises(LeanpropValueError, match=r"bucket_mb=0"):
        InBackward(model.parameters(), torch.optim.SGD, lr=0.1, bucket_mb=0)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(LeanpropValueError, match=r"already belong to another InBackward"):
        InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    opt.remove()
    InBackward(model.parameters(), torch.optim.SGD, lr=0.1).remove()  # free again after remove


def test_remove_restores_ordinary_training():
    model = nn.Linear(3, 2)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    opt.remove()
    model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None  # no longer stepped and freed in backward
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.weight, before)


@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["clipping", "not-clipping"])
@pytest.mark.parametrize("bucket_mb", [1e-6, 25.0], ids=["bucket-per-tensor", "one-bucket"])
def test_exact_clipping_bit_identical(max_norm, bucket_mb):
    kwargs = {"lr": 0.01, "weight_decay": 0.1}
    data = torch.randn(3, 5, 6)
    torch.manual_seed(0)
    ref = Net()
    plain = torch.optim.AdamW(ref.parameters(), **kwargs)
    ref_norms = []
    for s in range(3):
        ref(data[s]).pow(2).mean().backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        assert (ref_norms[-1] > max_norm) == (max_norm < 1), "the case does not test what it says"
        plain.step()
        plain.zero_grad()
    torch.manual_seed(0)
    model = Net()
    opt = InBackward(model.parameters(), torch.optim.AdamW, bucket_mb=bucket_mb, **kwargs)
    for s in range(3):
        norm = opt.clipped_backward(model(data[s]).pow(2).mean(), max_norm)
        assert torch.equal(norm, ref_norms[s])
    opt.remove()
    assert_bitwise_equal(model, ref)


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself")
def test_grad_scaler_is_refused_clearly():
    model = nn.Linear(3, 2)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 3)).sum()).backward()
    with pytest.raises(UnsupportedModelError, match=r"GradScaler.*bfloat16 autocast"):
        scaler.step(opt)
    opt.remove()


@pytest.mark.parametrize("micro", [1, 2], ids=["one-batch", "micro-batches"])
def test_approximate_clipping_uses_the_previous_norm(micro):
    """Clipped with the last stepping backward's norm; accumulate() micro-batches step nothing
    and keep that factor (it was dropped there: silently unclipped)."""
    max_norm, kwargs = 1e-3, {"lr": 0.01}
    data = torch.randn(3, micro, 5, 6)
    torch.manual_seed(0)
    ref = Net()
    plain = torch.optim.AdamW(ref.parameters(), **kwargs)
    previous = None
    for s in range(3):
        for m in range(micro):
            ref(data[s, m]).pow(2).mean().backward()
        params = [p for p in ref.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if previous is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, previous)
        previous = norm
        plain.step()
        plain.zero_grad()
    torch.manual_seed(0)
    model = Net()
    opt = InBackward(model.parameters(), torch.optim.AdamW, clip_grad_norm=max_norm, **kwargs)
    for s in range(3):
        for m in range(micro):
            with opt.accumulate() if m < micro - 1 else contextlib.nullcontext():
                model(data[s, m]).pow(2).mean().backward()
    assert torch.equal(opt.last_grad_norm, previous)
    opt.remove()
    assert_bitwise_equal(model, ref)


def test_torch_clip_grad_norm_on_freed_gradients_raises():
    original = torch.nn.utils.clip_grad_norm_
    model = nn.Linear(3, 2)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(UnsupportedModelError, match=r"clipped_backward"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    other = nn.Linear(3, 2)  # ordinary parameters still clip as usual
    other(torch.randn(4, 3)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0) > 0
    opt.remove()
    assert torch.nn.utils.clip_grad_norm_ is original


@pytest.mark.parametrize("mode", ["plain", "approx-clipping", "micro-batches", "small-buckets"])
def test_torch_clip_grad_norm_with_inf_reads_the_stepped_norm(mode):
    """What trainers do every step to log the norm, clip_grad_norm_(params, inf), returns the
    global norm of the gradients stepped in the last backward: bit-identical to the plain
    loop's (tied weight, unused parameters, accumulated micro-batches, several buckets)."""
    inf = float("inf")
    kwargs = {"clip_grad_norm": 1e-3} if mode == "approx-clipping" else {}
    bucket = 1e-4 if mode == "small-buckets" else 25.0
    micro = 2 if mode == "micro-batches" else 1
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    opt = InBackward(_groups(model), torch.optim.SGD, lr=0.1, bucket_mb=bucket, **kwargs)
    ref_opt = torch.optim.SGD(_groups(ref), lr=0.1)
    data = torch.randn(3, micro, 5, 6)
    for s in range(3):
        for m in range(micro):
            ctx = opt.accumulate() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                model(data[s, m]).pow(2).mean().backward()
            ref(data[s, m]).pow(2).mean().backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), inf)
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), inf)
        assert torch.equal(got, want), (s, got, want)
        assert torch.equal(opt.last_grad_norm, want)
        if mode != "approx-clipping":
            ref_opt.step()
        ref_opt.zero_grad()
        if mode == "approx-clipping":  # keep the reference on InBackward's parameters
            ref.load_state_dict(model.state_dict())
    opt.remove()


def test_torch_clip_grad_norm_of_stepped_gradients_mixed_with_others():
    """Stepped parameters and ordinary ones in one call: one global norm; error_if_nonfinite
    as torch; a parameter that got no gradient in the last backward counts as none."""
    inf = float("inf")
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    opt = InBackward(a.parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 3)
    want = torch.nn.utils.get_total_norm(
        [g for g in torch.autograd.grad(a(x).sum(), list(a.parameters()))]
        + [g for g in torch.autograd.grad(b(x).sum(), list(b.parameters()))]
    )
    (a(x).sum() + b(x).sum()).backward()
    got = torch.nn.utils.clip_grad_norm_([*a.parameters(), *b.parameters()], inf)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    b.zero_grad(set_to_none=True)
    a.weight.requires_grad_(False)
    a(x).sum().backward()  # only the bias is stepped now
    # (autograd.grad steps nothing: the norms of the last stepping backward stay)
    bias_norm = torch.linalg.vector_norm(torch.autograd.grad(a(x).sum(), a.bias)[0])
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(a.parameters(), inf), bias_norm)
    a.weight.requires_grad_(True)
    (a(x).sum() * float("nan")).backward()
    assert torch.nn.utils.clip_grad_norm_(a.parameters(), inf).isnan()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(a.parameters(), inf, error_if_nonfinite=True)
    with pytest.raises(UnsupportedModelError, match=r"norm_type=1"):
        torch.nn.utils.clip_grad_norm_(a.parameters(), inf, norm_type=1)
    opt.remove()


def test_second_backward_through_a_retained_graph_fails_loudly_and_changes_nothing():
    """The first backward stepped the parameters the graph saved: torch refuses the second
    (never a step with stale values); the optimizer then trains on as the plain loop."""
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    opt = InBackward(_groups(model), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(_groups(ref), lr=0.1)
    x = torch.randn(2, 5, 6)
    loss = model(x[0]).pow(2).mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    model(x[1]).pow(2).mean().backward()
    for b in x:
        ref(b).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.remove()
    assert_bitwise_equal(model, ref)


def test_clipped_backward_gives_other_leaves_their_gradient_once():
    """Parameters of another optimizer and inputs that require grad: one gradient each, as
    from one backward (the measuring pass used to accumulate into them too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    opt = InBackward(model[2].parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 3, requires_grad=True)
    want = torch.autograd.grad(model(x).square().sum(), [x, *model[0].parameters()])
    opt.clipped_backward(model(x).square().sum(), 1e-3)
    for got, ref in zip([x.grad, model[0].weight.grad, model[0].bias.grad], want, strict=True):
        torch.testing.assert_close(got, ref)
    opt.remove()


def test_clipped_backward_norm_bit_identical_with_mixed_dtypes():
    """The global norm it returns (and clips with) is grouped by dtype as torch's."""
    for seed in range(12):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5).bfloat16(), nn.Linear(5, 2))
        ref = copy.deepcopy(model)
        opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
        x = torch.randn(3, 5)

        def run(m, x=x):
            return m[2](m[1](m[0](x).bfloat16()).float()).square().sum()

        run(ref).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert torch.equal(opt.clipped_backward(run(model), 0.5), want), seed
        opt.remove()


def test_approximate_clipping_switched_off_stops_clipping():
    """clip_grad_norm set back to None: the next steps are the plain loop's (the last clip
    factor is not applied any more)."""
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    opt = InBackward(_groups(model), torch.optim.SGD, lr=0.1, clip_grad_norm=0.01)
    x = torch.randn(3, 5, 6)
    model(x[0]).pow(2).mean().backward()
    ref.load_state_dict(model.state_dict())
    opt.clip_grad_norm = None
    ref_opt = torch.optim.SGD(_groups(ref), lr=0.1)
    for b in x[1:]:
        model(b).pow(2).mean().backward()
        ref(b).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.remove()
    assert_bitwise_equal(model, ref)


def test_sparse_gradients_step_and_report_their_norm():
    torch.manual_seed(0)
    model, ref = nn.Embedding(10, 4, sparse=True), nn.Embedding(10, 4, sparse=True)
    ref.load_state_dict(model.state_dict())
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids in torch.randint(0, 10, (3, 6)):
        model(ids).square().sum().backward()
        ref(ids).square().sum().backward()
        want = torch.linalg.vector_norm(ref.weight.grad.coalesce().values())
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        torch.testing.assert_close(got, want)
        ref_opt.step()
        ref_opt.zero_grad()
    opt.remove()
    assert torch.equal(model.weight, ref.weight)


def test_norm_read_covers_the_last_backward_only():
    """Two optimizers on one model, and micro-batches: clip_grad_norm_(params, inf) counts
    the gradients of the last backward only, as the plain loop (zero_grad after each step)."""
    inf = float("inf")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    # (norms kept whether read or not: the first backward's are not read here)
    first = InBackward(model[0].parameters(), torch.optim.SGD, lr=0.1, record_norms=True)
    second = InBackward(model[2].parameters(), torch.optim.SGD, lr=0.1, record_norms=True)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    h = torch.tanh(model[0](x)).detach()
    grads = torch.autograd.grad(model[2](h).sum(), list(model[2].parameters()))
    model[2](h).sum().backward()  # reaches the second optimizer's parameters only
    torch.testing.assert_close(
        torch.nn.utils.clip_grad_norm_(model.parameters(), inf),
        torch.nn.utils.get_total_norm(grads),
    )
    with second.accumulate():  # a micro-batch through the first layer only: its gradients
        loss = model[2](torch.tanh(model[0](x)).detach() * 0 + 1).sum() * 0
        model[0](x).sum().backward()
        loss.backward()
    want = torch.nn.utils.get_total_norm([model[2].weight.grad, model[2].bias.grad])
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model[2].parameters(), inf), want)
    first.remove()
    second.remove()


def test_norms_are_kept_by_default_while_they_are_read():
    """The default keeps the stepped gradients' norms while something reads them after each
    backward (a trainer's logging: exactly the plain loop's norms), and stops after a backward
    whose norms nobody read (one read of every gradient less), a later read then refused with
    what to pass; record_norms=True keeps them read or not."""
    inf = float("inf")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    plain_model = copy.deepcopy(model)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    read = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    for _ in range(3):
        x = torch.randn(5, 3)
        plain_model(x).square().sum().backward()
        want = torch.nn.utils.clip_grad_norm_(plain_model.parameters(), inf)
        plain.step()
        plain.zero_grad()
        model(x).square().sum().backward()
        assert torch.equal(torch.nn.utils.clip_grad_norm_(model.parameters(), inf), want)
        assert torch.equal(read.last_grad_norm, want)
    read.remove()
    for record_norms in (None, True):
        opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1, record_norms=record_norms)
        for _ in range(2):  # (nothing reads the first backward's norms)
            model(torch.randn(5, 3)).sum().backward()
        if record_norms:
            assert opt.last_grad_norm is not None
        else:
            with pytest.raises(UnsupportedModelError, match="record_norms=True"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), inf)
            with pytest.raises(UnsupportedModelError, match="only while they are read"):
                _ = opt.last_grad_norm
        opt.remove()
    # clipping keeps them again where they had stopped being kept: exact, and approximate
    # switched on after construction
    for clip in ("exact", "approximate"):
        opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
        for _ in range(2):
            model(torch.randn(5, 3)).sum().backward()
        if clip == "exact":
            opt.clipped_backward(model(torch.randn(5, 3)).sum(), 1.0)
        else:
            opt.clip_grad_norm = 1.0
            model(torch.randn(5, 3)).sum().backward()
        assert opt.last_grad_norm is not None
        opt.remove()
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1, record_norms=False)
    opt.clip_grad_norm = 1.0  # (refused before anything is stepped)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LeanpropValueError, match="record_norms=False"):
        model(torch.randn(5, 3)).sum().backward()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.remove()


def test_parameters_moved_between_groups_step_with_their_new_group():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    params = list(model.parameters())
    opt = InBackward(
        [{"params": params[:3], "lr": 0.0}, {"params": params[3:], "lr": 1.0}], torch.optim.SGD
    )
    x = torch.randn(2, 3)
    model(x).sum().backward()
    groups = opt.param_groups  # swap the middle parameters of the groups, in place
    groups[0]["params"][1], groups[1]["params"][1] = groups[1]["params"][1], groups[0]["params"][1]
    before = [p.detach().clone() for p in params]
    grads = torch.autograd.grad(model(x).sum(), params)
    model(x).sum().backward()
    lrs = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]  # params[1] now in the lr=1 group, params[4] in lr=0
    for p, b, g, lr in zip(params, before, grads, lrs, strict=True):
        torch.testing.assert_close(p, b - lr * g)
    opt.remove()


def test_norm_read_bit_identical_with_mixed_dtypes():
    """bf16 and float32 parameters: the norm is grouped by dtype as torch forms it."""
    inf = float("inf")
    for seed in range(12):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5).bfloat16(), nn.Linear(5, 2))
        ref = copy.deepcopy(model)
        opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1, bucket_mb=1e-5)
        x = torch.randn(3, 5)

        def run(m, x=x):
            return m[2](m[1](m[0](x).bfloat16()).float()).square().sum()

        run(ref).backward()
        run(model).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), inf)
        assert torch.equal(torch.nn.utils.clip_grad_norm_(model.parameters(), inf), want), seed
        opt.remove()


def test_a_reference_to_the_guarded_clip_keeps_working_after_remove():
    gc.collect()  # no other InBackward alive: remove() uninstalls the guard
    model = nn.Linear(3, 2)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    clip = torch.nn.utils.clip_grad_norm_  # taken while the guard is installed
    opt.remove()
    assert torch.nn.utils.clip_grad_norm_ is not clip
    model(torch.randn(4, 3)).sum().backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(clip(model.parameters(), 1e9), want)


def test_peak_memory_is_state_plus_about_one_bucket():
    """Exact tensor bytes (not a timing): gradients are freed bucket by bucket."""
    from leanprop import track_memory

    def run(fused_into_backward):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(8)])
        x = torch.randn(2, 256)
        if fused_into_backward:
            opt = InBackward(model.parameters(), torch.optim.Adam, lr=1e-3, bucket_mb=0.25)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with track_memory(existing=[model, x]) as mem:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        if fused_into_backward:
            opt.remove()
        return mem.peak_bytes

    layer = 256 * 256 * 4
    state = 8 * (2 * layer + 4)  # Adam: exp_avg and exp_avg_sq per weight, plus the step
    ordinary, ours = run(False), run(True)
    assert ordinary >= state + 8 * layer  # every gradient alive at once
    # one bucket (a layer) of gradients + the optimizer's temporaries for it, never all eight
    assert ours <= state + 3 * layer + 64 * 1024


def test_composes_with_per_sample_quantities():
    import leanprop
    from leanprop.testing import individual_gradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 2, (6,))

    def loss_fn(out, t, reduction):
        return nn.functional.cross_entropy(out, t, reduction=reduction)

    expected = individual_gradients(model, loss_fn, x, y, "mean")
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        loss_fn(model(x), y, "mean").backward()
    opt.remove()
    for k, p in model.named_parameters():
        assert torch.allclose(p.grad_batch, expected[k], rtol=1e-10, atol=1e-14), k
        assert p.grad is None
        assert torch.allclose(p, before[k] - 0.1 * expected[k].sum(0), rtol=1e-12, atol=1e-14), k


class _Boom(RuntimeError):
    pass


def _failing_backward(model: nn.Module, x: torch.Tensor) -> None:
    """A backward that raises halfway: after the last layer's gradients are accumulated."""
    h = torch.tanh(model[0](x))

    def boom(grad):
        raise _Boom("hook failed")

    h.register_hook(boom)
    with pytest.raises(_Boom):
        model[2](h).square().sum().backward()


@pytest.mark.parametrize("bucket_mb", [1e-6, 25.0], ids=["stepped-before", "waiting"])
@pytest.mark.parametrize("accumulating", [False, True], ids=["plain", "in-accumulate"])
def test_a_backward_that_raises_leaves_the_next_one_exact(bucket_mb, accumulating):
    """Buckets a failed backward stepped stay stepped; what it left is dropped, so the next
    backward steps with its own gradients only (before: later backward passes stepped
    nothing, or added to the failed one's gradients)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    opt = InBackward(model.parameters(), torch.optim.AdamW, lr=0.1, bucket_mb=bucket_mb)
    x = torch.randn(16, 4, dtype=torch.float64)
    if accumulating:
        with opt.accumulate():
            model(x).sum().backward()
            _failing_backward(model, x)
    else:
        _failing_backward(model, x)
    # the reference starts from the state the failure left, and steps ordinarily
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (loading shares tensors)
    y = torch.randn(16, 4, dtype=torch.float64)
    ref(y).square().sum().backward()
    ref_opt.step()
    with (
        pytest.warns(RuntimeWarning, match="earlier backward raised")
        if (bucket_mb > 1 or accumulating)
        else contextlib.nullcontext()
    ):
        model(y).square().sum().backward()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), k
        assert p.grad is None, k
    opt.step()  # nothing left waiting
    opt.remove()


def test_step_after_a_backward_that_raised_explains_nothing_is_lost():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    _failing_backward(model, torch.randn(3, 4))
    with pytest.warns(RuntimeWarning, match="dropped"):
        opt.step()  # was: an error blaming accumulate()
    assert all(p.grad is None for p in model.parameters())
    opt.remove()


def test_add_param_group_is_stepped_in_backward():
    """Parameters of a group added later are stepped like the others (were never stepped)."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3).double(), nn.Linear(3, 1).double()
    ref_a, ref_b = nn.Linear(3, 3).double(), nn.Linear(3, 1).double()
    ref_a.load_state_dict(a.state_dict())
    ref_b.load_state_dict(b.state_dict())
    opt = InBackward(a.parameters(), torch.optim.Adam, lr=0.1)
    opt.add_param_group({"params": b.parameters(), "lr": 0.01})
    ref = torch.optim.Adam(ref_a.parameters(), lr=0.1)
    ref.add_param_group({"params": ref_b.parameters(), "lr": 0.01})
    x = torch.randn(5, 3, dtype=torch.float64)
    for _ in range(2):
        b(torch.tanh(a(x))).sum().backward()
        ref_b(torch.tanh(ref_a(x))).sum().backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip([*a.parameters(), *b.parameters()], [*ref_a.parameters(), *ref_b.parameters()],
                    strict=True):  # fmt: skip
        assert torch.equal(p, q)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.01
    with pytest.raises(LeanpropValueError, match="already belong"):
        opt.add_param_group({"params": [b.weight]})
    opt.remove()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bucket_mb": "25"}, "bucket_mb='25'"),
        ({"bucket_mb": None}, "bucket_mb=None"),
        ({"bucket_mb": float("inf")}, "bucket_mb=inf"),
        ({"clip_grad_norm": "1"}, "clip_grad_norm='1'"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm=nan"),
    ],
)
def test_bad_option_values_are_refused_up_front(kwargs, message):
    model = nn.Linear(3, 2)
    with pytest.raises(LeanpropValueError, match=message):
        InBackward(model.parameters(), torch.optim.SGD, lr=0.1, **kwargs)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    loss = model(torch.randn(4, 3)).sum()
    with pytest.raises(LeanpropValueError, match="max_norm='1'"):
        opt.clipped_backward(loss, "1")  # before its first backward pass
    assert model.weight.grad is None
    opt.remove()


def test_reentrant_checkpoint_is_refused_not_stepped_per_inner_backward():
    """A block under checkpoint(use_reentrant=True) applied 3 times had its weight stepped 3
    times per backward, each with part of the gradient."""
    torch.manual_seed(0)
    block = nn.Linear(4, 4)
    opt = InBackward(block.parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(2, 4, requires_grad=True)
    h = x
    for _ in range(3):
        h = checkpoint(block, h, use_reentrant=True)
    with pytest.raises(UnsupportedModelError, match=r"use_reentrant=False"):
        h.sum().backward()
    ref = nn.Linear(4, 4)
    ref.load_state_dict(block.state_dict())
    r = x
    for _ in range(3):
        r = ref(r)
    r.sum().backward()
    h = x
    for _ in range(3):
        h = checkpoint(block, h, use_reentrant=False)
    h.sum().backward()  # steps once, with the whole gradient
    torch.testing.assert_close(block.weight, ref.weight - 0.1 * ref.weight.grad)
    assert block.weight.grad is None
    opt.remove()


def test_dropped_without_remove_releases_everything():
    """Hooks do not keep the optimizer alive: collected, it stops stepping, and the
    parameters can get a new InBackward (were: stepped forever, refused)."""
    import gc
    import weakref

    model = nn.Linear(3, 2)
    opt = InBackward(model.parameters(), torch.optim.Adam, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    before = model.weight.detach().clone()
    model(torch.randn(4, 3)).sum().backward()
    assert torch.equal(model.weight, before) and model.weight.grad is not None  # ordinary
    model.zero_grad()
    InBackward(model.parameters(), torch.optim.SGD, lr=0.1).remove()


class _GRUHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])  # h_n gets no gradient


def test_per_sample_recomputations_see_the_parameters_before_their_step():
    """A GRU call whose final state gets no gradient was completed at the end of backward,
    after InBackward had stepped the GRU: its individual gradients used the new weights
    (refused by the sum check at a large learning rate, slightly off at a small one)."""
    import leanprop
    from leanprop.testing import individual_gradients_of_losses

    torch.manual_seed(0)
    model = _GRUHead().double()
    ref = _GRUHead().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    losses = ref(x).square().sum(1)
    params = dict(ref.named_parameters())
    expected = individual_gradients_of_losses(losses, params)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=10.0)
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        model(x).square().sum().backward()
    opt.remove()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[k], rtol=1e-9, atol=1e-12, msg=k)
        torch.testing.assert_close(p, params[k] - 10.0 * expected[k].sum(0), msg=k)


class _LocalStep(torch.autograd.Function):
    """A forward that trains a side model with its own backward (local learning)."""

    side: nn.Module

    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():
            _LocalStep.side(x.detach()).square().sum().backward()
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def test_a_backward_inside_a_function_forward_is_not_taken_for_a_reentrant_one():
    """Only a Function's *backward* nests a backward in a running one; one started from a
    Function's forward is ordinary (was refused with the reentrant-checkpoint error)."""
    torch.manual_seed(0)
    side = nn.Linear(3, 1)
    ref = nn.Linear(3, 1)
    ref.load_state_dict(side.state_dict())
    _LocalStep.side = side
    opt = InBackward(side.parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 3, requires_grad=True)
    _LocalStep.apply(x).sum().backward()
    ref(x.detach()).square().sum().backward()
    opt.remove()
    for p, q in zip(side.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q - 0.1 * q.grad)


def test_add_param_group_after_remove_stays_an_ordinary_optimizer():
    a, b = nn.Linear(3, 3), nn.Linear(3, 1)
    opt = InBackward(a.parameters(), torch.optim.SGD, lr=0.1)
    opt.remove()
    opt.add_param_group({"params": b.parameters()})
    before = b.weight.detach().clone()
    b(torch.tanh(a(torch.randn(4, 3)))).sum().backward()
    assert torch.equal(b.weight, before) and b.weight.grad is not None  # not stepped in backward
    opt.step()  # an ordinary step
    assert not torch.equal(b.weight, before)


def test_options_take_any_real_number():
    import numpy as np

    model = nn.Linear(3, 2)
    opt = InBackward(
        model.parameters(), torch.optim.SGD, lr=0.1, bucket_mb=np.float32(1.0),
        clip_grad_norm=np.float64(5.0),
    )  # fmt: skip
    opt.clipped_backward(model(torch.randn(4, 3)).sum(), np.float32(1.0))
    opt.remove()


@pytest.mark.parametrize("clip", [None, "norm", "value", "approximate"])
def test_step_inside_accumulate_steps_the_held_gradients_as_the_plain_optimizer(clip):
    """step() with gradients held (here by accumulate(); trainers hold them too) is the plain
    optimizer's step on them, after any clipping of them (was: an error). InBackward's own
    approximate clipping (clip_grad_norm=) clips held gradients exactly, as clip_grad_norm_
    (it skipped them: an update 40x too large in one case)."""
    data = torch.randn(3, 2, 5, 6)

    def run(ours: bool) -> nn.Module:
        torch.manual_seed(0)
        model = Net()
        approximate = {"clip_grad_norm": 0.05} if clip == "approximate" else {}
        if ours:
            opt = InBackward(_groups(model), torch.optim.AdamW, lr=0.01, **approximate)
        else:
            opt = torch.optim.AdamW(_groups(model), lr=0.01)
        for s in range(3):
            with opt.accumulate() if ours else contextlib.nullcontext():
                for m in range(2):
                    model(data[s, m]).pow(2).mean().backward()
                if clip == "norm" or (clip == "approximate" and not ours):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                elif clip == "value":
                    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
                opt.step()
                opt.zero_grad()
        if ours:
            opt.remove()
        return model

    assert_bitwise_equal(run(True), run(False))


def test_step_with_a_closure_runs_it_once_and_steps_in_its_backward():
    """step(closure), as torch optimizers: the closure runs once, its result is returned, and
    its backward steps (was: "takes no closure")."""
    data = torch.randn(3, 5, 6)
    calls = []

    def run(ours: bool) -> nn.Module:
        torch.manual_seed(0)
        model = Net()
        if ours:
            opt = InBackward(_groups(model), torch.optim.SGD, lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)
        for s in range(3):

            def closure(s=s):
                opt.zero_grad()
                loss = model(data[s]).pow(2).mean()
                loss.backward()
                calls.append(ours)
                return loss

            assert torch.is_tensor(opt.step(closure))
        if ours:
            assert all(p.grad is None for p in model.parameters())  # stepped in backward
            opt.remove()
        return model

    assert_bitwise_equal(run(True), run(False))
    assert calls.count(True) == calls.count(False) == 3


def test_clip_grad_value_of_stepped_gradients_is_refused():
    """clip_grad_value_ on gradients already stepped and freed would clip nothing, silently."""
    model = nn.Linear(3, 2)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(UnsupportedModelError, match=r"clip_grad_value_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    opt.remove()
    assert torch.nn.utils.clip_grad_value_ is not None
    model(torch.randn(4, 3)).sum().backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)  # torch's own again
    assert model.weight.grad.abs().max() <= 0.1


def test_clip_grads_with_norm_of_stepped_gradients_is_refused():
    """torch's clip_grads_with_norm_ (the scaling half of clip_grad_norm_, which accelerate
    calls since 1.16) on gradients already stepped and freed scaled nothing, silently: refused;
    under approximate clipping it has nothing to do; on held gradients it is torch's."""
    gc.collect()
    original = torch.nn.utils.clip_grads_with_norm_
    model = nn.Linear(3, 2)
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    x, total = torch.randn(4, 3), torch.tensor(2.0)
    model(x).sum().backward()
    with pytest.raises(UnsupportedModelError, match=r"clip_grads_with_norm_"):
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1, total)
    with opt.accumulate():
        model(x).sum().backward()
    want = [p.grad * torch.clamp(0.1 / (total + 1e-6), max=1.0) for p in model.parameters()]
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1, total)
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))
    opt.zero_grad()
    opt.remove()
    assert torch.nn.utils.clip_grads_with_norm_ is original
    approx = InBackward(model.parameters(), torch.optim.SGD, lr=0.1, clip_grad_norm=1.0)
    model(x).sum().backward()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1, total)  # (stands in)
    approx.remove()


@pytest.mark.parametrize("call", ["clip_grad_norm_", "clip_grads_with_norm_"])
def test_approximate_clipping_still_clips_the_other_parameters_of_the_call(call):
    """A clipping call over InBackward's parameters (approximate clipping: its rule stands in)
    and a plain optimizer's: the plain optimizer's gradients are clipped as torch clips them
    (they were left unclipped, silently)."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    opt = InBackward(a.parameters(), torch.optim.SGD, lr=0.1, clip_grad_norm=1.0)
    x = torch.randn(4, 3)
    (a(x).sum() + b(x).sum()).backward()
    before = [p.grad.clone() for p in b.parameters()]
    params = [*a.parameters(), *b.parameters()]
    if call == "clip_grad_norm_":
        total = torch.nn.utils.clip_grad_norm_(params, 0.01)  # (the stepped ones' too)
    else:
        total = torch.tensor(50.0)
        torch.nn.utils.clip_grads_with_norm_(params, 0.01, total)
    factor = torch.clamp(0.01 / (total + 1e-6), max=1.0)
    for p, g in zip(b.parameters(), before, strict=True):
        assert torch.equal(p.grad, g * factor)
    opt.remove()


def test_accelerate_imported_after_the_optimizer_is_guarded(monkeypatch):
    """accelerate imported after the InBackward was made, its optimizer never prepared:
    ``Accelerator.clip_grad_norm_`` read 0 for the stepped gradients and clipped none of them,
    silently. Guarded from the next backward on."""
    accelerate = pytest.importorskip("accelerate")
    gc.collect()  # (no other InBackward alive: no guard installed)
    torch.manual_seed(0)
    model, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    with monkeypatch.context() as hidden:
        hidden.delitem(sys.modules, "accelerate.accelerator")
        opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    ref(x).sum().backward()
    acc = accelerate.Accelerator(cpu=True)
    inf = float("inf")
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    assert torch.equal(acc.clip_grad_norm_(model.parameters(), inf), want)
    with pytest.raises(UnsupportedModelError, match=r"nothing left to clip"):
        acc.clip_grad_norm_(model.parameters(), 0.01)
    opt.remove()


def test_finite_clip_call_under_approximate_clipping_returns_the_norm():
    """With InBackward's approximate clipping chosen, a trainer's clip_grad_norm_(params, c)
    returns the pre-clip norm (the approximate rule stands in for it) instead of raising."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1, clip_grad_norm=1.0)
    model(torch.randn(4, 3)).sum().backward()
    assert torch.equal(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), opt.last_grad_norm)
    opt.remove()


def test_amp_scaling_support_is_announced_to_grad_scaler_only():
    """Lightning asks _step_supports_amp_scaling before clipping (bf16-mixed refused clipping);
    only torch's GradScaler gets True (and then the clear refusal)."""
    opt = InBackward(nn.Linear(3, 2).parameters(), torch.optim.SGD, lr=0.1)
    assert getattr(opt, "_step_supports_amp_scaling", False) is False
    opt.remove()


@pytest.mark.parametrize("syncs", [True, False])
def test_accelerate_state_without_accelerate_driving_the_optimizer(syncs):
    """accelerate's shared state outlives its loops. An InBackward that no Accelerator wrapped
    steps in backward as usual where that state says "synchronising"; where it says "not
    synchronising" (left mid-window, or an Accelerator that wrapped the optimizer without the
    state_dict() call leanprop sees: device_placement=False) it is a clear error: stepping
    would step a micro-batch before the last, silently."""
    state = pytest.importorskip("accelerate.state")
    gradient_state = state.GradientState()
    gradient_state._set_sync_gradients(syncs)
    try:
        model = nn.Linear(3, 2)
        opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
        before = model.weight.detach().clone()
        if syncs:
            model(torch.randn(4, 3)).sum().backward()
            assert model.weight.grad is None and not torch.equal(model.weight, before)
        else:
            with pytest.raises(UnsupportedModelError, match=r"device_placement"):
                model(torch.randn(4, 3)).sum().backward()
            assert torch.equal(model.weight, before)
        opt.remove()
    finally:
        state.GradientState._reset_state()


def test_record_norms_off_trains_the_same_and_refuses_norm_reads():
    """record_norms=False skips the extra read of each gradient: the same parameters; reading
    the norm, or clipping the freed gradients, is a clear error (never 0, never unclipped)."""
    data = torch.randn(3, 5, 6)

    def run(record: bool) -> tuple[nn.Module, InBackward]:
        torch.manual_seed(0)
        model = Net()
        opt = InBackward(_groups(model), torch.optim.AdamW, lr=0.01, record_norms=record)
        for s in range(3):
            model(data[s]).pow(2).mean().backward()
        return model, opt

    (kept, kept_opt), (lean, lean_opt) = run(True), run(False)
    assert_bitwise_equal(kept, lean)
    with pytest.raises(UnsupportedModelError, match=r"record_norms=False"):
        _ = lean_opt.last_grad_norm
    with pytest.raises(UnsupportedModelError, match=r"record_norms=False"):
        torch.nn.utils.clip_grad_norm_(lean.parameters(), float("inf"))
    with pytest.raises(UnsupportedModelError, match=r"nothing left to clip"):
        torch.nn.utils.clip_grad_norm_(lean.parameters(), 1.0)
    with pytest.raises(LeanpropValueError, match=r"record_norms=False"):
        InBackward(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1, clip_grad_norm=1.0,
                   record_norms=False)  # fmt: skip
    kept_opt.remove()
    lean_opt.remove()
