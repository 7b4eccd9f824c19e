"""BatchL2Grad of a weight shared between layers, from factors (leanprop/per_sample/factors.py),
against the per-sample loop oracle in float64; the factored path must be the one taken."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor, nn

import leanprop
from leanprop import BatchGrad, BatchL2Grad
from leanprop.per_sample import factors

from ..cases import Case, mse, token_ce
from .test_quantities_against_oracle import check_against_oracle


class TiedHead(nn.Module):
    """Embedding tied to a wide output layer (a language model's head), optionally used a
    third time by a layer whose use cannot be factored (a learned scale of its rows)."""

    def __init__(self, vocab: int, dim: int, third: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=1)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.third = third

    def forward(self, tokens: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.emb(tokens)))
        if self.third:  # an elementwise use of the weight: materialised individual gradients
            h = h * self.emb.weight[2]
        return self.out(h)


class TwiceEmbedded(nn.Module):
    """One embedding looked up twice (two token streams of each sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.emb(tokens[:, 0]) * self.emb(tokens[:, 1]))


class SharedWide(nn.Module):
    """A wide linear layer applied twice to a short sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _tied(n: int, t: int, third: bool = False) -> Case:
    torch.manual_seed(0)
    tokens = torch.randint(0, 13, (n, t))
    tokens[0, -1] = 1  # a padding token
    return Case(TiedHead(13, 6, third).double(), tokens, torch.randint(0, 13, (n, t)), token_ce)


def _twice(n: int) -> Case:
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (n, 2, 4))
    tokens[:, 1, 0] = tokens[:, 0, 0]  # the same row in both streams
    return Case(TwiceEmbedded().double(), tokens, torch.randn(n, 4, 2, dtype=torch.float64), mse)


def _shared(n: int) -> Case:
    torch.manual_seed(0)
    x, y = torch.randn(n, 2, 12), torch.randn(n, 2, 12)
    return Case(SharedWide().double(), x.double(), y.double(), mse)


@pytest.fixture
def paths(monkeypatch):
    """Which ways factored uses went: their inner products, or materialised after all (alone,
    or added to other uses' individual gradients)."""
    seen: dict[str, int] = {"inner": 0, "materialize": 0, "add_into": 0}
    cycle = importlib.import_module("leanprop.per_sample.cycle")
    for module, name in (
        (factors, "inner"), (factors, "materialize"), (factors, "add_into"),
        (cycle, "materialize"), (cycle, "add_into"),
    ):  # fmt: skip
        real = getattr(module, name)

        def counting(*args, _name=name, _real=real, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return seen


@pytest.mark.parametrize("workspace", [None, 1e-6], ids=["one-chunk", "per-sample-chunks"])
@pytest.mark.parametrize(
    "build", [lambda: _tied(3, 4), lambda: _tied(4, 4), lambda: _twice(4), lambda: _shared(2)],
    ids=["tied-head", "tied-head-T==N", "embedding-twice", "linear-twice-T==N"],
)  # fmt: skip
def test_shared_weight_norms_from_factors(build, workspace, paths):
    check_against_oracle(build(), "sum", (BatchL2Grad(),), max_workspace_mib=workspace)
    assert paths["inner"] >= 3  # from the factors alone
    assert not paths["materialize"] and not paths["add_into"]


def test_a_use_without_factors_materialises_the_others(paths):
    check_against_oracle(_tied(3, 4, third=True), "mean", (BatchL2Grad(),))
    assert paths["add_into"] == 2  # the head's factors, then the embedding's


@pytest.mark.parametrize("build", [lambda: _tied(3, 4), lambda: _twice(3)])
def test_other_quantities_need_the_individual_gradients(build, paths):
    check_against_oracle(build(), "mean", (BatchL2Grad(), BatchGrad()))
    assert paths["inner"] == 0  # materialised, the later use added in place
    assert paths["materialize"] + paths["add_into"] >= 1


def test_inner_products_of_every_pair_against_materialised():
    """<A_n, B_n> for each pair of factor kinds equals the inner product of the materialised
    individual gradients (padding: repeated and equal indices)."""
    torch.manual_seed(0)
    n, v, d = 3, 7, 4
    outer = factors.Outer(torch.randn(n, 5, v).double(), torch.randn(n, 5, d).double())
    ids = torch.randint(0, v, (n, 6))
    ids[:, 1] = ids[:, 0]
    lookup = factors.Lookup(ids, torch.randn(n, 6, d).double(), v)
    for a in (outer, lookup):
        for b in (outer, lookup):
            want = (factors.materialize(a) * factors.materialize(b)).sum((1, 2))
            got = factors.inner(a, b, 2**20)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            factors.total(a), factors.materialize(a).sum(0), rtol=1e-12, atol=1e-12
        )


class Cancelling(nn.Module):
    """An embedding tied to a head whose use nearly cancels the embedding's, per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, t: Tensor, a: Tensor) -> Tensor:  # t [N], a [N, 8]
        looked_up = (self.emb(t) * a).sum(1)
        head = (self.head(-a * (1 - 1e-4)) * nn.functional.one_hot(t, 16)).sum(1)
        return looked_up + head


def test_nearly_cancelling_uses_stay_accurate_in_float32(paths):
    """||A + B||² from ||A||² + ||B||² + 2<A, B> loses the digits that cancel: such samples'
    norms come from their materialised individual gradients (were negative in float32)."""
    torch.manual_seed(0)
    model = Cancelling()
    t, a = torch.randint(0, 16, (4,)), torch.randn(4, 8) * 100
    with leanprop.per_sample(model, BatchL2Grad()):
        model(t, a).sum().backward()
    exact = (1e-4 * a.double()).square().sum(1)  # each sample's gradient is 1e-4 a in row t
    torch.testing.assert_close(model.emb.weight.batch_l2.double(), exact, rtol=1e-3, atol=0)
    assert paths["inner"] >= 3


def test_the_sum_check_covers_uses_added_in_place(monkeypatch):
    """The individual gradients written are summed for the check (not the factors' own sums):
    a wrong in-place addition is caught."""
    cycle = importlib.import_module("leanprop.per_sample.cycle")
    real = factors.add_into
    twice = lambda b, f, **kw: real(real(b, f), f)  # noqa: E731 (added twice)
    monkeypatch.setattr(cycle, "add_into", twice)
    case = _tied(3, 4)
    with (
        leanprop.per_sample(case.model, BatchGrad()),
        pytest.raises(leanprop.UnsupportedModelError, match="do not add up"),
    ):
        case.loss(case.model(case.x), case.y, "sum").backward()


class SharedBias(nn.Module):
    """Three linear layers on one input sharing one bias, their outputs added: the addition
    hands each layer the same output gradient, which is also the bias's individual gradients
    of each use (a tensor autograd still uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 4), nn.Linear(5, 4), nn.Linear(5, 4)
        self.b.bias = self.c.bias = self.a.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.a(x) + self.b(x) + self.c(x))


@pytest.mark.parametrize("quantities", [(BatchGrad(),), (BatchGrad(), BatchL2Grad())])
def test_uses_are_added_into_our_buffers_only(quantities):
    """Later uses are added in place only into a buffer the capture made itself: never into
    a tensor it was handed (here the output gradient, which the other layers still read)."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    check_against_oracle(Case(SharedBias().double(), x, y, mse), "sum", quantities)
