"""Registry of small problems shared by the tests: ``CASES[name]() -> Case``.

Each case is a model, a batch (inputs ``x [N, ...]``, targets ``y``) and a loss
``loss(output, y, reduction)`` that is a mean or sum over samples of per-sample losses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class Case:
    model: nn.Module
    x: Tensor
    y: Tensor
    loss: Callable[[Tensor, Tensor, str], Tensor]
    convs: bool = False  # has convolutions (test both algorithms)


def ce(out: Tensor, y: Tensor, reduction: str) -> Tensor:
    return F.cross_entropy(out, y, reduction=reduction)


def mse(out: Tensor, y: Tensor, reduction: str) -> Tensor:
    per = (out - y).pow(2).flatten(1).sum(1)
    return per.mean() if reduction == "mean" else per.sum()


def token_ce(out: Tensor, y: Tensor, reduction: str) -> Tensor:
    """Cross-entropy averaged over each sample's tokens, then reduced over samples."""
    n = out.shape[0]
    per = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(n, -1).mean(1)
    return per.mean() if reduction == "mean" else per.sum()


CASES: dict[str, Callable[[], Case]] = {}


def case(fn: Callable[[], Case]) -> Callable[[], Case]:
    CASES[fn.__name__] = fn
    return fn


def _cls(n: int, shape: tuple[int, ...], classes: int) -> tuple[Tensor, Tensor]:
    return torch.randn(n, *shape), torch.randint(0, classes, (n,))


@case
def mlp() -> Case:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return Case(model, *_cls(6, (4,), 3), ce)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.lin1, self.lin2 = nn.Linear(6, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = h + self.lin2(torch.relu(self.lin1(h)))
        return self.head(h)


@case
def residual() -> Case:
    return Case(Residual(), *_cls(5, (4,), 3), ce)


class Shared(nn.Module):
    """One module called twice (weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


@case
def shared() -> Case:
    return Case(Shared(), *_cls(5, (4,), 2), ce)


class TiedLM(nn.Module):
    """Embedding tied to the output layer; sequence inputs [N, T]."""

    def __init__(self, vocab: int = 7, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.norm(torch.tanh(self.mix(self.emb(tokens)))))


@case
def tied_lm() -> Case:
    tokens = torch.randint(0, 7, (4, 5))
    return Case(TiedLM(), tokens, torch.randint(0, 7, (4, 5)), token_ce)


@case
def sequence() -> Case:
    model = nn.Sequential(nn.Linear(3, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    return Case(model, torch.randn(4, 6, 3), torch.randn(4, 6, 2), mse)


@case
def conv1d() -> Case:
    model = nn.Sequential(
        nn.Conv1d(2, 4, 3, stride=2, padding=1, dilation=1),
        nn.ReLU(),
        nn.Conv1d(4, 4, 3, padding="same", dilation=2, groups=2, padding_mode="circular"),
        nn.Flatten(),
        nn.LazyLinear(3),
    )
    x = torch.randn(5, 2, 9)
    model(x)  # materialise the lazy layer
    return Case(model, x, torch.randint(0, 3, (5,)), ce, convs=True)


@case
def conv2d() -> Case:
    model = nn.Sequential(
        nn.Conv2d(2, 6, 3, stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        nn.GroupNorm(3, 6),
        nn.ReLU(),
        nn.Conv2d(6, 4, (2, 3), groups=2, padding="same", padding_mode="reflect"),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.LazyLinear(3),
    )
    x = torch.randn(4, 2, 7, 8)
    model(x)
    return Case(model, x, torch.randint(0, 3, (4,)), ce, convs=True)


@case
def conv3d() -> Case:
    model = nn.Sequential(
        nn.Conv3d(1, 3, 2, stride=(1, 2, 1), padding=1, bias=False),
        nn.ReLU(),
        nn.Conv3d(3, 2, (1, 2, 2), dilation=(1, 1, 2)),
        nn.Flatten(),
        nn.LazyLinear(2),
    )
    x = torch.randn(3, 1, 4, 5, 5)
    model(x)
    return Case(model, x, torch.randint(0, 2, (3,)), ce, convs=True)


@case
def conv_late() -> Case:
    """A CNN's late stage: a wide convolution with few output positions, whose weight norms
    come from Gram matrices of its patches (BatchL2Grad alone)."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),  # [N, 32, 2, 2]: L = 4 positions
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(128, 3),
    )
    x = torch.randn(4, 3, 8, 8)  # N == L
    return Case(model, x, torch.randint(0, 3, (4,)), ce, convs=True)


class Attention(nn.Module):
    """Sequence-first nn.MultiheadAttention inside a batch-first model (torch.func fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.attn = nn.MultiheadAttention(4, 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:  # x [N, T, 3]
        h = self.proj(x).transpose(0, 1)  # [T, N, 4]
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a.transpose(0, 1).mean(1))


@case
def attention() -> Case:
    return Case(Attention(), torch.randn(4, 5, 3), torch.randint(0, 2, (4,)), ce)


class Scaled(nn.Module):
    """A module with its own parameter and called children (fallback root, rules inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5))
        self.lin = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lin(x) * self.scale))


@case
def own_parameter() -> Case:
    return Case(Scaled(), *_cls(5, (4,), 3), ce)


class DerivedUse(nn.Module):
    """Parameters used through tensors derived from them (a row of a layer's weight, another
    layer's weight summed, a squashed matrix in an einsum): their contributions are handed back
    through the derivation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.mix = nn.Parameter(torch.randn(4, 4) / 2)  # used by an op without a closed form

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.lin(x)) * self.lin.weight[2] + self.head.weight.sum(0)
        return self.head(torch.tanh(torch.einsum("nd,de->ne", h, self.mix.tanh())))


@case
def derived_use() -> Case:
    return Case(DerivedUse(), *_cls(5, (4,), 3), ce)


class Recurrent(nn.Module):
    """A GRU (batch first) and a sequence-first LSTM: not vmappable, loop fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 4, batch_first=True)
        self.lstm = nn.LSTM(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:  # x [N, T, 3]
        h, last = self.gru(x)  # last: [1, N, 4], batch at dim 1 although batch_first
        h, _ = self.lstm(h.transpose(0, 1))  # [T, N, 3]
        return self.head(h[-1]) + last[-1].sum(1, keepdim=True)


@case
def recurrent() -> Case:
    return Case(Recurrent(), torch.randn(4, 5, 3), torch.randint(0, 2, (4,)), ce)


@case
def inplace() -> Case:
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))
    return Case(model, *_cls(6, (4,), 3), ce)


@case
def frozen() -> Case:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].weight.requires_grad_(False)
    return Case(model, *_cls(6, (4,), 3), ce)


@case
def batchnorm_eval() -> Case:
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten())
    model.append(nn.Linear(3 * 4 * 4, 2))
    model[1].running_mean.uniform_()
    model.eval()
    return Case(model, *_cls(4, (1, 6, 6), 2), ce, convs=True)


def build(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> Case:
    """Build case ``name`` in ``dtype`` with a fixed seed."""
    torch.manual_seed(seed)
    c = CASES[name]()
    c.model.to(dtype)
    if c.x.is_floating_point():
        c.x = c.x.to(dtype)
    if c.y.is_floating_point():
        c.y = c.y.to(dtype)
    return c
