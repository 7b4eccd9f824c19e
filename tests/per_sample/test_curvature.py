"""GGN quantities against the float64 oracle ``G = J^T H J`` (full Jacobians and loss Hessians
by autograd) on the case registry, and the loss-Hessian factors against autograd Hessians."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import leanprop
from leanprop import LeanpropValueError, UnsupportedModelError
from leanprop.per_sample.curvature.loss_hessian import sqrt_hessian
from leanprop.testing import ggn_blocks, hessian_blocks, individual_gradients_of_losses
from tests.cases import CASES, build
from tests.helpers import assert_same_derivatives, kfra_oracle, positive_curvature_blocks

MATH = SDPBackend.MATH
EXACT = (leanprop.DiagGGNExact(), leanprop.BatchDiagGGNExact(), leanprop.SqrtGGNExact())


def _losses(case) -> list[nn.Module]:
    """The loss modules that fit the case's output and targets."""
    with torch.no_grad():
        out = case.model(case.x)
    if not case.y.is_floating_point():
        return [nn.CrossEntropyLoss(reduction=r) for r in ("mean", "sum")] if out.dim() == 2 else []
    return [nn.MSELoss(reduction="mean"), nn.MSELoss(reduction="sum"), nn.BCEWithLogitsLoss()]


def _target(loss_fn, y):
    return torch.sigmoid(y) if isinstance(loss_fn, nn.BCEWithLogitsLoss) else y


def _cases():
    for name in CASES:
        for i, loss_fn in enumerate(_losses(build(name))):
            yield pytest.param(name, i, id=f"{name}-{type(loss_fn).__name__}-{loss_fn.reduction}")


# (the oracle's jacrev of attention: torch warns that vmap has no batching rule for it)
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize(("name", "which"), list(_cases()))
def test_exact_ggn_quantities_against_oracle(name, which):
    case = build(name)
    loss_fn = _losses(case)[which]
    y = _target(loss_fn, case.y)
    model = case.model
    with leanprop.per_sample(model, leanprop.BatchGrad()) as ctx:
        out = model(case.x)
        leanprop.ggn(ctx, out, loss_fn, y, *EXACT)
        loss_fn(out, y).backward()
        grad_batch = {
            k: p.grad_batch.clone() for k, p in model.named_parameters() if p.requires_grad
        }
    ref = ggn_blocks(model, case.x, loss_fn, y)
    for k, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "diag_ggn_exact")
            continue
        full, per = ref[k]
        torch.testing.assert_close(
            p.diag_ggn_exact.flatten(), full.diagonal(), rtol=1e-10, atol=1e-12, msg=k
        )
        torch.testing.assert_close(
            p.diag_ggn_exact_batch.flatten(1), per, rtol=1e-10, atol=1e-12, msg=k
        )
        root = p.sqrt_ggn_exact.flatten(2).flatten(0, 1)  # [M*N, P]
        torch.testing.assert_close(root.t() @ root, full, rtol=1e-10, atol=1e-12, msg=k)
        assert p.sqrt_ggn_exact.shape[1:] == (case.x.shape[0], *p.shape)
        # the first-order results and .grad are the loss's own
        assert p.grad_batch.shape == grad_batch[k].shape
        torch.testing.assert_close(p.grad, p.grad_batch.sum(0), rtol=1e-10, atol=1e-12)


def test_grad_and_first_order_results_are_left_as_they_were():
    """After ``loss.backward()`` (graph retained), ``ggn`` leaves ``.grad`` and the context's
    quantities as the loss's backward made them."""
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(case.model, leanprop.BatchGrad(), leanprop.Variance()) as ctx:
        out = case.model(case.x)
        loss_fn(out, case.y).backward(retain_graph=True)
        before = {k: (p.grad.clone(), p.grad_batch.clone(), p.variance.clone())
                  for k, p in case.model.named_parameters()}  # fmt: skip
        leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.DiagGGNExact())
    for k, p in case.model.named_parameters():
        assert torch.equal(p.grad, before[k][0])
        assert torch.equal(p.grad_batch, before[k][1])
        assert torch.equal(p.variance, before[k][2])
        assert not hasattr(p, "sum_grad_squared")


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(),
        nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.2),
        nn.CrossEntropyLoss(weight=torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)),
        nn.CrossEntropyLoss(weight=torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64),
                            label_smoothing=0.1, ignore_index=2),
        nn.MSELoss(),
        nn.MSELoss(reduction="sum"),
        nn.BCEWithLogitsLoss(),
        nn.BCEWithLogitsLoss(reduction="sum"),
    ],
    ids=lambda f: repr(f),
)  # fmt: skip
def test_factor_reproduces_the_loss_hessian(loss_fn):
    torch.manual_seed(0)
    n, c = 5, 4
    out = torch.randn(n, c, dtype=torch.float64, requires_grad=True)
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        y = torch.tensor([0, 2, 3, 1, 2])  # (index 2 is ignored where ignore_index=2)
    else:
        y = torch.rand(n, c, dtype=torch.float64)
    v = sqrt_hessian(loss_fn, out, y)  # [M, N, C]
    hess = torch.autograd.functional.hessian(lambda o: loss_fn(o, y), out.detach())
    got = torch.einsum("mnk,mnl->nkl", v, v)
    for i in range(n):
        torch.testing.assert_close(got[i], hess[i, :, i, :], rtol=1e-12, atol=1e-14)
    off = hess.clone()
    for i in range(n):
        off[i, :, i, :] = 0
    assert off.abs().max() == 0  # block diagonal: the factor covers all of it


@pytest.mark.parametrize(
    "loss_fn", [nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum"), nn.BCEWithLogitsLoss()],
    ids=lambda f: type(f).__name__,
)  # fmt: skip
def test_monte_carlo_factor_is_unbiased(loss_fn):
    """The MC factor's ``sum_m v v^T`` estimates the Hessian: with 200 000 draws its mean is
    within a few standard errors."""
    torch.manual_seed(0)
    n, c, m = 3, 4, 200_000
    out = torch.randn(n, c, dtype=torch.float64)
    y = torch.tensor([0, 2, 3]) if isinstance(loss_fn, nn.CrossEntropyLoss) else torch.rand(n, c)
    y = y.double() if y.is_floating_point() else y
    v = sqrt_hessian(loss_fn, out, y, mc_samples=m, generator=torch.Generator().manual_seed(1))
    assert v.shape == (m, n, c)
    est = torch.einsum("mnk,mnl->nkl", v, v)
    outer = torch.einsum("mnk,mnl->mnkl", v, v) * m  # each draw's estimate
    se = outer.std(0) / m**0.5
    hess = torch.autograd.functional.hessian(lambda o: loss_fn(o, y), out)
    exact = torch.stack([hess[i, :, i, :] for i in range(n)])
    assert ((est - exact).abs() <= 5 * se + 1e-12).all()


def test_monte_carlo_quantities_share_one_draw_and_follow_the_generator():
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    results = []
    for _ in range(2):
        with leanprop.per_sample(case.model, leanprop.BatchGrad()) as ctx:
            out = case.model(case.x)
            leanprop.ggn(
                ctx, out, loss_fn, case.y, leanprop.DiagGGNMC(3), leanprop.SqrtGGNMC(3),
                leanprop.BatchDiagGGNMC(3), generator=torch.Generator().manual_seed(5),
            )  # fmt: skip
        w = case.model[0].weight
        assert w.sqrt_ggn_mc.shape == (3, 6, *w.shape)
        torch.testing.assert_close(w.diag_ggn_mc, w.sqrt_ggn_mc.square().sum((0, 1)))
        torch.testing.assert_close(w.diag_ggn_mc_batch, w.sqrt_ggn_mc.square().sum(0))
        results.append(w.diag_ggn_mc.clone())
    assert torch.equal(results[0], results[1])


def test_monte_carlo_ggn_converges_to_the_exact_one():
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(case.model, leanprop.BatchGrad()) as ctx:
        out = case.model(case.x)
        leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.DiagGGNExact(), leanprop.DiagGGNMC(4000),
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    for p in case.model.parameters():
        torch.testing.assert_close(p.diag_ggn_mc, p.diag_ggn_exact, rtol=0.1, atol=1e-3)


def test_bad_input_is_explained():
    case = build("mlp")
    model = case.model
    with leanprop.per_sample(model, leanprop.BatchGrad()) as ctx:
        out = model(case.x)
        y = case.y
        with pytest.raises(LeanpropValueError, match="no quantity"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y)
        with pytest.raises(LeanpropValueError, match="instance"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.DiagGGNExact)
        with pytest.raises(LeanpropValueError, match="first-order"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.BatchGrad())
        with pytest.raises(LeanpropValueError, match="NLLLoss"):
            leanprop.ggn(ctx, out, nn.NLLLoss(), y, leanprop.DiagGGNExact())
        with pytest.raises(LeanpropValueError, match="reduction"):
            leanprop.ggn(
                ctx, out, nn.CrossEntropyLoss(reduction="none"), y, leanprop.DiagGGNExact()
            )
        with pytest.raises(LeanpropValueError, match="class-index"):
            leanprop.ggn(
                ctx, out, nn.CrossEntropyLoss(), out.softmax(1).detach(), leanprop.DiagGGNExact()
            )
        with pytest.raises(LeanpropValueError, match="pos_weight"):
            leanprop.ggn(ctx, out, nn.BCEWithLogitsLoss(pos_weight=torch.ones(3)), out.detach(),
                         leanprop.DiagGGNExact())  # fmt: skip
        with pytest.raises(LeanpropValueError, match="shape"):
            leanprop.ggn(ctx, out, nn.MSELoss(), out.detach()[:, :1], leanprop.DiagGGNExact())
        with pytest.raises(LeanpropValueError, match="require grad"):
            leanprop.ggn(ctx, out.detach(), nn.CrossEntropyLoss(), y, leanprop.DiagGGNExact())
        with pytest.raises(LeanpropValueError, match="same mc_samples"):
            leanprop.ggn(
                ctx, out, nn.CrossEntropyLoss(), y, leanprop.DiagGGNMC(1), leanprop.SqrtGGNMC(2)
            )
        for bad in (0, 1.5, True):
            with pytest.raises(LeanpropValueError, match="mc_samples"):
                leanprop.DiagGGNMC(bad)
    with pytest.raises(LeanpropValueError, match="entered per_sample context"):
        leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.DiagGGNExact())
    with pytest.raises(LeanpropValueError, match="ggn"):
        leanprop.per_sample(model, leanprop.DiagGGNExact())


