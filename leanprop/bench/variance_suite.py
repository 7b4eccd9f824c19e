"""Gradient of the total gradient variance (BackPACK's "gradient of backpropagated quantities").

``total = sum_p sum(Var_n[c_n(p)])`` and ``d total / d params``, computed by leanprop during one
backward with ``create_graph=True`` and by the per-sample loop of :mod:`leanprop.testing`;
:func:`leanprop.compare` times both, measures their peak memory and checks they agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import leanprop
from leanprop.measure import as_dict
from leanprop.testing import individual_gradients


def _problems(batch: int) -> dict[str, tuple[nn.Module, Tensor, Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(batch, 1, 28, 28)
    y = torch.randint(0, 10, (batch,))
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    cnn = nn.Sequential(
        nn.Conv2d(1, 5, 5), nn.ReLU(), nn.MaxPool2d(2, 2), nn.Flatten(), nn.Linear(720, 10)
    )
    return {"mlp": (mlp, x, y), "cnn": (cnn, x, y)}


def _loss(out: Tensor, y: Tensor, reduction: str) -> Tensor:
    return F.cross_entropy(out, y, reduction=reduction)


def _steps(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Callable[[], object]]:
    params = list(model.parameters())

    def leanprop_step() -> tuple[Tensor, list[Tensor]]:
        with leanprop.per_sample(model, leanprop.Variance()):
            # autograd.grad rather than backward(): no .grad reference cycle to break
            torch.autograd.grad(_loss(model(x), y, "sum"), params, create_graph=True)
            total = sum(p.variance.sum() for p in params)
            grads = torch.autograd.grad(total, params)
        return total.detach(), [g.detach() for g in grads]

    def loop_step() -> tuple[Tensor, list[Tensor]]:
        ind = individual_gradients(model, _loss, x, y, "sum", create_graph=True)
        total = sum(g.var(0, unbiased=False).sum() for g in ind.values())
        grads = torch.autograd.grad(total, params)
        return total.detach(), [g.detach() for g in grads]

    return {"per-sample loop": loop_step, "leanprop": leanprop_step}


def run(device: str = "cpu", batches: tuple[int, ...] = (32,), reps: int = 10) -> list[dict]:
    """Rows for both problems and each batch size, ratios to the per-sample loop."""
    rows: list[dict] = []
    for batch in batches:
        for name, (model, x, y) in _problems(batch).items():
            model, x, y = model.to(device), x.to(device), y.to(device)
            res = leanprop.compare(
                _steps(model, x, y), device=device, reps=reps, rtol=1e-4, atol=1e-6,
                existing=(model, x, y), show=False,
            )  # fmt: skip
            rows += [as_dict(r, method=f"{name}: {r.name}", batch=batch) for r in res]
    return rows
