"""A DP-SGD step (flat clipping at 1.0, noise 1.0, SGD) on the reference CNN and a small
transformer: the plain (non-private) step, leanprop (:func:`leanprop.clip_per_sample` and
:class:`leanprop.DPOptimizer`), Opacus' hooks (``GradSampleModule``) and Opacus' ghost
clipping (two backward passes), where Opacus is installed.

Each variant runs forward, backward and the optimizer step on its own copy of the model. Time
in rounds, peak tensor memory of one step (ratios to the plain step). Before timing, one step
of each private variant with noise 0 is checked against leanprop's (the same clipped update).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import leanprop
from leanprop.measure import as_dict

from .per_sample_suite import cnn


class _Block(nn.Module):
    """A pre-norm transformer block of Linear and LayerNorm layers (attention by matmuls), so
    that Opacus' hooks and ghost clipping support every layer."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: Tensor) -> Tensor:  # [N, T, D]
        n, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(n, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v
        h = h + self.proj(a.transpose(1, 2).reshape(n, t, d))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class SmallTransformer(nn.Module):
    """A 2-layer classifier over token sequences ``[N, T]`` (width 128, vocabulary 1000)."""

    def __init__(self, vocab: int = 1000, d: int = 128, t: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.blocks = nn.Sequential(_Block(d, 4), _Block(d, 4))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, ids: Tensor) -> Tensor:
        # positions [N, T] (Opacus' hooks take a [T] lookup's T for the batch size)
        positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
        h = self.tok(ids) + self.pos(positions)
        return self.head(self.ln(self.blocks(h)).mean(1))


def _problem(name: str, batch: int, device: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    if name == "cnn":
        model, x = cnn(), torch.randn(batch, 1, 28, 28)
    else:
        model, x = SmallTransformer(), torch.randint(0, 1000, (batch, 32))
    return model.to(device), x.to(device), torch.randint(0, 10, (batch,), device=device)


MODELS = ("cnn", "transformer")
CLIP, NOISE, LR = 1.0, 1.0, 0.01


def _variants(
    name: str, batch: int, device: str, noise: float
) -> tuple[dict[str, Callable[[], list[Tensor]]], list[nn.Module]]:  # fmt: skip
    model, x, y = _problem(name, batch, device)
    models = [copy.deepcopy(model) for _ in range(4)]

    def params_of(m: nn.Module) -> list[Tensor]:
        return [p.detach() for p in m.parameters()]

    plain_opt = torch.optim.SGD(models[0].parameters(), lr=LR)

    def plain() -> list[Tensor]:
        F.cross_entropy(models[0](x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        return params_of(models[0])

    clip = leanprop.clip_per_sample(models[1], CLIP)
    ours_opt = leanprop.DPOptimizer(
        torch.optim.SGD(models[1].parameters(), lr=LR), clip, noise_multiplier=noise,
        expected_batch_size=batch,
    )  # fmt: skip

    def ours() -> list[Tensor]:
        with clip:
            F.cross_entropy(models[1](x), y).backward()
        ours_opt.step()
        ours_opt.zero_grad()
        return params_of(models[1])

    variants = {"plain": plain, "leanprop": ours}
    if importlib.util.find_spec("opacus") is not None:
        variants |= _opacus_variants(models[2], models[3], x, y, batch, noise)
    return variants, models


def _opacus_variants(
    hooks_model: nn.Module, ghost_model: nn.Module, x: Tensor, y: Tensor, batch: int,
    noise: float,
) -> dict[str, Callable[[], list[Tensor]]]:  # fmt: skip
    import opacus

    gsm = opacus.GradSampleModule(hooks_model)
    hooks_opt = opacus.optimizers.DPOptimizer(
        torch.optim.SGD(hooks_model.parameters(), lr=LR), noise_multiplier=noise,
        max_grad_norm=CLIP, expected_batch_size=batch,
    )  # fmt: skip

    def hooks() -> list[Tensor]:
        F.cross_entropy(gsm(x), y).backward()
        hooks_opt.step()
        hooks_opt.zero_grad()
        return [p.detach() for p in hooks_model.parameters()]

    data = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    ghost, ghost_opt, criterion, _ = opacus.PrivacyEngine(accountant="rdp").make_private(
        module=ghost_model, optimizer=torch.optim.SGD(ghost_model.parameters(), lr=LR),
        data_loader=loader, criterion=nn.CrossEntropyLoss(), noise_multiplier=noise,
        max_grad_norm=CLIP, grad_sample_mode="ghost", poisson_sampling=False,
    )  # fmt: skip

    def ghost_step() -> list[Tensor]:
        criterion(ghost(x), y).backward()
        ghost_opt.step()
        ghost_opt.zero_grad()
        return [p.detach() for p in ghost_model.parameters()]

    return {"opacus_hooks": hooks, "opacus_ghost": ghost_step}


def _agree(name: str, batch: int, device: str) -> bool:
    """One step of each private variant with noise 0 gives leanprop's parameters."""
    variants, _ = _variants(name, batch, device, noise=0.0)
    ours = variants["leanprop"]()
    for k, step in variants.items():
        if k.startswith("opacus"):
            for a, b in zip(step(), ours, strict=True):
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
                    return False
    return True


def run(device: str = "cpu", batches: tuple[int, ...] = (32,), reps: int = 5) -> list[dict]:
    """One row per model, batch size and method; ratios to the plain step."""
    rows = []
    for name in MODELS:
        for batch in batches:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (Opacus' notes: secure RNG, backward hooks)
                agrees = _agree(name, batch, device)
                variants, models = _variants(name, batch, device, NOISE)
                res = leanprop.compare(  # (warm-up: the "auto" convolution algorithm's trials)
                    variants, device=device, reps=reps, check=False, existing=tuple(models),
                    show=False, warmup=10,
                )  # fmt: skip
            for r in res:
                row = as_dict(r, batch=batch, method=f"{name}: {r.name}")
                if r.name != "plain":
                    row["agrees"] = agrees
                rows.append(row)
    return rows