def test_ggn_after_the_backward_of_a_module_hooked_as_a_whole_is_refused_clearly():
    """An RNN (torch.func fallback) keeps its inputs for the backward passes up to the first
    after the forward: ggn before loss.backward() works (the oracle test), after it says so
    and leaves nothing behind."""
    case = build("recurrent")
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(case.model, leanprop.BatchGrad()) as ctx:
        out = case.model(case.x)
        loss_fn(out, case.y).backward(retain_graph=True)
        grads = [p.grad.clone() for p in case.model.parameters()]
        with pytest.raises(UnsupportedModelError, match=r"before loss\.backward"):
            leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.DiagGGNExact())
        for p, g in zip(case.model.parameters(), grads, strict=True):
            assert torch.equal(p.grad, g) and not hasattr(p, "diag_ggn_exact")
            assert hasattr(p, "grad_batch")


# ---------------------------------------------------------------- Kronecker factors


def _kron_problem(conv: int | None, n: int):
    torch.manual_seed(0)
    if conv is None:
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        x = torch.randn(n, 4)
    else:
        conv_cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[conv - 1]
        model = nn.Sequential(
            conv_cls(2, 3, 2, stride=1, padding=1), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)
        )
        x = torch.randn(n, 2, *([4] * conv))
        model(x)
    return model.double(), x.double(), torch.randint(0, 3, (n,))


@pytest.mark.parametrize("conv", [None, 1, 2, 3], ids=["linear", "conv1d", "conv2d", "conv3d"])
def test_kflr_is_the_ggn_block_where_it_is_exact(conv):
    """With one sample a linear layer's ``B ⊗ A`` is its weight's GGN block, and for any batch
    ``B`` is the bias's (linear layers and convolutions)."""
    for n in (1, 5):
        model, x, y = _kron_problem(conv, n)
        loss_fn = nn.CrossEntropyLoss()
        with leanprop.per_sample(model) as ctx:
            leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.KFLR())
        ref = ggn_blocks(model, x, loss_fn, y)
        for k, p in model.named_parameters():
            full = ref[k][0]
            if k.endswith("bias"):
                (b,) = p.kflr
                torch.testing.assert_close(b, full, rtol=1e-10, atol=1e-12, msg=k)
            else:
                b, a = p.kflr
                assert b.shape == (p.shape[0],) * 2 and a.shape == (p[0].numel(),) * 2
                if n == 1 and p.dim() == 2:
                    torch.testing.assert_close(torch.kron(b, a), full, rtol=1e-10, atol=1e-12)


def _input_factor_oracle(conv: nn.Module, x: Tensor) -> Tensor:
    """``A = 1/N sum_{n,l} P[n, :, l] P[n, :, l]^T`` with the patches ``P[n, k, l]`` read off
    the convolution as the derivative of output channel 0 at position l with respect to
    weight element ``(0, k)`` (no unfold of ours)."""

    def channel0(w: Tensor) -> Tensor:
        weight = torch.cat([w[None], conv.weight[1:].detach()])
        return conv._conv_forward(x, weight, None)[:, 0].flatten(1)  # [N, L]

    p = torch.func.jacrev(channel0)(conv.weight[0].detach()).flatten(2)  # [N, L, K]
    return torch.einsum("nlk,nlj->kj", p, p) / x.shape[0]


@pytest.mark.parametrize("conv", [1, 2, 3], ids=["conv1d", "conv2d", "conv3d"])
@pytest.mark.parametrize("kind", ["KFLR", "KFAC"])
def test_convolution_factors_from_the_batched_columns(conv, kind, monkeypatch):
    """A CNN's Kronecker factors come from the loss factor's columns backpropagated by
    autograd to the layers' outputs, without the engine's per-sample passes: ``A`` is the
    patches' (an oracle read off the convolution), the weight's ``B`` is the bias's (its exact
    GGN block, checked above), and both equal those of one engine pass per column (the same
    Monte-Carlo draws)."""
    ggn_module = importlib.import_module("leanprop.per_sample.curvature.ggn")
    model, x, y = _kron_problem(conv, 5)
    model = nn.Sequential(*model[:2], type(model[0])(3, 2, 3, padding=2, stride=2, dilation=2),
                          *model[2:-1], nn.LazyLinear(3)).double()  # fmt: skip
    model(x)
    loss_fn = nn.CrossEntropyLoss()
    got, calls = [], []
    real = ggn_module._passes
    for passes in (False, True):
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(ggn_module, "_passes", lambda *a, **k: calls.append(1) or real(*a, **k))
            if passes:
                m.setattr(ggn_module, "_batched", lambda *a: None)
            q = getattr(leanprop, kind)(*(() if kind == "KFLR" else (3,)))
            with leanprop.per_sample(model) as ctx:
                gen = torch.Generator().manual_seed(1)
                leanprop.ggn(ctx, model(x), loss_fn, y, q, generator=gen)
        assert len(calls) == int(passes)
        got.append({k: getattr(p, q.attr) for k, p in model.named_parameters()})
    for k in got[0]:
        for ours, theirs in zip(got[0][k], got[1][k], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12, msg=k)
    for i in (0, 2):
        conv_layer = model[i]
        inputs = x if i == 0 else model[:2](x).detach()
        b, a = got[0][f"{i}.weight"]
        torch.testing.assert_close(a, _input_factor_oracle(conv_layer, inputs), rtol=1e-10,
                                   atol=1e-12)  # fmt: skip
        torch.testing.assert_close(b, got[0][f"{i}.bias"][0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("conv", "kind"), [(None, "KFLR"), (2, "KFLR"), (None, "KFRA")],
    ids=["linear-KFLR", "conv2d-KFLR", "linear-KFRA"],
)  # fmt: skip
def test_kronecker_factors_under_create_graph_differentiate_as_the_ggn_block(conv, kind):
    """``ggn(KFLR() or KFRA(), create_graph=True)``: where the factors are exact GGN blocks
    (KFLR: the bias's ``B`` for any batch; both: a linear weight's ``B ⊗ A`` and the bias's
    ``B`` for one sample), the gradient of a random functional of them equals that of the
    oracle's blocks (autograd through J and H)."""
    q = getattr(leanprop, kind)()
    for n in (1, 5) if kind == "KFLR" else (1,):
        model, x, y = _kron_problem(conv, n)
        loss_fn = nn.CrossEntropyLoss()
        with leanprop.per_sample(model) as ctx:
            leanprop.ggn(ctx, model(x), loss_fn, y, q, create_graph=True)
        ref = ggn_blocks(model, x, loss_fn, y, differentiable=True)
        gen = torch.Generator().manual_seed(n)
        ours = theirs = 0
        for k, p in model.named_parameters():
            full = ref[k][0]
            factors = getattr(p, q.attr)
            if k.endswith("bias"):
                (block,) = factors
            elif n == 1 and p.dim() == 2:
                block = torch.kron(*factors)
            else:
                continue
            r = torch.randn(full.shape, generator=gen, dtype=full.dtype)
            ours, theirs = ours + (block * r).sum(), theirs + (full * r).sum()
        params = list(model.parameters())
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
        got = torch.autograd.grad(ours, params, allow_unused=True)
        want = torch.autograd.grad(theirs, params, allow_unused=True)
        for p, a, b in zip(params, got, want, strict=True):
            a = torch.zeros_like(p) if a is None else a
            b = torch.zeros_like(p) if b is None else b
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


class _AttentionHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.att = nn.Embedding(7, 4), nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens):
        h = self.emb(tokens)
        return self.head(self.att(h, h, h, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("kind", ["KFLR", "KFAC"])
def test_kronecker_factors_refuse_parameters_outside_linear_and_conv_layers(kind):
    """An embedding's and an attention's parameters (used at the op level) have no Kronecker
    factors: they were left without the attribute, silently, while the head got its factors.
    Refused, naming them; frozen, the head's factors are its KFLR as without them."""
    torch.manual_seed(0)
    model = _AttentionHead().double()
    tokens, y = torch.randint(0, 7, (3, 5)), torch.randint(0, 3, (3,))
    q = getattr(leanprop, kind)()
    with leanprop.per_sample(model) as ctx:
        out = model(tokens)
        with pytest.raises(UnsupportedModelError, match=f"{kind}: 5 parameter.*'emb.weight'"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, q)
    assert not any(hasattr(p, q.attr) for p in model.parameters())
    for p in [*model.emb.parameters(), *model.att.parameters()]:
        p.requires_grad_(False)
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, model(tokens), nn.CrossEntropyLoss(), y, leanprop.KFLR())
    h = model.att(*[model.emb(tokens)] * 3, need_weights=False)[0].mean(1).detach()
    ref = ggn_blocks(model.head, h, nn.CrossEntropyLoss(), y)
    torch.testing.assert_close(model.head.bias.kflr[0], ref["bias"][0], rtol=1e-10, atol=1e-13)


def test_kfac_estimates_kflr():
    model, x, y = _kron_problem(2, 4)
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.KFLR())
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.KFAC(mc_samples=3000),
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    for p in model.parameters():
        for got, exact in zip(p.kfac, p.kflr, strict=True):
            torch.testing.assert_close(got, exact, rtol=0.1, atol=0.05 * exact.abs().max().item())


