"""Assertions with failure messages that name the worst entries, and brute-force references
for the tests that share them."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def assert_close(actual: Tensor, expected: Tensor, what: str, rtol: float, atol: float) -> None:
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    if torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True):
        return
    err = (actual - expected).abs() - rtol * expected.abs()
    flat = err.flatten().nan_to_num(float("inf"))
    worst = flat.topk(min(3, flat.numel())).indices
    lines = [
        f"  at {tuple(int(j) for j in torch.unravel_index(torch.tensor(i), actual.shape))}: "
        f"got {actual.flatten()[i].item():.6g}, expected {expected.flatten()[i].item():.6g}"
        for i in worst.tolist()
    ]
    raise AssertionError(
        f"{what} differs (rtol={rtol}, atol={atol}); worst entries:\n" + "\n".join(lines)
    )


def positive_curvature_blocks(model, x, loss_fn, y, power=1):
    """Each parameter's block of the positive-curvature Hessian of a Sequential of linear
    layers and sigmoid/tanh activations, by brute force: the GGN's block plus, for each
    activation, ``sum_n J_nᵀ diag(f(r_n)) J_n`` (``J_n``: the Jacobian of its input for sample
    n, ``r = σ''(z) δ**power``), for f = clip (``max(r, 0)``) and abs."""
    from torch.func import functional_call

    params = {k: p.detach() for k, p in model.named_parameters()}
    curved = [i for i, m in enumerate(model) if isinstance(m, nn.Sigmoid | nn.Tanh)]

    def inputs_of(ps):  # the activations' inputs z and outputs a, and the output
        h, found = x, {}
        for i, m in enumerate(model):
            own = {k.split(".", 1)[1]: v for k, v in ps.items() if k.split(".")[0] == str(i)}
            nxt = functional_call(m, own, (h,))
            if i in curved:
                found[i] = (h, nxt)
            h = nxt
        return found, h

    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    found, out = inputs_of(live)
    deltas = torch.autograd.grad(loss_fn(out, y), [found[i][1] for i in curved])
    residuals = {}
    for i, d in zip(curved, deltas, strict=True):
        z = found[i][0].detach()
        if isinstance(model[i], nn.Sigmoid):
            s = torch.sigmoid(z)
            second = s * (1 - s) * (1 - 2 * s)
        else:
            t = torch.tanh(z)
            second = -2 * t * (1 - t * t)
        residuals[i] = second * d**power
    from leanprop.testing import ggn_blocks

    ggn = ggn_blocks(model, x, loss_fn, y)
    blocks = {"clip": {}, "abs": {}}
    for k, p in params.items():
        n = x.shape[0]
        jac = {
            i: torch.autograd.functional.jacobian(
                lambda w, i=i, k=k: inputs_of({**params, k: w})[0][i][0], p
            ).reshape(n, -1, p.numel())
            for i in curved
        }
        for mode, f in (("clip", lambda r: r.clamp(min=0)), ("abs", torch.abs)):
            block = ggn[k][0].clone()
            for i in curved:
                r = f(residuals[i]).reshape(n, -1)
                block += torch.einsum("nkp,nk,nkq->pq", jac[i], r, jac[i])
            blocks[mode][k] = block
    return blocks
