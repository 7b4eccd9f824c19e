"""Assertions with failure messages that name the worst entries, and brute-force references
for the tests that share them."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


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


def assert_same_derivatives(ours: Tensor, theirs: Tensor, params: dict[str, Tensor]) -> None:
    """The gradients of two scalar functionals with respect to ``params`` are equal (float64,
    rtol 1e-9); where ours has none (None), theirs must be zero."""
    got = torch.autograd.grad(ours, list(params.values()), allow_unused=True)
    want = torch.autograd.grad(theirs, list(params.values()), allow_unused=True)
    for k, a, b in zip(params, got, want, strict=True):
        b = torch.zeros_like(params[k]) if b is None else b
        assert a is not None or not b.any(), k
        a = torch.zeros_like(params[k]) if a is None else a
        assert_close(a, b, f"d/d{k}", 1e-9, 1e-12)


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


def kfra_oracle(
    model: nn.Sequential, x, loss_fn, y, differentiable: bool = False
) -> dict[str, list[Tensor]]:
    """KFRA's Kronecker factors of a Sequential of linear layers, convolutions and
    per-sample modules, by its definition with brute-force pieces: ``B = sum_n H_n`` from the
    loss's full Hessian with respect to the output, then module by module back: a linear layer
    takes ``[B, E[a a^T]]`` (weight) and ``[B]`` (bias) and passes ``W^T B W``; a convolution
    ``[B_c, E[sum_l p_l p_l^T]]`` and ``[B_c]`` (``B_c``: ``B`` summed over the output
    positions on both sides; ``p_l`` its input patches, from the output's Jacobian with respect
    to the weight), as BackPACK's; any
    other module (and a convolution, to pass ``B`` on) ``1/N sum_n J_n^T B J_n`` with its
    per-sample Jacobians by ``torch.func.jacrev`` (deterministic modules only: dropout would
    draw new masks). ``differentiable``: the factors as functions of the parameters."""
    keep = (lambda t: t) if differentiable else (lambda t: t.detach())
    inputs, h = [], x
    for m in model:
        inputs.append(h)
        h = m(h)
    n, k = h.shape[0], h[0].numel()
    hess = torch.autograd.functional.hessian(
        lambda o: loss_fn(o, y), keep(h), create_graph=differentiable
    )
    hess = hess.reshape(n, k, n, k)
    b = torch.diagonal(hess, dim1=0, dim2=2).sum(-1)  # sum_n H_nn
    out: dict[str, list[Tensor]] = {}
    for i in reversed(range(len(model))):
        m, a = model[i], keep(inputs[i])
        if isinstance(m, nn.Linear):
            out[f"{i}.weight"] = [b, a.T @ a / n]
            if m.bias is not None:
                out[f"{i}.bias"] = [b]
            b = keep(m.weight).T @ b @ keep(m.weight)
            continue
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            c = m.out_channels
            b_c = b.view(c, b.shape[0] // c, c, -1).sum((1, 3))
            conv = (F.conv1d, F.conv2d, F.conv3d)[a.dim() - 3]
            # each output position's patch: d out[n, 0, l] / d W[0] (the same for every channel)
            jac = torch.autograd.functional.jacobian(
                lambda w, m=m, a=a, conv=conv: conv(a, w, None, m.stride, m.padding, m.dilation),
                m.weight.detach(),
                create_graph=differentiable,
            )  # [N, C_out, *S_out, C_out, C_in, *k]
            patches = jac[:, 0].flatten(1, -m.weight.dim() - 1)[:, :, 0].flatten(2)  # [N, L, K]
            out[f"{i}.weight"] = [b_c, torch.einsum("nlk,nlj->kj", patches, patches) / n]
            if m.bias is not None:
                out[f"{i}.bias"] = [b_c]
        jac = torch.func.vmap(torch.func.jacrev(lambda s, m=m: m(s[None])[0]))(a)
        jac = jac.reshape(n, -1, a[0].numel())  # [N, out units, in units]
        b = torch.einsum("nji,jk,knl->il", jac, b, jac.transpose(0, 1)) / n
    return out