class _Tagger(nn.Module):
    """Token logits in torch's layout for cross-entropy: ``[N, C, T]``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(7, 4), nn.Linear(4, 5)

    def forward(self, tokens):
        return self.lin(torch.tanh(self.emb(tokens))).transpose(1, 2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options", [{}, {"ignore_index": 2, "label_smoothing": 0.1}, "weight"])
def test_token_level_cross_entropy_against_the_oracle(reduction, options):
    """Cross-entropy on [N, C, T] (a class per token; targets [N, T]): each position a block of
    the sample's Hessian, C columns each; T == N, where a mixed-up axis would not show in the
    shapes."""
    torch.manual_seed(0)
    model = _Tagger().double()
    tokens, y = torch.randint(0, 7, (4, 4)), torch.randint(0, 5, (4, 4))
    if options == "weight":
        options = {"weight": torch.rand(5, dtype=torch.float64)}
    loss_fn = nn.CrossEntropyLoss(reduction=reduction, **options)
    with leanprop.per_sample(model) as ctx:
        out = model(tokens)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.DiagGGNExact(), leanprop.BatchDiagGGNExact(),
                     leanprop.SqrtGGNExact())  # fmt: skip
    ref = ggn_blocks(model, tokens, loss_fn, y)
    for k, p in model.named_parameters():
        full, per = ref[k]
        torch.testing.assert_close(p.diag_ggn_exact.flatten(), full.diagonal(), rtol=1e-10,
                                   atol=1e-13, msg=k)  # fmt: skip
        torch.testing.assert_close(p.diag_ggn_exact_batch.flatten(1), per, rtol=1e-10, atol=1e-13)
        root = p.sqrt_ggn_exact.flatten(2).flatten(0, 1)
        assert p.sqrt_ggn_exact.shape[0] == 5 * 4  # C columns per position
        torch.testing.assert_close(root.T @ root, full, rtol=1e-10, atol=1e-13)
    with leanprop.per_sample(model) as ctx:  # the Monte-Carlo estimate converges
        out = model(tokens)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.DiagGGNMC(mc_samples=4000),
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    for k, p in model.named_parameters():
        exact = ref[k][0].diagonal()
        scale = exact.abs().max().item()
        torch.testing.assert_close(p.diag_ggn_mc.flatten(), exact, rtol=0, atol=0.06 * scale)


@pytest.mark.parametrize("loss", ["ce", "mse", "bce"])
@pytest.mark.parametrize("act", [nn.ReLU, nn.Sigmoid, nn.Tanh, nn.GELU])
def test_kfra_against_its_definition(act, loss):
    """KFRA by brute force: the loss's summed Hessian carried back module by module, averaged
    over the batch after each (a final activation and a flatten included); with one sample
    the last layer's ``B ⊗ A`` is its GGN block."""
    for n in (1, 6):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), act(), nn.Linear(5, 4), act(),
                              nn.Linear(4, 3), nn.Tanh()).double()  # fmt: skip
        x = torch.randn(n, 2, 3, dtype=torch.float64)
        loss_fn = {"ce": nn.CrossEntropyLoss(), "mse": nn.MSELoss(reduction="sum"),
                   "bce": nn.BCEWithLogitsLoss()}[loss]  # fmt: skip
        y = torch.randint(0, 3, (n,)) if loss == "ce" else torch.rand(n, 3, dtype=torch.float64)
        with leanprop.per_sample(model) as ctx:
            leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.KFRA())
        expected = kfra_oracle(model, x, loss_fn, y)
        for k, p in model.named_parameters():
            assert len(p.kfra) == len(expected[k]), k
            for i, (a, b) in enumerate(zip(p.kfra, expected[k], strict=True)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13, msg=f"{k}[{i}]")
    model = nn.Sequential(nn.Linear(6, 3)).double()  # one layer, one sample: the GGN block
    x, y = torch.randn(1, 6, dtype=torch.float64), torch.tensor([2])
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, model(x), nn.CrossEntropyLoss(), y, leanprop.KFRA())
    full = ggn_blocks(model, x, nn.CrossEntropyLoss(), y)["0.weight"][0]
    torch.testing.assert_close(torch.kron(*model[0].weight.kfra), full, rtol=1e-10, atol=1e-12)


def _conv_chain(d: int, pools: bool) -> nn.Sequential:
    """Convolutions with what lies between them in CNNs: activations, zero padding, max and
    average pooling, a flatten, then linear layers."""
    conv, max_pool, avg_pool = {
        1: (nn.Conv1d, nn.MaxPool1d, nn.AvgPool1d), 2: (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d),
        3: (nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d),
    }[d]  # fmt: skip
    pad = {  # (a constant other than zero: the same Jacobian)
        1: lambda: nn.ConstantPad1d((1, 2), 0.5), 2: lambda: nn.ZeroPad2d((1, 0, 0, 1)),
        3: lambda: nn.ConstantPad3d(1, 0.0),
    }[d]  # fmt: skip
    layers = [conv(2, 3, 3, padding=1), nn.ReLU()]
    layers += [max_pool(2), pad()] if pools else [pad()]
    layers += [conv(3, 4, 2, stride=2, dilation=1 if pools else 2), nn.Sigmoid()]
    layers += [avg_pool(2)] if pools else []
    return nn.Sequential(*layers, nn.Flatten(), nn.LazyLinear(5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("pools", [True, False], ids=["pools", "no-pools"])
def test_kfra_on_convolutions_against_its_definition(d, pools):
    """KFRA through convolutions, max and average pooling, padding and flattening, against its
    definition (each module's per-sample Jacobians by jacrev). Batches of 1, 3 (not dividing
    the units carried back, packed N per pass), 4 (== the channels of the last convolution)
    and 9 (more samples than some layers' units per sample)."""
    side = {1: 10, 2: 8, 3: 4}[d]
    for n in (1, 3, 4, 9):
        torch.manual_seed(n)
        model = _conv_chain(d, pools)
        x = torch.randn(n, 2, *([side] * d))
        model(x)  # (the lazy layer's size)
        model, x = model.double(), x.double()
        y = torch.randint(0, 3, (n,))
        loss_fn = nn.CrossEntropyLoss()
        with leanprop.per_sample(model) as ctx:
            leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.KFRA())
        expected = kfra_oracle(model, x, loss_fn, y)
        assert expected.keys() == dict(model.named_parameters()).keys()
        for k, p in model.named_parameters():
            assert len(p.kfra) == len(expected[k]), k
            for i, (a, b) in enumerate(zip(p.kfra, expected[k], strict=True)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13, msg=f"{k}[{i}], N={n}")


@pytest.mark.parametrize("d", [2, 3])
def test_kfra_through_adaptive_pooling_against_its_definition(d):
    conv = (nn.Conv2d, nn.Conv3d)[d - 2]
    max_pool, avg_pool = {
        2: (nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d),
        3: (nn.AdaptiveMaxPool3d, nn.AdaptiveAvgPool3d),
    }[d]  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(conv(2, 3, 2), nn.ReLU(), max_pool(3), conv(3, 4, 2), nn.Tanh(),
                          avg_pool(1), nn.Flatten(), nn.Linear(4, 3)).double()  # fmt: skip
    x, y = torch.randn(3, 2, *([6] * d), dtype=torch.float64), torch.randint(0, 3, (3,))
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.KFRA())
    expected = kfra_oracle(model, x, loss_fn, y)
    for k, p in model.named_parameters():
        for i, (a, b) in enumerate(zip(p.kfra, expected[k], strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13, msg=f"{k}[{i}]")


def test_kfra_of_a_convolution_with_one_sample_is_kflr():
    """With one sample nothing is averaged: a convolution's KFRA factors are its KFLR ones
    (computed by other code: the GGN's square root backpropagated)."""
    torch.manual_seed(0)
    model = _conv_chain(2, pools=True)
    x = torch.randn(1, 2, 8, 8)
    model(x)
    model, x, y = model.double(), x.double(), torch.tensor([1])
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.KFRA(), leanprop.KFLR())
    for k, p in model.named_parameters():
        for a, b in zip(p.kfra, p.kflr, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13, msg=k)


def test_kfra_through_convolutions_under_create_graph():
    """``create_graph=True``: the factors carried back through a convolution (and pooling)
    are the same values, and differentiate as the oracle's (autograd through every step)."""
    torch.manual_seed(0)
    model = _conv_chain(2, pools=True)
    x = torch.randn(3, 2, 8, 8)
    model(x)
    model, x, y = model.double(), x.double(), torch.randint(0, 3, (3,))
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.KFRA(), create_graph=True)
    params = list(model.parameters())
    factors = [t for p in params for t in p.kfra]
    oracle = kfra_oracle(model, x, loss_fn, y, differentiable=True)
    expected = [t for k, _ in model.named_parameters() for t in oracle[k]]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in factors]
    ours = sum((t * w).sum() for t, w in zip(factors, weights, strict=True))
    theirs = sum((t * w).sum() for t, w in zip(expected, weights, strict=True))
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(ours, params, allow_unused=True)
    want = torch.autograd.grad(theirs, params, allow_unused=True)
    for p, a, b in zip(params, got, want, strict=True):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.c(torch.tanh(self.a(x)) + self.b(x))


