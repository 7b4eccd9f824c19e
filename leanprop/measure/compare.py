"""Side-by-side comparison of training-step variants: time, peak memory, agreement."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from .._torch_compat import tree_flatten
from ..errors import LeanpropError, LeanpropValueError
from .memory import track_memory
from .timing import time_interleaved


class MismatchError(LeanpropError, AssertionError):
    """Variants of a comparison returned results that do not agree."""


@dataclass
class Row:
    """One variant's measurements; ratios are to the baseline of the same run."""

    name: str
    median_s: float
    min_s: float
    peak_mib: float
    time_ratio: float = 1.0
    min_ratio: float = 1.0
    mem_ratio: float | None = 1.0
    agrees: bool | None = None  # None: not checked (the baseline itself, or check=False)
    max_abs_diff: float | None = None


def _by_key(result: Any) -> Any:
    """``result`` with every dict's keys sorted, so dicts compare by key, not by order."""
    if isinstance(result, Mapping):
        return {k: _by_key(result[k]) for k in sorted(result, key=repr)}
    if isinstance(result, list | tuple):
        return type(result)(_by_key(v) for v in result) if type(result) in (list, tuple) else result
    return result


def _leaf_agreement(a: Any, b: Any, rtol: float, atol: float) -> tuple[bool, float]:
    """One leaf: tensors and numbers within ``atol + rtol * max|b|`` (NaN and inf must sit at
    the same places with the same values), anything else equal."""
    if isinstance(a, Tensor) != isinstance(b, Tensor):
        return False, float("inf")
    if not isinstance(a, Tensor):
        if isinstance(a, int | float | complex) and isinstance(b, int | float | complex):
            a, b = torch.tensor(a), torch.tensor(b)
        elif hasattr(a, "__array__") and hasattr(b, "__array__"):  # numpy arrays
            a, b = torch.as_tensor(a), torch.as_tensor(b)
        elif isinstance(a, str | bytes | None) or isinstance(b, str | bytes | None):
            return a == b, 0.0 if a == b else float("inf")
        else:  # other objects (a module returned by a step): not compared
            return True, 0.0
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return False, float("inf")
    if not a.numel():
        return True, 0.0
    if not (a.is_floating_point() or a.is_complex()):
        a, b = a.double(), b.double()
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    a, b = a.to(wide), b.to(wide)
    finite = torch.isfinite(a) & torch.isfinite(b)
    same_special = bool(((a == b) | (a.isnan() & b.isnan()) | finite).all())
    if not finite.any():
        return same_special, 0.0 if same_special else float("inf")
    diff = float((a - b)[finite].abs().max())
    scale = float(b[finite].abs().max())
    return same_special and diff <= atol + rtol * scale, diff if same_special else float("inf")


def _agreement(result: Any, reference: Any, rtol: float, atol: float) -> tuple[bool, float]:
    """Leaf by leaf (same structure, dicts by key): ``max|a - b| <= atol + rtol * max|b|``
    (scale-aware, so entries near zero do not fail on rounding that is tiny relative to the
    tensor); numbers too, non-numeric leaves equal."""
    got, got_spec = tree_flatten(_by_key(result))
    ref, ref_spec = tree_flatten(_by_key(reference))
    if got_spec != ref_spec:
        return False, float("inf")
    ok, worst = True, 0.0
    for a, b in zip(got, ref, strict=True):
        agree, diff = _leaf_agreement(a, b, rtol, atol)
        ok, worst = ok and agree, max(worst, diff)
    return ok, worst


