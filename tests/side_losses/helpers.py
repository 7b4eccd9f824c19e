"""The model and training loss shared by the side-loss tests: a backbone with a penalty per
layer, trained with the combined loss or with eager side losses."""

from __future__ import annotations

import torch
from torch import nn

from leanprop import side_loss


def build(layers=3, d=6):
    torch.manual_seed(0)
    backbone = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(layers)])
    pens = nn.ModuleList(
        [nn.Sequential(nn.Linear(d, 12), nn.GELU(), nn.Linear(12, 1)) for _ in range(layers)]
    )
    head = nn.Linear(d, 1)
    return nn.ModuleList([backbone, pens, head])


def penalty(pen):
    return lambda t: pen(t).square().mean()


def objective(model, x, eager, alpha=0.1, free_penalty=False, log=None, scale=None, offload=False):
    """The training loss of ``build()``'s model: combined, or with eager side losses."""
    backbone, pens, head = model
    h, extra = x, []
    for blk, pen in zip(backbone, pens, strict=True):
        h = blk(h)
        fn = (lambda t: t.square().mean()) if free_penalty else penalty(pen)
        if eager:
            h = side_loss(h, fn, weight=alpha, log=log, scale=scale, offload=offload)
        else:
            extra.append(alpha * fn(h))
    return head(h).square().mean() + sum(extra) if extra else head(h).square().mean()


def step(model, x, eager, **kwargs):
    objective(model, x, eager, **kwargs).backward()


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