def test_kfra_refuses_what_is_not_a_chain_of_linear_layers():
    loss_fn = nn.MSELoss()
    shared = nn.Linear(3, 3)
    cases = {
        "two layers": (_Branches(), torch.randn(4, 3)),
        "groups=2": (
            nn.Sequential(nn.Conv1d(2, 2, 3, groups=2), nn.Flatten()),
            torch.randn(4, 2, 5),
        ),
        "padding_mode='reflect'": (
            nn.Sequential(nn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect"), nn.Flatten()),
            torch.randn(4, 2, 5),
        ),
        r"a Linear layer \(not a linear one on \[N, I\]": (
            nn.Sequential(nn.Linear(3, 3), nn.Tanh()),
            torch.randn(4, 5, 3),
        ),
        "each used once": (nn.Sequential(shared, nn.Tanh(), shared), torch.randn(4, 3)),
    }
    for match, (model, x) in cases.items():
        with leanprop.per_sample(model) as ctx:
            out = model(x)
            with pytest.raises(UnsupportedModelError, match=f"KFRA.*{match}"):
                leanprop.ggn(ctx, out, loss_fn, torch.zeros_like(out), leanprop.KFRA())


def test_kronecker_factors_refuse_what_they_do_not_define():
    loss_fn = nn.MSELoss()
    cases = {
        "in_features": (nn.Linear(3, 2), torch.randn(4, 5, 3)),
        "groups": (nn.Conv1d(2, 2, 3, groups=2), torch.randn(4, 2, 6)),
        "padding": (nn.Conv1d(2, 2, 3, padding="same"), torch.randn(4, 2, 6)),
    }
    for match, (layer, x) in cases.items():
        with leanprop.per_sample(layer) as ctx:
            out = layer(x)
            with pytest.raises(UnsupportedModelError, match=match):
                leanprop.ggn(ctx, out, loss_fn, torch.zeros_like(out), leanprop.KFLR())
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    with leanprop.per_sample(model) as ctx:
        out = model(torch.randn(4, 3))
        with pytest.raises(UnsupportedModelError, match="more than once"):
            leanprop.ggn(ctx, out, loss_fn, torch.zeros_like(out), leanprop.KFAC())


@pytest.mark.parametrize("name", ["mlp", "conv2d", "shared", "sequence"])
def test_ggn_matrix_products_against_oracle(name):
    case = build(name)
    loss_fn = _losses(case)[0]
    y = _target(loss_fn, case.y)
    with leanprop.per_sample(case.model) as ctx:
        leanprop.ggn(ctx, case.model(case.x), loss_fn, y, leanprop.GGNMP())
    ref = ggn_blocks(case.model, case.x, loss_fn, y)
    for k, p in case.model.named_parameters():
        mat = torch.randn(3, *p.shape, dtype=p.dtype)
        got = p.ggnmp(mat)
        torch.testing.assert_close(
            got.flatten(1), mat.flatten(1) @ ref[k][0], rtol=1e-10, atol=1e-12
        )
        with pytest.raises(LeanpropValueError, match="V, "):
            p.ggnmp(mat[0])


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize(("name", "which"), list(_cases()))
def test_hessian_matrix_products_against_oracle(name, which):
    """``HMP``: every case of the registry (weight sharing, attention, sequences, convolutions),
    every loss: ``p.hmp(mat)`` is the parameter's block of autograd's full Hessian times mat."""
    case = build(name)
    loss_fn = _losses(case)[which]
    y = _target(loss_fn, case.y)
    # (the fused attention kernels have no second derivative: the math one has)
    with leanprop.per_sample(case.model, leanprop.BatchGrad()) as ctx, sdpa_kernel(MATH):
        out = case.model(case.x)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.HMP())
        loss_fn(out, y).backward(retain_graph=True)
        products = {k: p.hmp for k, p in case.model.named_parameters() if p.requires_grad}
    with sdpa_kernel(MATH):
        ref = hessian_blocks(case.model, case.x, loss_fn, y)
    for k, hmp in products.items():
        p = case.model.get_parameter(k)
        mat = torch.randn(3, *p.shape, dtype=p.dtype)
        torch.testing.assert_close(
            hmp(mat).flatten(1), mat.flatten(1) @ ref[k], rtol=1e-10, atol=1e-12, msg=k
        )


def test_hessian_matrix_products_refuse_clearly():
    """Bad ``mat``, a graph the backward freed, a parameter stepped since: clear errors."""
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    p = next(case.model.parameters())
    with leanprop.per_sample(case.model) as ctx:
        out = case.model(case.x)
        leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.HMP())
        with pytest.raises(LeanpropValueError, match=r"\[V, \*p.shape\]"):
            p.hmp(torch.zeros(p.shape, dtype=p.dtype))
        before = p.hmp(torch.ones(1, *p.shape, dtype=p.dtype))  # before backward: fine
        loss_fn(out, case.y).backward()  # (no retain_graph: the forward's graph goes)
        with pytest.raises(UnsupportedModelError, match="retain_graph=True"):
            p.hmp(torch.ones(1, *p.shape, dtype=p.dtype))
    last = list(case.model.parameters())[-1]
    steps = (  # an optimizer's step of another layer (p's block depends on it; that layer's
        lambda: last.add_(1.0),  # backward reads it, autograd cannot see it), and an
        lambda: setattr(last, "data", last.data + 1.0),  # old-style step to a new tensor
    )
    for step in steps:
        with leanprop.per_sample(case.model) as ctx:
            out = case.model(case.x)
            leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.HMP())
            loss_fn(out, case.y).backward(retain_graph=True)
        again = p.hmp(torch.ones(1, *p.shape, dtype=p.dtype))  # after the block: fine
        with torch.no_grad():
            step()
        with pytest.raises(UnsupportedModelError, match="changed in place"):
            p.hmp(torch.ones(1, *p.shape, dtype=p.dtype))
        with torch.no_grad():
            last.sub_(1.0)
        if step is steps[0]:
            torch.testing.assert_close(before, again, rtol=1e-12, atol=1e-14)


def test_hessian_matrix_products_of_the_forward_values_after_data_steps():
    """Parameters stepped through ``.data`` after the products were formed (an optimizer
    taking one parameter after another, BackPACK's Newton-CG example; the version counter
    does not move): each product is the forward's (the stepped layer's values put back while
    it runs, its new ones restored after), exactly as if nothing had been stepped."""
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    params = list(case.model.parameters())
    mats = [torch.randn(2, *q.shape, dtype=q.dtype) for q in params]
    with leanprop.per_sample(case.model) as ctx:
        out = case.model(case.x)
        leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.HMP(), leanprop.PCHMP())
        loss_fn(out, case.y).backward(retain_graph=True)
    want = [(q.hmp(m), q.pchmp(m)) for q, m in zip(params, mats, strict=True)]
    last = params[-2]
    assert last.shape[0] > 1 and not torch.equal(last.data[0], last.data[1])
    last.data[[0, 1]] = last.data[[1, 0]]  # (rows swapped: sums and versions unchanged)
    for i, q in enumerate(params):
        q.data.add_(0.5)  # each stepped in turn, the products of later ones taken after
        stepped = [r.detach().clone() for r in params]
        got = (params[-1 - i].hmp(mats[-1 - i]), params[-1 - i].pchmp(mats[-1 - i]))
        for g, w in zip(got, want[-1 - i], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
        for r, s in zip(params, stepped, strict=True):  # the new values are back
            assert torch.equal(r.detach(), s)


def test_hessian_matrix_products_leave_the_context_alone():
    """The products' passes compute no per-sample quantity and do not disturb the context:
    taken inside the block between forward and backward, the backward's results are as
    without them."""
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    results = []
    for products in (True, False):
        with leanprop.per_sample(case.model, leanprop.BatchGrad()) as ctx:
            out = case.model(case.x)
            if products:
                leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.HMP())
                for p in case.model.parameters():
                    p.hmp(torch.randn(2, *p.shape, dtype=p.dtype))
            loss_fn(out, case.y).backward()
        results.append({k: (p.grad_batch, p.grad) for k, p in case.model.named_parameters()})
        case.model.zero_grad()
    for k, (grad_batch, grad) in results[0].items():
        assert torch.equal(grad_batch, results[1][k][0]), k
        assert torch.equal(grad, results[1][k][1]), k


def test_subsampling_keeps_the_chosen_samples():
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(case.model, leanprop.BatchGrad()) as ctx:
        out = case.model(case.x)
        leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.SqrtGGNExact())
        loss_fn(out, case.y).backward()
    full = {
        k: (p.grad_batch.clone(), p.sqrt_ggn_exact.clone())
        for k, p in case.model.named_parameters()
    }
    case.model.zero_grad()
    pick = [4, 0, -1]
    with leanprop.per_sample(case.model, leanprop.BatchGrad(subsampling=pick)) as ctx:
        out = case.model(case.x)
        leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.SqrtGGNExact(subsampling=pick))
        loss_fn(out, case.y).backward()
    for k, p in case.model.named_parameters():
        assert torch.equal(p.grad_batch, full[k][0][pick])
        assert torch.equal(p.sqrt_ggn_exact, full[k][1][:, pick])
    with pytest.raises(LeanpropValueError, match="ints"):
        leanprop.BatchGrad(subsampling=[0.5])
    with pytest.raises(LeanpropValueError, match="list of sample indices"):
        leanprop.SqrtGGNMC(1, subsampling=3)
    with (
        leanprop.per_sample(case.model, leanprop.BatchGrad(subsampling=[6])),
        pytest.raises(LeanpropValueError, match=r"\[6\] are out of range for a batch of 6"),
    ):
        loss_fn(case.model(case.x), case.y).backward()