def format_table(rows: list[dict]) -> str:
    """Rows as a fixed-width table, time and peak memory with ratios to the baseline.

    Each row is a dict with ``method``, ``median_s``, ``time_ratio``, ``min_s``, ``min_ratio``,
    ``peak_mib``, ``mem_ratio``, and optionally ``batch``, ``agrees`` (with ``max_abs_diff``)
    and ``extra`` (a short text appended to the line); a row with ``max_rel`` (a check) or
    ``error`` (a failed method) is printed as a note.
    """
    batch = any("batch" in r for r in rows)
    lead_head = f"{'batch':>5}  " if batch else ""
    head = (
        f"{lead_head}{'method':<30}{'median s':>10}{'x base':>8}{'min s':>9}{'x base':>8}"
        f"{'peak MiB':>10}{'x base':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lead = (f"{r.get('batch', ''):>5}  " if batch else "") + f"{r['method']:<30}"
        if "max_rel" in r:
            lines.append(f"{lead}max relative deviation {r['max_rel']:.1e}")
        elif "error" in r:
            lines.append(f"{lead}failed: {' '.join(r['error'])}")
        else:
            mem = f"{r['mem_ratio']:>8.2f}" if r.get("mem_ratio") is not None else f"{'-':>8}"
            agrees = r.get("agrees")
            tail = "" if agrees is None else "  agrees" if agrees else "  DISAGREES"
            if agrees is False and r.get("max_abs_diff") is not None:
                tail += f" (max abs diff {r['max_abs_diff']:.1e})"
            if r.get("extra"):
                tail += f"  {r['extra']}"
            lines.append(
                f"{lead}{r['median_s']:>10.4f}{r['time_ratio']:>8.2f}{r['min_s']:>9.4f}"
                f"{r['min_ratio']:>8.2f}{r['peak_mib']:>10.1f}{mem}{tail}"
            )
    return "\n".join(lines)


def as_dict(row: Row, **extra: Any) -> dict:
    """A :class:`Row` as a table/JSON row (``name`` becomes ``method``)."""
    d = asdict(row)
    d["method"] = d.pop("name")
    return {**d, **extra}


def compare(
    variants: Mapping[str, Callable[[], Any]],
    *,
    baseline: str | None = None,
    device: str | torch.device = "cpu",
    reps: int = 10,
    warmup: int = 1,
    check: bool = True,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    existing: tuple[Any, ...] = (),
    show: bool = True,
) -> list[Row]:
    """Run variants of a training step; print and return time and peak memory with ratios to
    ``baseline``, and check that every variant's result agrees with the baseline's.

    Each variant is a callable without arguments that runs one step and returns its result
    (a tensor, or any nesting of lists/tuples/dicts of tensors). Peak memory is measured with
    :class:`leanprop.track_memory` on the first (cold) call, whose result is the one checked;
    time afterwards, in rounds that call every variant once (so that load changes on a shared
    machine affect all variants alike).

    Example:
        >>> import torch, leanprop
        >>> x = torch.randn(64, 64)
        >>> steps = {"matmul": lambda: x @ x, "einsum": lambda: torch.einsum("ij,jk->ik", x, x)}
        >>> rows = leanprop.compare(steps, reps=2, show=False)
        >>> rows[1].agrees
        True

    Args:
        variants: name -> step callable; the first is the baseline unless ``baseline`` names one.
        device: where the steps run (memory tracker and synchronisation).
        check: compare each result tensor with the baseline's, ``max|a - b| <= atol +
            rtol * max|b|``, and raise :class:`MismatchError` (after printing the table) if any
            variant disagrees.
        existing: modules/tensors alive before the steps (never counted as allocations).
        show: print the table.

    Returns:
        One :class:`Row` per variant, in the given order.
    """
    if not isinstance(variants, Mapping):
        raise LeanpropValueError(
            f"compare() got variants as a {type(variants).__name__}; pass a dict from names to "
            "step callables, e.g. {'plain': step_a, 'leanprop': step_b}."
        )
    if not variants:
        raise LeanpropValueError("compare() got no variants; pass {'name': step_callable, ...}.")
    names = list(variants)
    base = names[0] if baseline is None else baseline
    if base not in variants:
        raise LeanpropValueError(
            f"compare() got baseline={baseline!r}, which is not a variant; variants: {names}."
        )
    results: dict[str, Any] = {}
    rows: dict[str, Row] = {}
    peaks: dict[str, float] = {}
    for name in [base, *(n for n in names if n != base)]:
        with track_memory(device, existing=existing) as mem:
            results[name] = variants[name]()
        peaks[name] = mem.peak_mib
    times = time_interleaved(variants, device, warmup=warmup, reps=reps)
    for name in names:
        rows[name] = Row(name, times[name].median, times[name].min, peaks[name])
    ref = rows[base]
    for name, row in rows.items():
        row.time_ratio = row.median_s / ref.median_s if ref.median_s > 0 else float("nan")
        row.min_ratio = row.min_s / ref.min_s if ref.min_s > 0 else float("nan")
        row.mem_ratio = row.peak_mib / ref.peak_mib if ref.peak_mib > 0 else None
        if check and name != base:
            row.agrees, row.max_abs_diff = _agreement(results[name], results[base], rtol, atol)
    ordered = [rows[n] for n in names]
    if show:
        print(format_table([as_dict(r) for r in ordered]), flush=True)
    bad = [r.name for r in ordered if r.agrees is False]
    if bad:
        raise MismatchError(
            f"compare(): the results of {', '.join(map(repr, bad))} do not agree with '{base}' "
            f"(rtol={rtol}, atol={atol}); see the table's 'agrees' column for the largest "
            "absolute difference. Fix the variant, or loosen rtol/atol if the difference is "
            "rounding."
        )
    return ordered
