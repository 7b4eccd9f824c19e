"""Curvature on the reference CNN and an MLP: ``DiagGGNExact``, ``DiagHessian`` and
``KFAC`` by leanprop's :func:`leanprop.ggn` and by BackPACK (where it is installed), side by
side with a plain step.

Each method runs one training step: forward, the curvature, and the loss's backward (the
plain step: forward and backward only). leanprop's exact quantities are checked against
BackPACK's (float32, relative tolerance 1e-4; KFAC's Monte-Carlo draws differ: not compared).
Time in rounds, peak tensor memory of one step. Rows are ``model/quantity: method``.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

import leanprop
from leanprop.measure import as_dict

from .per_sample_suite import cnn


def mlp() -> nn.Sequential:
    """An MNIST-sized MLP, 784-256-128-10 with ReLU."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )  # fmt: skip


def mlp_sigmoid() -> nn.Sequential:
    """The MLP with sigmoids: curved activations, whose terms the Hessian adds to the GGN
    (one backward per unit and sign for leanprop: 768 more passes)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 256), nn.Sigmoid(), nn.Linear(256, 128), nn.Sigmoid(),
        nn.Linear(128, 10),
    )  # fmt: skip


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "mlp_sigmoid": mlp_sigmoid, "cnn": cnn}


QUANTITIES = ("DiagGGNExact", "DiagHessian", "KFAC")


def _results(model: nn.Module, attr: str) -> list[Tensor]:
    """The quantity of each parameter (its Kronecker factors flattened), or ``.grad``."""
    out: list[Tensor] = []
    for p in model.parameters():
        value = getattr(p, attr, p.grad)
        out.extend(value if isinstance(value, list) else [value])
        p.grad = None
    return out


def _variants(
    name: str, quantity: str, batch: int, device: str
) -> tuple[dict[str, Callable[[], object]], list]:
    torch.manual_seed(0)
    models = [MODELS[name]().to(device) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    loss_fn = nn.CrossEntropyLoss()
    q = getattr(leanprop, quantity)()

    def plain() -> list[Tensor]:
        loss_fn(models[0](x), y).backward()
        return _results(models[0], "grad")

    def ours() -> list[Tensor]:
        model = models[1]
        with leanprop.per_sample(model, check=False) as ctx:
            out = model(x)
            leanprop.ggn(ctx, out, loss_fn, y, q)
            loss_fn(out, y).backward()
        return _results(model, q.attr)

    variants: dict[str, Callable[[], object]] = {"plain": plain, "leanprop": ours}
    if importlib.util.find_spec("backpack") is not None:
        from backpack import backpack, extend, extensions

        theirs_model, theirs_loss = extend(models[2]), extend(nn.CrossEntropyLoss())

        def theirs() -> list[Tensor]:
            loss = theirs_loss(theirs_model(x), y)
            with backpack(getattr(extensions, quantity)()):
                loss.backward()
            return _results(theirs_model, q.attr)

        variants["backpack"] = theirs
    return variants, models


def run(device: str = "cpu", batches: tuple[int, ...] = (32,), reps: int = 5) -> list[dict]:
    """One row per model, quantity, batch size and method; ratios to the plain step."""
    rows = []
    for name in MODELS:
        for quantity in QUANTITIES:
            for batch in batches:
                variants, models = _variants(name, quantity, batch, device)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # (BackPACK's notes on full backward hooks)
                    res = leanprop.compare(
                        variants, device=device, reps=reps, check=False, existing=tuple(models),
                        show=False,
                    )  # fmt: skip
                    ours = variants["leanprop"]()
                    theirs = variants.get("backpack", lambda: None)()
                agrees = None
                if theirs is not None and quantity != "KFAC":
                    agrees = all(
                        torch.allclose(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item())
                        for a, b in zip(ours, theirs, strict=True)
                    )
                for r in res:
                    row = as_dict(r, batch=batch, method=f"{name}/{quantity}: {r.name}")
                    if r.name == "leanprop":
                        row["agrees"] = agrees
                    rows.append(row)
    return rows