# ---------------------------------------------------------------- regressions (review)


def test_passes_leave_other_leaves_and_optimizers_alone():
    """The passes accumulate into no ``.grad``: an input that requires grad, a parameter
    outside the context and an InBackward optimizer stepping in backward see only the loss's
    own backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    temp = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 4, (5,))
    loss_fn = nn.CrossEntropyLoss()
    grads = []
    for with_ggn in (False, True):
        x.grad = temp.grad = None
        with leanprop.per_sample(model, leanprop.BatchGrad()) as ctx:
            out = model(x) * temp
            if with_ggn:
                leanprop.ggn(ctx, out, loss_fn, y, leanprop.DiagGGNExact())
            loss_fn(out, y).backward()
        grads.append((x.grad.clone(), temp.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    opt = leanprop.InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.DiagGGNExact())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    opt.remove()


def test_the_output_batch_dimension_is_followed():
    """Sequence-first (``batch_dim=1``, output ``[T, N, C]``, T == N too): the factor is per
    sample along dimension 1; logits flattened over tokens are refused (their rows are not the
    samples)."""
    for t in (3, 5):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).double()
        x, y = torch.randn(t, 5, 3, dtype=torch.float64), torch.randn(t, 5, 4, dtype=torch.float64)
        loss_fn = nn.MSELoss()
        with leanprop.per_sample(model, batch_dim=1) as ctx:
            out = model(x)
            leanprop.ggn(ctx, out, loss_fn, y, leanprop.DiagGGNExact())
        full = _full_diag(model, x, loss_fn, y)
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.diag_ggn_exact.flatten(), full[k], rtol=1e-10, atol=1e-12)
    case = build("tied_lm")
    with leanprop.per_sample(case.model) as ctx:
        logits = case.model(case.x).flatten(0, 1)
        with pytest.raises(LeanpropValueError, match="flattened with another"):
            leanprop.ggn(
                ctx, logits, nn.CrossEntropyLoss(), case.y.flatten(), leanprop.DiagGGNExact()
            )


def _full_diag(model, x, loss_fn, y):
    """diag(J^T H J) over all outputs at once (no per-sample split)."""
    from torch.func import functional_call, jacrev

    params = {k: p.detach() for k, p in model.named_parameters()}
    out = functional_call(model, params, (x,))
    jac = jacrev(lambda ps: functional_call(model, ps, (x,)))(params)
    h = torch.autograd.functional.hessian(lambda o: loss_fn(o, y), out).reshape(out.numel(), -1)
    return {
        k: torch.einsum("ap,ab,bp->p", j := jac[k].reshape(out.numel(), -1), h, j) for k in params
    }


def test_results_of_an_earlier_call_do_not_stay():
    """A parameter the output does not depend on this time keeps no earlier curvature."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 4).double(), nn.Linear(3, 4).double()
    model = nn.ModuleDict({"a": a, "b": b})
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.zeros(5, 4, dtype=torch.float64)
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, a(x) + b(x), nn.MSELoss(), y, leanprop.DiagGGNExact())
        assert hasattr(b.weight, "diag_ggn_exact")
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, a(x), nn.MSELoss(), y, leanprop.DiagGGNExact())
    assert hasattr(a.weight, "diag_ggn_exact") and not hasattr(b.weight, "diag_ggn_exact")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_squares_are_summed_in_float32(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 64))
    x, y = torch.randn(32, 16), torch.randn(32, 64)
    res = {}
    for dt in (torch.float64, dtype):
        m = __import__("copy").deepcopy(model).to(dt)
        with leanprop.per_sample(m) as ctx:
            leanprop.ggn(ctx, m(x.to(dt)), nn.MSELoss(), y.to(dt), leanprop.DiagGGNExact(),
                         leanprop.BatchDiagGGNExact())  # fmt: skip
        res[dt] = m
    for p, q in zip(res[torch.float64].parameters(), res[dtype].parameters(), strict=True):
        for attr in ("diag_ggn_exact", "diag_ggn_exact_batch"):
            got = getattr(q, attr)
            assert got.dtype == torch.float32
            ref = getattr(p, attr)
            assert ((got.double() - ref).abs().max() / ref.abs().max()) < 0.02, attr


def test_closed_form_sum_grad_squared_is_checked():
    """A weight also used through a path leanprop does not see (a custom autograd Function):
    the closed-form SumGradSquared (and the GGN diagonal) are refused, not silently wrong."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    class BiasFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, b):
            return b * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    lin = nn.Linear(3, 4).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    escaped = {
        "weight": lambda: lin(x) + Fn.apply(x, lin.weight),
        "bias": lambda: lin(x) + BiasFn.apply(lin.bias),
    }
    for q in (leanprop.SumGradSquared(), leanprop.BatchL2Grad()):
        for name, forward in escaped.items():
            with (
                leanprop.per_sample(lin, q),
                pytest.raises(UnsupportedModelError, match=f"'{name}'"),
            ):
                nn.functional.cross_entropy(forward(), y).backward()
    with leanprop.per_sample(lin) as ctx:
        out = lin(x) + Fn.apply(x, lin.weight)
        with pytest.raises(UnsupportedModelError, match="do not add up"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.DiagGGNExact())


@pytest.mark.parametrize("d", [1, 2, 3])
def test_kronecker_input_patches_are_the_convolutions(d):
    """The im2col patches ``A`` is built from (``[C_in k..., N L]``: samples and positions
    together) satisfy ``conv(x, W) = W_flat @ patches`` for the layer's stride, dilation and
    padding, in 1d, 2d and 3d."""
    from leanprop.per_sample.curvature.kronecker import patches as unfold

    torch.manual_seed(0)
    conv_cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1]
    conv = conv_cls(2, 3, (3, 2, 2)[:d], stride=(2, 1, 1)[:d], padding=(1, 2, 0)[:d],
                    dilation=(1, 2, 1)[:d], bias=False).double()  # fmt: skip
    x = torch.randn(4, 2, *(7, 8, 6)[:d], dtype=torch.float64)
    patches = unfold(conv, x)  # [K, N L]
    got = (conv.weight.flatten(1) @ patches).unflatten(1, (x.shape[0], -1)).transpose(0, 1)
    torch.testing.assert_close(got, conv(x).flatten(2), rtol=1e-12, atol=1e-12)


def _stepped_products(model, x, y, step, create_graph=False):
    """``p.hmp(mat)`` of the first parameter before and after ``step()`` (``.data`` changes),
    and the parameters' values after the step, before and after the second product."""
    loss_fn = nn.MSELoss(reduction="sum")
    p = next(model.parameters())
    mat = torch.randn(2, *p.shape, dtype=p.dtype)
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.HMP(), create_graph=create_graph)
        loss_fn(out, y).backward(retain_graph=True)
    before = p.hmp(mat)
    with torch.no_grad():
        step()
    stepped = [q.detach().clone() for q in model.parameters()]
    after = p.hmp(mat)
    assert all(torch.equal(q.detach(), v) for q, v in zip(model.parameters(), stepped, strict=True))
    return before, after


def test_hessian_matrix_products_after_steps_the_checks_alone_would_miss():
    """A product after ``.data`` steps is the forward's: a step whose sum and position-weighted
    sum are zero (+d, -2d, +d), a step of a frozen weight (the graph reads it), a step of
    parameters sharing memory (each restored as stepped, not as the forward had it)."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
            self.b = nn.Parameter(self.a.data[0])  # (a's first row)

        def forward(self, x):
            return torch.tanh(x @ self.a.t()) + (x @ self.b)[:, None]

    torch.manual_seed(0)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    mlp = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        mlp[2].weight.copy_((mlp[2].weight * 8).round() / 8)  # (dyadic: exact sums)
    zero_sums = torch.zeros(15, dtype=torch.float64)
    zero_sums[:3] = torch.tensor([0.25, -0.5, 0.25])
    frozen = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    frozen[2].weight.requires_grad_(False)
    shared = Shared()
    cases = (
        (mlp, lambda: mlp[2].weight.data.add_(zero_sums.view(3, 5))),
        (frozen, lambda: frozen[2].weight.data.add_(0.5)),
        (shared, lambda: shared.a.data.add_(0.5)),  # (its own block: b's values are a's)
    )
    for model, step in cases:
        before, after = _stepped_products(model, x, y, step)
        torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-14)


def test_hessian_matrix_products_after_a_frozen_teachers_step_in_place():
    """A frozen EMA teacher run under no_grad (not in the graph) and stepped in place after
    the products were formed: they are the same (frozen parameters are compared by value,
    not refused by their version counters)."""

    class WithTeacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
            self.teacher = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
            self.teacher.requires_grad_(False)

        def forward(self, x):
            with torch.no_grad():
                t = self.teacher(x)
            return self.student(x) + 0 * t

    torch.manual_seed(0)
    model = WithTeacher().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)

    def step():
        for pt, ps in zip(model.teacher.parameters(), model.student.parameters(), strict=True):
            pt.mul_(0.99).add_(0.01 * ps)

    before, after = _stepped_products(model, x, y, step)
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-14)


def test_hessian_matrix_products_with_a_graph_after_a_step_are_refused():
    """``create_graph=True``: the product's derivative would be taken with the new values
    back; refused once a parameter was stepped (fine before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match="create_graph=True"):
        _stepped_products(model, x, y, lambda: model[2].weight.data.add_(0.5), True)
    model[2].weight.data.sub_(0.5)
    assert all(q.grad_fn is None for q in model.parameters())


