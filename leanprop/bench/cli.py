"""``leanprop bench``: reproduce the reference comparisons.

Usage: ``leanprop bench [suite ...] [--device cpu|cuda] [--size small|large] [--batch N ...]
[--reps R] [--json PATH] [--plot PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..measure import format_table
from . import (
    curvature_suite,
    distributed_suite,
    dp_suite,
    in_backward_suite,
    per_sample_suite,
    real_models_suite,
    side_loss_suite,
    variance_suite,
)


@dataclass(frozen=True)
class Suite:
    """A benchmark suite: ``run(device, batches, reps) -> rows``, or None if not built yet."""

    about: str
    run: Callable[..., list[dict]] | None
    batches: dict[str, tuple[int, ...]]


SUITES: dict[str, Suite] = {
    "per-sample": Suite(
        "individual gradients on the reference CNN: plain, leanprop, BackPACK, Opacus, torch.func",
        per_sample_suite.run,
        {"small": (64,), "large": (64, 256)},
    ),
    "variance-of-gradients": Suite(
        "gradient of the total gradient variance: leanprop vs the per-sample loop",
        variance_suite.run,
        {"small": (32,), "large": (128,)},
    ),
    "in-backward": Suite(
        "AdamW steps inside backward on a GPT-2-like model: ordinary, tutorial hooks, leanprop",
        in_backward_suite.run,
        {"small": (), "large": ()},
    ),
    "distributed": Suite(
        "AdamW inside backward under DDP (2 processes): ordinary DDP, bucket views, leanprop",
        distributed_suite.run,
        {"small": (), "large": ()},
    ),
    "real-models": Suite(
        "individual gradients on GPT-2/BERT/ViT-like models and a GroupNorm ResNet-18: "
        "plain, leanprop, torch.func, Opacus",
        real_models_suite.run,
        {"small": (8,), "large": (32,)},
    ),
    "curvature": Suite(
        "DiagGGNExact, DiagHessian and KFAC on the reference CNN and an MLP (ReLU, sigmoid): "
        "plain, leanprop, BackPACK",
        curvature_suite.run,
        {"small": (32,), "large": (32, 128)},
    ),
    "dp": Suite(
        "a DP-SGD step on the reference CNN and a small transformer: plain, leanprop, Opacus "
        "hooks, Opacus ghost clipping",
        dp_suite.run,
        {"small": (16,), "large": (64,)},
    ),
    "side-losses": Suite(
        "penalties on intermediate activations: combined, checkpoint, backward-at-once, leanprop",
        side_loss_suite.run,
        {"small": (), "large": ()},
    ),
}


def _cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo; elsewhere what platform tells)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """What the numbers were measured on (the same code's ratios move with the CPU)."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def plot(report: dict, path: str) -> None:
    """Bar charts (time and peak memory ratios) of every measured suite, saved as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(
            "leanprop bench --plot needs matplotlib: pip install matplotlib (or the bench extra)"
        ) from e
    suites = {k: v for k, v in report["suites"].items() if isinstance(v, list)}
    fig, axes = plt.subplots(
        len(suites), 2, figsize=(12, 3 + 0.3 * 12 * len(suites)), squeeze=False
    )
    for (name, rows), (ax_t, ax_m) in zip(suites.items(), axes, strict=True):
        rows = [r for r in rows if "median_s" in r]
        labels = [f"{r['method']} (N={r['batch']})" for r in rows]
        ax_t.barh(labels, [r["time_ratio"] for r in rows])
        ax_m.barh(labels, [r["mem_ratio"] or 0 for r in rows])
        ax_t.set_title(f"{name}: time / baseline")
        ax_m.set_title(f"{name}: peak memory / baseline")
        for ax in (ax_t, ax_m):
            ax.axvline(1.0, color="k", lw=0.8)
            ax.invert_yaxis()
        ax_m.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``leanprop`` command."""
    ap = argparse.ArgumentParser(prog="leanprop", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="measure leanprop beside plain PyTorch and competitors")
    b.add_argument("suites", nargs="*", help=f"any of {', '.join(SUITES)} (default: all)")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--size", default="small", choices=["small", "large"])
    b.add_argument("--batch", type=_positive_int, nargs="+", help="batch sizes (override --size)")
    b.add_argument(
        "--reps", type=_positive_int, help="timed runs per method (default: 5 small, 10 large)"
    )
    b.add_argument("--json", help="also write the rows and the environment to this file")
    b.add_argument("--plot", help="also write a bar chart PNG to this file")
    a = ap.parse_args(argv)
    names = a.suites or list(SUITES)
    unknown = [s for s in names if s not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    for flag, path in (("--json", a.json), ("--plot", a.plot)):  # before hours of measuring
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not os.path.isdir(folder):
            ap.error(f"{flag} {path}: the folder {folder} does not exist; create it first")
    report: dict = {"environment": environment(), "suites": {}}
    for i, name in enumerate(names, 1):
        suite = SUITES[name]
        if suite.run is None:
            print(f"[{i}/{len(names)}] {name}: unavailable ({suite.about}: not built yet)")
            report["suites"][name] = "unavailable"
            continue
        batches = tuple(a.batch) if a.batch else suite.batches[a.size]
        print(f"[{i}/{len(names)}] {name}: {suite.about}; device={a.device} batch={batches}")
        sys.stdout.flush()
        reps = a.reps or (5 if a.size == "small" else 10)
        rows = suite.run(device=a.device, batches=batches, reps=reps)
        print(format_table(rows), flush=True)
        report["suites"][name] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    if a.plot:
        plot(report, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
