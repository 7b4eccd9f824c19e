"""``leanprop bench``: reproduce the reference comparisons.

Usage: ``leanprop bench [suite ...] [--device cpu|cuda] [--batch N ...] [--reps R] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable

import torch

from . import per_sample_suite

# suites not built yet are listed, never faked
SUITES: dict[str, Callable[..., list[dict]] | None] = {
    "per-sample": per_sample_suite.run,
    "in-backward": None,
    "side-losses": None,
    "variance-of-gradients": None,
}


def environment() -> dict:
    """What the numbers were measured on."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def format_table(rows: list[dict]) -> str:
    """Rows as a fixed-width table: time and peak memory with ratios to ``plain``."""
    head = (
        f"{'batch':>5}  {'method':<28}{'median s':>10}{'x plain':>9}{'peak MiB':>10}{'x plain':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "max_rel" in r:
            lines.append(
                f"{r['batch']:>5}  {r['method']:<28} max relative deviation {r['max_rel']:.1e}"
            )
        elif "error" in r:
            lines.append(f"{r['batch']:>5}  {r['method']:<28} failed: {' '.join(r['error'])}")
        else:
            mem = f"{r['mem_ratio']:>9.2f}" if r.get("mem_ratio") is not None else f"{'-':>9}"
            lines.append(
                f"{r['batch']:>5}  {r['method']:<28}{r['median_s']:>10.4f}{r['time_ratio']:>9.2f}"
                f"{r['min_s']:>9.4f}{r['min_ratio']:>9.2f}{r['peak_mib']:>10.1f}{mem}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``leanprop`` command."""
    ap = argparse.ArgumentParser(prog="leanprop", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="measure leanprop beside plain PyTorch and competitors")
    b.add_argument("suites", nargs="*", default=["per-sample"], help=f"any of {', '.join(SUITES)}")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--batch", type=int, nargs="+", default=[64])
    b.add_argument("--reps", type=int, default=10)
    b.add_argument("--json", help="also write the rows and the environment to this file")
    a = ap.parse_args(argv)
    unknown = [s for s in a.suites if s not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    report: dict = {"environment": environment(), "suites": {}}
    for name in a.suites:
        suite = SUITES[name]
        if suite is None:
            print(f"[{name}] unavailable: this capability is not built yet", flush=True)
            report["suites"][name] = "unavailable"
            continue
        print(f"[{name}] device={a.device} batch={a.batch} reps={a.reps} ...", flush=True)
        rows = suite(device=a.device, batches=tuple(a.batch), reps=a.reps)
        print(format_table(rows), flush=True)
        report["suites"][name] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