def test_hessian_matrix_products_on_several_threads():
    """Products taken on two threads at once after a ``.data`` step: each the forward's, and
    the stepped values kept (one product changes the parameters at a time)."""
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 10)).double()
    x, y = torch.randn(64, 20, dtype=torch.float64), torch.randn(64, 10, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.HMP())
        loss_fn(out, y).backward(retain_graph=True)
    p = model[0].weight
    mat = torch.randn(4, *p.shape, dtype=p.dtype)
    want = p.hmp(mat)
    with torch.no_grad():
        model[2].weight.data.add_(0.5)
    stepped = model[2].weight.detach().clone()
    got = []

    def take():
        for _ in range(40):
            got.append(p.hmp(mat))

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 80
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-14)
    assert torch.equal(model[2].weight.detach(), stepped)


def test_hessian_matrix_products_more_refusals_and_dtypes():
    """An integer basis gives floating products; a weight changed between the forward and
    ``ggn`` is refused (the replaced op saves it, as the op it replaces)."""
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    p, last = case.model[0].weight, list(case.model.parameters())[-2]
    with leanprop.per_sample(case.model) as ctx:
        out = case.model(case.x)
        leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.HMP())
        basis = torch.nn.functional.one_hot(torch.arange(3), p.numel()).view(3, *p.shape)
        got = p.hmp(basis)
        assert got.dtype == p.dtype and got.abs().max() > 0
        torch.testing.assert_close(got, p.hmp(basis.to(p.dtype)), rtol=0, atol=0)
    with leanprop.per_sample(case.model) as ctx:
        out = case.model(case.x)
        with torch.no_grad():
            last.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            leanprop.ggn(ctx, out, loss_fn, case.y, leanprop.HMP())


def test_hessian_matrix_products_inside_nested_contexts():
    """An outer per_sample context around the model computes nothing in the products' passes:
    its own backward's results are those of a run without HMP."""
    case = build("mlp")
    loss_fn = nn.CrossEntropyLoss()
    results = []
    for products in (True, False):
        outer = leanprop.per_sample(case.model, leanprop.BatchGrad())
        with outer, leanprop.per_sample(case.model[2]) as inner:
            out = case.model(case.x)
            if products:
                leanprop.ggn(inner, out, loss_fn, case.y, leanprop.HMP())
                w = case.model[2].weight
                w.hmp(torch.ones(1, *w.shape, dtype=w.dtype))
            loss_fn(out, case.y).backward()
        results.append({k: p.grad_batch for k, p in case.model.named_parameters()})
        case.model.zero_grad()
    for k, grad_batch in results[0].items():
        assert torch.equal(grad_batch, results[1][k]), k


@pytest.mark.parametrize("modify", ["clip", "abs"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_positive_curvature_products_against_oracle(modify, loss):
    """``PCHMP``: the Hessian with each curved activation's residual ``r = σ''(z) δ`` made
    non-negative, against brute force; it differs from the Hessian, and equals it plus the
    activations' negative parts."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)
    ).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    loss_fn = nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss(reduction="sum")
    y = torch.randint(0, 3, (6,)) if loss == "ce" else torch.randn(6, 3, dtype=torch.float64)
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.PCHMP(modify=modify), leanprop.HMP())
        loss_fn(out, y).backward(retain_graph=True)
    ref = positive_curvature_blocks(model, x, loss_fn, y)[modify]
    hessian = hessian_blocks(model, x, loss_fn, y)
    for k, p in model.named_parameters():
        mat = torch.randn(3, *p.shape, dtype=p.dtype)
        got = p.pchmp(mat).flatten(1)
        torch.testing.assert_close(got, mat.flatten(1) @ ref[k], rtol=1e-10, atol=1e-12, msg=k)
        if k.startswith(("0.", "2.")):  # (before a curved activation: not the Hessian)
            assert not torch.allclose(ref[k], hessian[k], atol=1e-6), k
        else:
            torch.testing.assert_close(got, p.hmp(mat).flatten(1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("activation", [None, nn.ReLU])
def test_positive_curvature_products_without_curved_activations_are_the_hessians(activation):
    """A linear model, or one with piecewise-linear activations only, has no residual to make
    non-negative: its PCHMP is the Hessian's (then the GGN's) products, against brute force
    (no pass to curved activations: there are none)."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 5), nn.Linear(5, 3)]
    if activation is not None:
        layers.insert(1, activation())
    model = nn.Sequential(*layers).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.PCHMP())
    hessian = hessian_blocks(model, x, loss_fn, y)
    for k, p in model.named_parameters():
        mat = torch.randn(3, *p.shape, dtype=p.dtype)
        got = p.pchmp(mat).flatten(1)
        torch.testing.assert_close(got, mat.flatten(1) @ hessian[k], rtol=1e-10, atol=1e-12)


def test_positive_curvature_products_refuse_what_diag_hessian_refuses():
    """A model whose Hessian has terms besides the GGN's and its activations' (LayerNorm of a
    parameter-dependent input) is refused, as for DiagHessian; a bad ``modify`` up front."""
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    with leanprop.per_sample(model) as ctx, pytest.raises(UnsupportedModelError):
        leanprop.ggn(ctx, model(x), nn.CrossEntropyLoss(), y, leanprop.PCHMP())
    with pytest.raises(LeanpropValueError, match="'clip'"):
        leanprop.PCHMP(modify="relu")


def _mlps():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    partly = nn.Sequential(nn.Linear(4, 5, bias=False), nn.ReLU(), nn.Linear(5, 3))
    partly[2].bias.requires_grad_(False)  # (a bias-free layer, a frozen bias)
    residual = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 3))
    return {"plain": plain, "partly_frozen": partly, "sigmoid": residual}


@pytest.mark.parametrize("name", ["plain", "partly_frozen", "sigmoid"])
@pytest.mark.parametrize("loss", ["ce_mean", "ce_sum", "mse", "bce"])
def test_diagonals_of_linear_models_come_from_all_columns_at_once(name, loss, monkeypatch):
    """Models of linear layers on [N, I] inputs: the GGN's diagonals (exact and each sample's)
    from one batched backward of all the factor's columns, not one pass each; against the
    oracle (the Hessian's diagonal adds the activations' terms to it)."""
    ggn_module = importlib.import_module("leanprop.per_sample.curvature.ggn")

    def no_passes(*args, **kwargs):
        raise AssertionError("one backward per column ran")

    monkeypatch.setattr(ggn_module, "_passes", no_passes)
    model = _mlps()[name].double()
    x = torch.randn(6, 4, dtype=torch.float64)
    loss_fn, y = {
        "ce_mean": (nn.CrossEntropyLoss(), torch.randint(0, 3, (6,))),
        "ce_sum": (nn.CrossEntropyLoss(reduction="sum"), torch.randint(0, 3, (6,))),
        "mse": (nn.MSELoss(), torch.randn(6, 3, dtype=torch.float64)),
        "bce": (nn.BCEWithLogitsLoss(), torch.rand(6, 3, dtype=torch.float64)),
    }[loss]
    with leanprop.per_sample(model, leanprop.BatchGrad()) as ctx:
        out = model(x)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.DiagGGNExact(), leanprop.BatchDiagGGNExact())
        loss_fn(out, y).backward()
        first_order = {k: p.grad_batch for k, p in model.named_parameters() if p.requires_grad}
    ref = ggn_blocks(model, x, loss_fn, y)
    for k, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "diag_ggn_exact")
            continue
        full, per = ref[k]
        torch.testing.assert_close(p.diag_ggn_exact.flatten(), full.diagonal(), rtol=1e-10,
                                   atol=1e-12, msg=k)  # fmt: skip
        torch.testing.assert_close(p.diag_ggn_exact_batch.flatten(1), per, rtol=1e-10,
                                   atol=1e-12, msg=k)  # fmt: skip
        torch.testing.assert_close(first_order[k].sum(0), p.grad, rtol=1e-10, atol=1e-12)


def test_diagonals_by_columns_where_the_model_is_not_only_linear_layers(monkeypatch):
    """A layer registered and called twice, a LayerNorm, a sequence input: one pass per
    column, as before (the layer registered twice was refused by the sum check before: it got
    a site per place)."""
    ggn_module = importlib.import_module("leanprop.per_sample.curvature.ggn")
    calls = []
    real = ggn_module._passes
    monkeypatch.setattr(ggn_module, "_passes", lambda *a, **k: calls.append(1) or real(*a, **k))
    shared = nn.Linear(3, 3)
    models = {
        "shared": (nn.Sequential(shared, nn.Tanh(), shared), torch.randn(5, 3)),
        "norm": (nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), torch.randn(5, 3)),
        "sequence": (nn.Sequential(nn.Linear(3, 3), nn.Flatten()), torch.randn(5, 2, 3)),
    }
    for model, x in models.values():
        model.double()
        x = x.double()
        with torch.no_grad():
            y = torch.randn(model(x).shape, dtype=torch.float64)
        # (on a copy: torch's functional_call leaves a module registered twice with non-leaf
        # tensors in place of its parameters)
        ref = ggn_blocks(copy.deepcopy(model), x, nn.MSELoss(), y)
        with leanprop.per_sample(model) as ctx:
            leanprop.ggn(ctx, model(x), nn.MSELoss(), y, leanprop.DiagGGNExact())
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.diag_ggn_exact.flatten(), ref[k][0].diagonal(),
                                       rtol=1e-10, atol=1e-12)  # fmt: skip
    assert len(calls) == len(models)


