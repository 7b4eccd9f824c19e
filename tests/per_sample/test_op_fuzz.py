"""Every torch function after a layer, against the definition of a per-sample gradient.

For each function torch lets a ``TorchFunctionMode`` see, called in a few ways on a linear
layer's output ``h = lin(x)`` (``[N, D]``, with N == D == 3 so that no dimension is told from
the batch by its size, and with D == 4), the loss ``sum sin(f(h))²`` is run under
``per_sample``. Either leanprop refuses it (a clear error), or it runs and then

* the loss is a sum of per-sample terms: its Hessian with respect to the input has no block
  across two samples (for an output of one value, a function of a summed value, which the
  rules take as each sample's contribution, is allowed);
* each ``grad_batch`` is each sample's contribution: the gradient of the loss with the
  weight made a separate copy for that sample's row alone.

Random functions draw alike in each call (the generator seeded before it); in-place ones and
those without a second derivative are left out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import get_testing_overrides

import leanprop
from leanprop.per_sample.batch.rules import op_name

# (input shape, batch dimension): N == D (== T) so that no dimension is told from the batch
# by its size, a feature size of its own, sequences batch-first and sequence-first
LAYOUTS = {
    "N==D": ((3, 3), 0), "N!=D": ((3, 4), 0), "T==N==D": ((3, 3, 3), 0),
    "sequence-first": ((3, 3, 3), 1),
}  # fmt: skip


def _calls(h: Tensor) -> Iterator[tuple[Any, ...]]:
    """The ways each function is tried on ``h`` (those it does not take raise and are
    skipped): alone, with itself, with a dimension, with constants of either layout."""
    # (made for each call: a function may write into its operands)
    d = h.shape[-1]
    ones_row, ones_mat = torch.ones(d, dtype=h.dtype), torch.ones_like(h).detach()
    well_posed = 3 * torch.eye(d, dtype=h.dtype) + 0.1 * torch.arange(d * d).view(d, d) / d**2
    yield from [(h,), (h, h), (h, 0), (h, 1), (h, -1), (h, 2), (h, h, h), (h, ones_row)]
    yield from [(h, ones_mat), (ones_mat.T, h), (well_posed, h), (h, well_posed.clone())]
    yield from [(h, 0, 1), (h, 1, 0)]


def _loss(y: Any) -> Tensor | None:
    """``sum sin(y)²`` over the floating outputs that require grad (None without one)."""
    outs = [
        t for t in (y if isinstance(y, tuple | list) else (y,))
        if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point()
    ]  # fmt: skip
    return sum(t.sin().square().sum() for t in outs) if outs else None


def _many_values(y: Any) -> bool:
    outs = y if isinstance(y, tuple | list) else (y,)
    return any(isinstance(t, Tensor) and t.requires_grad and t.numel() > 1 for t in outs)


def _cases() -> list[tuple[str, Callable, int]]:
    names = {}
    for f in get_testing_overrides():
        name = op_name(f)
        if not name.startswith("_") and not name.endswith("_"):
            names.setdefault(name, f)
    return [(name, names[name], k) for name in sorted(names) for k in range(14)]


SKIPPED, REFUSED, EXACT = "skipped", "refused", "exact"


def _checked(f: Callable, k: int, shape: tuple[int, ...], bd: int) -> str:
    """What per_sample does with ``f``'s ``k``-th call on an input of ``shape`` with the
    batch at ``bd``: ``SKIPPED`` (not a call it takes, or nothing to check), ``REFUSED`` (a
    clear error), ``EXACT``, or what is wrong."""
    torch.manual_seed(0)
    n_samples, d = shape[bd], shape[-1]
    lin = nn.Linear(d, d).double()
    x = torch.randn(*shape, dtype=torch.float64)

    def run(inp: Tensor, layer: Callable[[Tensor], Tensor] = lin) -> Any:
        torch.manual_seed(1)  # (a random function draws alike each time)
        return f(*list(_calls(layer(inp)))[k])

    try:
        first, second = run(x), run(x)
        loss = _loss(first)
        if loss is None or not torch.isfinite(loss):
            return SKIPPED
        again = _loss(second)
        if again is None or not torch.equal(loss, again):  # (random)
            return SKIPPED
        loss.backward()  # (one torch cannot differentiate)
        lin.zero_grad(set_to_none=True)
    except Exception:  # (a call the function does not take)
        return SKIPPED

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, inp: Tensor) -> Any:
            return run(inp, self.lin)

    model = Model()
    try:
        with leanprop.per_sample(model, leanprop.BatchGrad(), batch_dim=bd):
            _loss(model(x)).backward()
    except leanprop.LeanpropError:
        return REFUSED
    except Exception as e:  # (torch's own, which the plain call did not raise)
        return f"raised {e!r}"
    if _many_values(first):
        try:
            hessian = torch.autograd.functional.hessian(lambda t: _loss(run(t)), x)
        except (RuntimeError, NotImplementedError):  # (no second derivative: unchecked)
            return SKIPPED
        nd = x.dim()
        rest = x.numel() // n_samples
        per = hessian.movedim(bd, 0).movedim(nd + bd, nd).reshape(n_samples, rest, n_samples, rest)
        blocks = per.permute(0, 2, 1, 3)
        pairs = [(i, j) for i in range(n_samples) for j in range(n_samples) if i != j]
        across = max(float(blocks[i, j].abs().max()) for i, j in pairs)
        if across > 1e-9:
            return f"ran on a loss that mixes the samples (cross-sample Hessian {across:.2e})"
    expected = []
    for n in range(n_samples):  # (the weight a copy of its own in sample n's row)
        w = lin.weight.detach().clone().requires_grad_()
        rows = [
            x.select(bd, m) @ (w if m == n else lin.weight.detach()).T + lin.bias.detach()
            for m in range(n_samples)
        ]
        torch.manual_seed(1)
        g = torch.autograd.grad(
            _loss(f(*list(_calls(torch.stack(rows, bd)))[k])), w, allow_unused=True
        )[0]
        expected.append(torch.zeros_like(w) if g is None else g)
    got, expected = lin.weight.grad_batch, torch.stack(expected)
    if not torch.allclose(expected.sum(0), lin.weight.grad, 1e-6, 1e-8, equal_nan=True):
        return SKIPPED  # (the oracle itself ill-conditioned: an SVD of nearly equal values)
    if got is None or not torch.allclose(got, expected, 1e-8, 1e-10, equal_nan=True):
        return "per-sample gradients other than each sample's contribution"
    return EXACT


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_torch_function_after_a_layer_is_refused_or_exact(layout):
    problems, counts = [], dict.fromkeys((SKIPPED, REFUSED, EXACT), 0)
    with warnings.catch_warnings():  # (deprecations of the calls tried)
        warnings.simplefilter("ignore")
        for name, f, k in _cases():
            found = _checked(f, k, *LAYOUTS[layout])
            if found in counts:
                counts[found] += 1
            else:
                problems.append(f"{name} (call {k}): {found}")
    assert counts[EXACT] and counts[REFUSED], counts  # (the loop checked something)
    assert not problems, "\n".join(problems)


def _param_calls(h: Tensor, p: Tensor) -> list[tuple[Any, ...]]:
    """The ways each function is tried with a parameter ``p`` beside ``h``."""
    return [(h, p), (p, h), (h, p, p), (h, 1, p)]


# shapes of a parameter used directly in an op (a scale, a projection, a bias of each row)
PARAM_SHAPES = {"vector": (3,), "matrix": (3, 3), "row": (1, 3)}


def _param_checked(f: Callable, k: int, shape: tuple[int, ...]) -> str:
    """What per_sample does with ``f``'s ``k``-th call with a parameter of ``shape`` on a
    layer's output ``[N, D]`` (N == D == 3): as :func:`_checked`, for the parameter's and the
    layer's individual gradients. Checked where the call is row by row (its output the rows'
    outputs stacked): each sample's contribution is then its own row's."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    p = nn.Parameter(torch.randn(*shape, dtype=torch.float64))
    x = torch.randn(3, 3, dtype=torch.float64)

    def call(h: Tensor, q: Tensor) -> Any:
        torch.manual_seed(1)
        return f(*_param_calls(h, q)[k])

    def by_rows(ws: list[Tensor], qs: list[Tensor]) -> Any:
        outs = [call(lin.bias.detach() + x[n : n + 1] @ ws[n].T, qs[n]) for n in range(3)]
        if not all(isinstance(o, Tensor) and o.dim() and o.shape[0] == 1 for o in outs):
            return None
        return torch.cat(outs)

    try:
        whole = call(lin(x), p)
        loss = _loss(whole)
        if loss is None or not torch.isfinite(loss) or not isinstance(whole, Tensor):
            return SKIPPED
        rows = by_rows([lin.weight] * 3, [p] * 3)
        if rows is None or rows.shape != whole.shape or not torch.allclose(rows, whole):
            return SKIPPED  # (not row by row: checked by the function's own fuzz)
        loss.backward()
        lin.zero_grad(set_to_none=True)
        p.grad = None
    except Exception:
        return SKIPPED

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.p = lin, p

        def forward(self, inp: Tensor) -> Any:
            return call(self.lin(inp), self.p)

    model = Model()
    try:
        with leanprop.per_sample(model, leanprop.BatchGrad()):
            _loss(model(x)).backward()
        grads = {"p": p.grad_batch, "lin.weight": lin.weight.grad_batch}
        model.zero_grad(set_to_none=True)
        with leanprop.per_sample(model, leanprop.BatchL2Grad()):  # (its closed forms alone)
            _loss(model(x)).backward()
    except leanprop.LeanpropError:
        return REFUSED
    except Exception as e:
        return f"raised {e!r}"
    for name, param in (("p", p), ("lin.weight", lin.weight)):
        expected = []
        for n in range(3):  # (sample n's row with copies of its own)
            w, q = lin.weight.detach().clone(), p.detach().clone()
            own = (w if name == "lin.weight" else q).requires_grad_()
            ws = [own if m == n and name == "lin.weight" else lin.weight.detach() for m in range(3)]
            qs = [own if m == n and name == "p" else p.detach() for m in range(3)]
            rows_loss = _loss(by_rows(ws, qs))
            if rows_loss is None:
                return SKIPPED
            g = torch.autograd.grad(rows_loss, own, allow_unused=True)[0]
            expected.append(torch.zeros_like(own) if g is None else g)
        expected = torch.stack(expected)
        if not torch.allclose(expected.sum(0), param.grad, 1e-6, 1e-8, equal_nan=True):
            return SKIPPED  # (the oracle ill-conditioned)
        got, norms = grads[name], param.batch_l2
        if got is None or not torch.allclose(got, expected, 1e-8, 1e-10, equal_nan=True):
            return f"{name}'s per-sample gradients other than each sample's contribution"
        squares = expected.flatten(1).square().sum(1)
        if norms is None or not torch.allclose(norms, squares, 1e-8, 1e-10, equal_nan=True):
            return f"{name}'s batch_l2 other than each contribution's squared norm"
    return EXACT


@pytest.mark.parametrize("shape", PARAM_SHAPES)
def test_every_torch_function_using_a_parameter_is_refused_or_exact(shape):
    """A parameter used directly by an op beside the batch (broadcast over it, multiplied
    with it): its individual gradients and their squared norms (from the closed forms, asked
    alone), and those of the layer before, are each sample's."""
    problems, counts = [], dict.fromkeys((SKIPPED, REFUSED, EXACT), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, f, k in _cases():
            if k >= 4:
                continue
            found = _param_checked(f, k, PARAM_SHAPES[shape])
            if found in counts:
                counts[found] += 1
            else:
                problems.append(f"{name} (call {k}): {found}")
    assert counts[EXACT], counts
    assert not problems, "\n".join(problems)
