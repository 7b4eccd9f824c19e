"""Per-sample gradients on the CNN of BackPACK's "saving memory in convolutions" example.

Methods: ``plain`` (ordinary forward+backward), leanprop's quantities and conv algorithms, and
BackPACK / Opacus / torch.func side by side when they are installed. Memory is measured for each
method in a fresh process (``python -m leanprop.bench.per_sample_suite METHOD ...``): peak
tensor memory with :class:`leanprop.track_memory` (exact tensor bytes), on CPU also the
resident-set peak of the first call (comparable with RSS-based numbers elsewhere). Time is
measured afterwards in this process, all methods side by side in rounds (one call of each per
round), so that load changes on a shared machine affect them alike. leanprop's individual
gradients are checked against torch.func's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

import leanprop

from ..measure import time_fn, time_interleaved, track_memory
from .measure import rss_peak_mib

LEANPROP_METHODS = {
    "leanprop_batchgrad": (leanprop.BatchGrad(), "auto"),
    "leanprop_batchgrad_grouped": (leanprop.BatchGrad(), "grouped"),
    "leanprop_l2": (leanprop.BatchL2Grad(), "auto"),
    "leanprop_variance": (leanprop.Variance(), "auto"),
}
COMPETITORS = {
    "backpack": "backpack",
    "backpack_savemem": "backpack",
    "opacus_hooks": "opacus",
    "torchfunc": "torch",
}


def cnn() -> nn.Sequential:
    """The reference CNN (MNIST-sized input ``[N, 1, 28, 28]``, 10 classes)."""
    return nn.Sequential(
        nn.Conv2d(1, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(128, 256, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, padding=1, stride=2),
        nn.Conv2d(256, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(64, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def available(method: str) -> bool:
    """Whether ``method`` can run here (its package is installed)."""
    pkg = COMPETITORS.get(method)
    return pkg is None or importlib.util.find_spec(pkg) is not None


def make_step(method: str, device: torch.device, batch: int) -> Callable[[], list[Tensor]]:
    """A callable running one step of ``method``; returns the per-sample results."""
    torch.manual_seed(0)
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    model = cnn().to(device)
    loss_fn = nn.CrossEntropyLoss()
    params = list(model.parameters())

    def clear() -> None:
        for p in params:
            p.grad = None

    if method == "plain":

        def step() -> list[Tensor]:
            loss_fn(model(x), y).backward()
            out = [p.grad for p in params]
            clear()
            return out

    elif method in LEANPROP_METHODS:
        quantity, algorithm = LEANPROP_METHODS[method]

        def step() -> list[Tensor]:
            with leanprop.per_sample(model, quantity, conv_algorithm=algorithm):
                loss_fn(model(x), y).backward()
            out = [getattr(p, quantity.attr) for p in params]
            clear()
            return out

    elif method.startswith("backpack"):
        from backpack import backpack, extend, extensions
        from backpack.core.derivatives.convnd import weight_jac_t_save_memory

        model, loss_fn = extend(model), extend(loss_fn)

        def step() -> list[Tensor]:
            with weight_jac_t_save_memory(save_memory=method == "backpack_savemem"):
                loss = loss_fn(model(x), y)
                with backpack(extensions.BatchGrad()):
                    loss.backward()
            out = [p.grad_batch for p in params]
            clear()
            return out

    elif method == "opacus_hooks":
        from opacus import GradSampleModule

        gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")

        def step() -> list[Tensor]:
            loss_fn(gsm(x), y).backward()
            out = [p.grad_sample for p in params]
            gsm.zero_grad(set_to_none=True)
            return out

    elif method == "torchfunc":
        from torch.func import functional_call, grad, vmap

        detached = {k: v.detach() for k, v in model.named_parameters()}

        def one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            return loss_fn(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        per_sample_grad = vmap(grad(one), in_dims=(None, 0, 0))

        def step() -> list[Tensor]:
            return list(per_sample_grad(detached, x, y).values())

    else:
        raise leanprop.LeanpropValueError(
            f"unknown per-sample benchmark method {method!r}; allowed: plain, "
            f"{', '.join([*LEANPROP_METHODS, *COMPETITORS])}."
        )
    return step


def check_agreement(device: torch.device, batch: int) -> float:
    """Largest relative deviation of leanprop's individual gradients from torch.func's."""
    ours = make_step("leanprop_batchgrad", device, batch)()
    ref = make_step("torchfunc", device, batch)()
    # torch.func differentiates each sample's mean-reduced loss of one sample: scale by 1/N
    return max(
        float((a - b / batch).norm() / (b / batch).norm()) for a, b in zip(ours, ref, strict=True)
    )


def measure_in_subprocess(method: str, device: str, batch: int, reps: int) -> dict:
    """Run ``method`` in a fresh interpreter; returns its JSON record."""
    cmd = [sys.executable, "-m", __name__, method, "--device", device, "--batch", str(batch)]
    cmd += ["--reps", str(reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"method": method, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(device: str = "cpu", batches: tuple[int, ...] = (64,), reps: int = 10) -> list[dict]:
    """Measure every available method for each batch size; rows carry ratios to ``plain``."""
    methods = ["plain", *LEANPROP_METHODS, *(m for m in COMPETITORS if available(m))]
    rows = []
    for batch in batches:
        recs = []
        for i, m in enumerate(methods, 1):
            print(f"  ({i}/{len(methods)}) N={batch} {m}: memory ...", file=sys.stderr, flush=True)
            recs.append(measure_in_subprocess(m, device, batch, 0))
        ok = [r["method"] for r in recs if "error" not in r]
        print(f"  N={batch}: time, {len(ok)} methods side by side ...", file=sys.stderr, flush=True)
        steps = {m: make_step(m, torch.device(device), batch) for m in ok}
        with warnings.catch_warnings():  # BackPACK's and Opacus's module hooks warn each call
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            # (warm-up: leanprop's "auto" convolution algorithm tries the algorithms in turn
            # on a layer's first calls)
            timings = time_interleaved(steps, device, reps=reps, warmup=10)
        for m, t in timings.items():
            next(r for r in recs if r["method"] == m).update(median_s=t.median, min_s=t.min)
        del steps
        base = recs[0]
        for r in recs:
            r["batch"] = batch
            if "error" not in r:
                r["time_ratio"] = r["median_s"] / base["median_s"]
                r["min_ratio"] = r["min_s"] / base["min_s"]
                r["mem_ratio"] = r["peak_mib"] / base["peak_mib"] if base["peak_mib"] > 0 else None
        rows += recs
        rel = check_agreement(torch.device(device), min(batch, 16))
        rows.append({"method": "check: leanprop vs torch.func", "batch": batch, "max_rel": rel})
    return rows


def _worker() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("method")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    device = torch.device(a.device)
    step = make_step(a.method, device, a.batch)
    rec: dict = {"method": a.method}
    if device.type == "cpu":  # cold call first, in a fresh process
        rec["rss_peak_mib"] = rss_peak_mib(step)
    with track_memory(device) as mem:
        step()
    rec["peak_mib"] = mem.peak_mib
    if a.reps > 0:  # 0: memory only (the suite times all methods side by side itself)
        t = time_fn(step, device, reps=a.reps)
        rec.update(median_s=t.median, min_s=t.min)
    print(json.dumps(rec))


if __name__ == "__main__":
    _worker()