def test_batched_columns_fall_back_to_passes_where_vmap_cannot_run(monkeypatch):
    """An op vmap cannot batch (simulated): the GGN's and the activations' columns go one
    pass each, with the same values."""
    columns = importlib.import_module("leanprop.per_sample.curvature.batched_columns")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 4), nn.Tanh(),
                          nn.Linear(4, 3)).double()  # fmt: skip
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    loss_fn = nn.CrossEntropyLoss()
    results = []
    for broken in (False, True):
        with monkeypatch.context() as m:
            if broken:

                def no_vmap(fn):
                    raise RuntimeError("Batching rule not implemented (simulated)")

                m.setattr(columns.torch.func, "vmap", no_vmap)
                m.setattr(columns, "_along_chain", lambda *args: None)  # (autograd's way)
            with leanprop.per_sample(model) as ctx:
                leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.DiagHessian(),
                             leanprop.DiagGGNExact())  # fmt: skip
        results.append({k: (p.diag_h, p.diag_ggn_exact) for k, p in model.named_parameters()})
    hessian = hessian_blocks(model, x, loss_fn, y)
    for k in results[0]:
        for a, b in zip(results[0][k], results[1][k], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(results[0][k][0].flatten(), hessian[k].diagonal(),
                                   rtol=1e-10, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("act", [nn.ReLU, nn.Sigmoid, nn.Tanh, nn.GELU])
def test_columns_along_a_chain_of_layers_equal_autograds(act, monkeypatch):
    """An MLP's columns go through its layers and activations by their Jacobians (no
    autograd, no vmap): the same diagonals, Kronecker factors and Hessian terms as
    autograd's vmapped passes (GELU: not a known activation, autograd's way both times)."""
    columns = importlib.import_module("leanprop.per_sample.curvature.batched_columns")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), act(), nn.Linear(5, 4), act(),
                          nn.Linear(4, 3)).double()  # fmt: skip
    x, y = torch.randn(7, 2, 3, dtype=torch.float64), torch.randint(0, 3, (7,))
    quantities = (leanprop.DiagGGNExact(), leanprop.BatchDiagGGNExact(), leanprop.KFLR(),
                  leanprop.DiagHessian())  # fmt: skip
    chained, results = [], []
    real = columns._along_chain
    for way in ("chain", "autograd"):
        with monkeypatch.context() as m:
            if way == "chain":
                m.setattr(columns, "_along_chain", lambda *a: chained.append(real(*a)) or
                          chained[-1])  # fmt: skip
            else:
                m.setattr(columns, "_along_chain", lambda *args: None)
            with leanprop.per_sample(model) as ctx:
                leanprop.ggn(ctx, model(x), nn.CrossEntropyLoss(), y, *quantities)
        results.append({k: [getattr(p, q.attr) for q in quantities]
                        for k, p in model.named_parameters()})  # fmt: skip
    assert chained and all((c is None) == (act is nn.GELU) for c in chained), chained
    for k, values in results[0].items():
        for a, b in zip(values, results[1][k], strict=True):
            for u, v in zip(*(t if isinstance(t, list) else [t] for t in (a, b)), strict=True):
                torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-14, msg=k)


class _Rows(nn.Module):
    """A linear layer on the rows of [N*T, I] (samples flattened with T), output back per
    sample: its rows are not samples."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(5, 2), nn.Linear(6, 3)

    def forward(self, x):  # [N, T, 5]
        n, t, _ = x.shape
        return self.out(torch.sigmoid(self.lin(x.reshape(n * t, -1)).reshape(n, -1)))


def test_batched_columns_need_one_row_per_sample():
    """A linear layer fed [N*T, I] rows takes the passes (its square of each sample's sum is
    not the sum of its rows' squares), and the Hessian's terms there are exact too."""
    torch.manual_seed(0)
    model = _Rows().double()
    x, y = torch.randn(4, 3, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, model(x), loss_fn, y, leanprop.DiagGGNExact(),
                     leanprop.BatchDiagGGNExact(), leanprop.DiagHessian())  # fmt: skip
    ref = ggn_blocks(model, x, loss_fn, y)
    hessian = hessian_blocks(model, x, loss_fn, y)
    for k, p in model.named_parameters():
        assert p.diag_ggn_exact_batch.shape == (4, *p.shape)
        torch.testing.assert_close(p.diag_ggn_exact.flatten(), ref[k][0].diagonal(),
                                   rtol=1e-10, atol=1e-12)  # fmt: skip
        torch.testing.assert_close(p.diag_h.flatten(), hessian[k].diagonal(), rtol=1e-10,
                                   atol=1e-12)  # fmt: skip


def test_batched_columns_refuse_batchnorm_in_training_mode():
    """BatchNorm in training mode between linear layers: refused as the passes refuse it
    (with no first-order quantity asked, the forward only notes it)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 2))
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    with leanprop.per_sample(model) as ctx, pytest.raises(UnsupportedModelError, match="BatchNorm"):
        leanprop.ggn(ctx, model(x), nn.CrossEntropyLoss(), y, leanprop.DiagGGNExact())


@pytest.mark.parametrize("between", ["backward", "autograd.grad"])
def test_curvature_of_a_forward_after_a_plain_backward_and_another_forward(between):
    """A context with no quantities asked: a forward, a plain backward through it (graph
    retained), another forward, then curvature of the first one's output. A first fix for a
    refusal outliving its forward ended the first forward at that backward: ggn then wrote
    nothing, silently (review). Exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2)).double()
    x1, x2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    y1, loss_fn = torch.randn(5, 2, dtype=torch.float64), nn.MSELoss(reduction="sum")
    with leanprop.per_sample(model) as ctx:
        out1 = model(x1)
        if between == "backward":
            loss_fn(out1, y1).backward(retain_graph=True)
        else:
            torch.autograd.grad(loss_fn(out1, y1), list(model.parameters()), retain_graph=True)
        model(x2)
        leanprop.ggn(ctx, out1, loss_fn, y1, leanprop.DiagGGNExact())
    ref = ggn_blocks(model, x1, loss_fn, y1)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact.flatten(), ref[k][0].diagonal(),
                                   rtol=1e-10, atol=1e-12)  # fmt: skip


def test_curvature_of_a_forward_whose_records_were_dropped_is_refused():
    """A forward, its backward with quantities (graph retained), a second forward (which
    starts a new cycle and drops the first one's records), then curvature of the first
    output: the passes reached no recorded use and ggn wrote nothing, without a word
    (review). A clear error now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2)).double()
    x1, x2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    y1, loss_fn = torch.randn(5, 2, dtype=torch.float64), nn.MSELoss(reduction="sum")
    with leanprop.per_sample(model, leanprop.BatchGrad()) as ctx:
        out1 = model(x1)
        loss_fn(out1, y1).backward(retain_graph=True)
        model(x2)
        with pytest.raises(UnsupportedModelError, match="records of the forward"):
            leanprop.ggn(ctx, out1, loss_fn, y1, leanprop.DiagGGNExact())


@pytest.mark.parametrize("check", [True, False], ids=["check", "unchecked"])
def test_a_hessian_product_between_two_forwards_keeps_the_first(check):
    """``ggn(ctx, out1, HMP())`` between two forwards of the same samples, then one backward
    through both: the product's own pass (no quantities asked while it runs) ended the first
    forward in a first fix for a refusal outliving its forward, and the backward then took
    the second forward's samples alone (silently wrong with check=False, review). Exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y1, y2 = torch.randn(5, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    with leanprop.per_sample(model, leanprop.BatchGrad(), check=check) as ctx:
        out1 = model(x)
        leanprop.ggn(ctx, out1, loss_fn, y1, leanprop.HMP())
        out2 = model(x)
        (loss_fn(out1, y1) + loss_fn(out2, y2)).backward()
    params = dict(model.named_parameters())
    losses = ((model(x) - y1) ** 2).sum(1) + ((model(x) - y2) ** 2).sum(1)
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        torch.testing.assert_close(p.grad_batch, expected[k], rtol=1e-10, atol=1e-12, msg=k)


class _Between(nn.Module):
    """Two linear layers (the first to ``width`` units, the second from 5) with ``between``
    applied to the first one's output."""

    def __init__(self, between, width: int = 5) -> None:
        super().__init__()
        self.a, self.b, self.between = nn.Linear(5, width), nn.Linear(5, 3), between

    def forward(self, x):
        return self.b(self.between(self.a(x)))


@pytest.mark.parametrize(
    "between",
    [lambda h: torch.tanh(h.t()).t(), lambda h: torch.tanh(h.unsqueeze(0)).squeeze(0),
     lambda h: torch.softmax(h, 1)],
    ids=["transposed", "unsqueezed", "softmax"],
)  # fmt: skip
def test_kfra_refuses_ops_that_move_the_samples_or_are_not_elementwise(between):
    """Ops between layers that move the batch out of the first dimension were averaged as if
    each row were a sample: 100 % wrong, silently (N == H here, where shapes cannot tell)."""
    torch.manual_seed(0)
    model = _Between(between).double()
    x, y = torch.randn(5, 5, dtype=torch.float64), torch.randint(0, 3, (5,))
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        with pytest.raises(UnsupportedModelError, match="neither elementwise, pooling, padding"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.KFRA())


def _facade_kfra_refuses(model: nn.Module, x: Tensor, y: Tensor, match: str) -> None:
    """KFRA through the BackPACK facade (which replaces no op) refuses ``model``'s graph."""
    from leanprop.compat import backpack as facade

    model, loss_fn = facade.extend(model), facade.extend(nn.CrossEntropyLoss())
    try:
        with (
            pytest.raises(UnsupportedModelError, match=match),
            facade.backpack(facade.extensions.KFRA()),
        ):
            loss_fn(model(x), y).backward()
    finally:
        facade.unextend(model)
        facade.unextend(loss_fn)


@pytest.mark.parametrize(
    "between",
    [lambda h: h.view(5, 5, 5).sum(0), lambda h: h.view(5, 5, 5).mean(-3),
     lambda h: F.pad(h.view(5, 5, 5), (0, 0, 0, 0, 1, -1)).sum(-1)],
    ids=["summed-over-the-samples", "mean-over-the-samples", "padded-over-the-samples"],
)  # fmt: skip
def test_kfra_refuses_linear_ops_that_mix_the_samples(between):
    """Ops linear in their input whose first dimension stays the batch's (N == 5 == the
    units), but which mix the samples: taken as the same for every sample, they would be
    silently wrong. The per-sample engine's batch tracking refuses them in the forward; the
    BackPACK facade, which tracks no batch, gets KFRA's own refusal."""
    torch.manual_seed(0)
    model = _Between(between, width=25).double()  # ([N, 25] to [N, 5] between)
    x, y = torch.randn(5, 5, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(leanprop.errors.BatchError), leanprop.per_sample(model):
        model(x)
    _facade_kfra_refuses(model, x, y, r"KFRA.*neither elementwise")


class _ConvCalledOtherwise(nn.Module):
    """A convolution's weight used by ``F.conv2d`` with another stride than the module's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 3, 3), nn.Linear(12, 3)

    def forward(self, x):
        return self.head(F.conv2d(x, self.conv.weight, self.conv.bias, stride=2).flatten(1))


def test_kfra_refuses_a_convolution_weight_called_with_other_options():
    """Its factors would be formed with the module's stride, not the call's."""
    torch.manual_seed(0)
    model = _ConvCalledOtherwise().double()
    x, y = torch.randn(4, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        with pytest.raises(UnsupportedModelError, match="KFRA"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.KFRA())
    _facade_kfra_refuses(model, x, y, r"KFRA.*not all in linear layers")


def test_kfra_refuses_layers_of_another_context():
    """Two contexts (an encoder's and a head's): the encoder's replaced layer was taken into
    the head's chain and the results failed with a KeyError."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(6, 5), nn.Tanh()).double()
    head = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    with leanprop.per_sample(enc), leanprop.per_sample(head) as ctx:
        out = head(enc(x))
        with pytest.raises(UnsupportedModelError, match="another per_sample context"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.KFRA())


def _differentiable_cases():
    for param in _cases():
        if param.values[0] in ("mlp", "residual", "shared", "sequence", "conv2d", "attention"):
            yield param


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize(("name", "which"), list(_differentiable_cases()))
def test_create_graph_quantities_and_their_derivatives_against_oracle(name, which):
    """``ggn(create_graph=True)``: the quantities as functions of the parameters (through the
    Jacobians and the loss Hessian both): their values and the gradients of a random linear
    functional of them equal the brute-force oracle's, differentiated by autograd."""
    case = build(name)
    loss_fn = _losses(case)[which]
    y = _target(loss_fn, case.y)
    model = case.model
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    n = case.x.shape[0]
    weights = {
        k: (rand(p.numel()), rand(n, p.numel()), rand(p.numel(), p.numel()), rand(2, *p.shape))
        for k, p in params.items()
    }
    with sdpa_kernel(MATH), leanprop.per_sample(model) as ctx:
        out = model(case.x)
        leanprop.ggn(ctx, out, loss_fn, y, *EXACT, leanprop.GGNMP(), create_graph=True)
    ours = theirs = 0
    with sdpa_kernel(MATH):
        ref = ggn_blocks(model, case.x, loss_fn, y, differentiable=True)
    for k, p in params.items():
        r, rb, rg, mat = weights[k]
        root = p.sqrt_ggn_exact.flatten(2).flatten(0, 1)  # [M*N, P]
        ours = ours + (p.diag_ggn_exact.flatten() * r).sum()
        ours = ours + (p.diag_ggn_exact_batch.flatten(1) * rb).sum()
        ours = ours + ((root.t() @ root) * rg).sum() + (p.ggnmp(mat) * mat).sum()
        full, per = ref[k]
        theirs = theirs + (full.diagonal() * r).sum() + (per * rb).sum() + (full * rg).sum()
        theirs = theirs + ((mat.flatten(1) @ full) * mat.flatten(1)).sum()
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert_same_derivatives(ours, theirs, params)


def test_create_graph_monte_carlo_quantities_are_differentiable_with_the_draws_fixed():
    case = build("mlp")
    loss_fn, model = nn.CrossEntropyLoss(), case.model
    qs = (leanprop.DiagGGNMC(2), leanprop.BatchDiagGGNMC(2), leanprop.SqrtGGNMC(2),
          leanprop.KFAC(2))  # fmt: skip
    found = []
    for create_graph in (False, True):
        with leanprop.per_sample(model) as ctx:
            out = model(case.x)
            leanprop.ggn(
                ctx, out, loss_fn, case.y, *qs, generator=torch.Generator().manual_seed(3),
                create_graph=create_graph,
            )  # fmt: skip
        found.append([getattr(model[0].weight, q.attr) for q in qs])
    for plain, graph in zip(*found, strict=True):
        plain, graph = (plain, graph) if isinstance(plain, Tensor) else (plain[0], graph[0])
        assert not plain.requires_grad and graph.requires_grad
        torch.testing.assert_close(graph, plain, rtol=1e-12, atol=1e-14)


def test_create_graph_hessian_products_and_their_derivatives_against_autograd():
    """``ggn(HMP(), create_graph=True)``: each product ``H_pp mat`` is a function of the
    parameters (as BackPACK's): its values and the gradients of a random functional of them
    equal autograd's Hessian blocks differentiated by autograd (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 3), nn.Tanh(),
                          nn.Linear(3, 2)).double()  # fmt: skip
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    mats = {k: torch.randn(2, *p.shape, generator=gen, dtype=torch.float64)
            for k, p in params.items()}  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        leanprop.ggn(ctx, out, loss_fn, y, leanprop.HMP(), create_graph=True)
    ref = hessian_blocks(model, x, loss_fn, y, differentiable=True)
    ours = theirs = 0
    for k, p in params.items():
        mat = mats[k]
        mine = p.hmp(mat)
        want = (mat.flatten(1) @ ref[k]).view_as(mat)  # (H symmetric)
        torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-12, msg=k)
        ours, theirs = ours + (mine * mat).sum(), theirs + (want * mat).sum()
        del p.hmp
    assert_same_derivatives(ours, theirs, params)


@pytest.mark.parametrize("modify", ["clip", "abs"])
def test_create_graph_positive_curvature_products_differentiate_as_finite_differences(modify):
    """``ggn(PCHMP(modify), create_graph=True)``: the gradient of ``<pchmp(mat), mat>`` (the
    activations' terms through ``δ``, ``σ''(z)`` and the Jacobians) equals central finite
    differences of the products computed without a graph (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 3), nn.Tanh(),
                          nn.Linear(3, 2)).double()  # fmt: skip
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    mats = [torch.randn(2, *p.shape, generator=gen, dtype=torch.float64) for p in params]
    q = leanprop.PCHMP(modify=modify)

    def functional(create_graph):
        with leanprop.per_sample(model) as ctx:
            out = model(x)
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, q, create_graph=create_graph)
        total = sum((p.pchmp(m) * m).sum() for p, m in zip(params, mats, strict=True))
        for p in params:
            del p.pchmp
        return total

    got = torch.autograd.grad(functional(True), params)
    eps = 1e-6
    for p, g in zip(params, got, strict=True):
        fd = torch.zeros_like(p)
        for i in range(p.numel()):
            with torch.no_grad():
                p.view(-1)[i] += eps
            up = functional(False).item()
            with torch.no_grad():
                p.view(-1)[i] -= 2 * eps
            down = functional(False).item()
            with torch.no_grad():
                p.view(-1)[i] += eps
            fd.view(-1)[i] = (up - down) / (2 * eps)
        torch.testing.assert_close(g, fd, rtol=1e-6, atol=1e-8)


def test_create_graph_with_autograd_off_is_refused():
    """Under no_grad the quantities would carry no graph: refused (they were returned
    without one, silently constant)."""
    case = build("mlp")
    with leanprop.per_sample(case.model) as ctx:
        out = case.model(case.x)
        with torch.no_grad(), pytest.raises(LeanpropValueError, match="autograd off"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), case.y, *EXACT, create_graph=True)


def test_each_samples_bias_diagonals_of_two_quantities_are_their_own():
    """A bias's per-sample GGN diagonal is the columns' squares themselves, written without a
    copy: two per-sample quantities that equal it (the GGN's and the Hessian's, of a model
    without curved activations) each get a tensor of their own (one changed in place leaves
    the other as it was)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with leanprop.per_sample(model) as ctx:
        leanprop.ggn(ctx, model(x), nn.CrossEntropyLoss(), y, leanprop.BatchDiagGGNExact(),
                     leanprop.BatchDiagHessian(), leanprop.DiagGGNExact())  # fmt: skip
    for p in model.parameters():
        ggn, hess = leanprop.BatchDiagGGNExact.attr, leanprop.BatchDiagHessian.attr
        a, b = getattr(p, ggn), getattr(p, hess)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        torch.testing.assert_close(a.sum(0), p.diag_ggn_exact, rtol=1e-12, atol=1e-14)
