"""Generic rule for any module that owns parameters but has no closed-form rule.

Individual gradients come from ``torch.func``: for every sample, the gradient of
``<module(x_n), g_n>`` with respect to the module's parameters, vectorised with ``vmap``. The
module's whole sub-tree is handled in one go, so modules that use their children's parameters
directly (``nn.MultiheadAttention``) are covered.

Modules that cannot be vmapped (RNNs) fall back to a loop over samples with ordinary autograd:
slow, but every model works.

Inputs and outputs are split along ``batch_dim`` (0, or 1 for sequence-first modules such as
``nn.MultiheadAttention(batch_first=False)``); tensors whose size there differs from N are
passed whole to every sample.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ..._torch_compat import tree_flatten, tree_unflatten
from ...errors import UnsupportedModelError


def batch_dim_of(module: nn.Module) -> int:
    """Batch dimension of the module's inputs: 1 for sequence-first attention/RNNs, else 0."""
    seq_first = (nn.MultiheadAttention, nn.RNNBase)
    if isinstance(module, seq_first) and not getattr(module, "batch_first", False):
        return 1
    return 0


def _split_dim(t: Any, preferred: int, n: int) -> int | None:
    if not isinstance(t, Tensor):
        return None
    if t.dim() > preferred and t.shape[preferred] == n:
        return preferred
    return None


def _grad_dim(g: Tensor, preferred: int, n: int) -> int:
    """Batch dim of an output gradient: ``preferred`` if its size is N, else the first dim of
    size N (e.g. an RNN's final state ``[layers, N, H]`` of a batch-first module)."""
    if g.dim() > preferred and g.shape[preferred] == n:
        return preferred
    for d, size in enumerate(g.shape):
        if size == n:
            return d
    raise UnsupportedModelError(
        f"per_sample: an output of shape {tuple(g.shape)} has no dimension of the batch size {n}; "
        "the torch.func fallback cannot split it into samples. Register a rule for this module "
        "with leanprop.register_rule, or freeze its parameters."
    )


def fallback_batch_grads(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grads_out: list[Tensor | None],
    names: frozenset[str],
    n: int,
    in_dims: list[int | None] | None = None,
    out_dims: list[int | None] | None = None,
) -> dict[str, Tensor]:
    """Individual gradients ``{name: [N, *p.shape]}`` of the module's parameters in ``names``.

    Args:
        module: the module, called as ``module(*args, **kwargs)`` during forward.
        args, kwargs: the captured call (a chunk of samples along the batch dim).
        grads_out: gradient of each leaf of the flattened output, None where it got none.
        names: qualified parameter names (as in ``module.named_parameters()``) to differentiate.
        n: number of samples in this chunk.
        in_dims, out_dims: the batch dimension of each leaf of the flattened ``(args,
            kwargs)`` and output (None: no batch); by default found from the module's documented
            layout (``batch_first``).
    """
    bd = batch_dim_of(module)
    params = {k: p for k, p in module.named_parameters() if k in names}
    leaves, spec = tree_flatten((args, kwargs))
    if in_dims is None:
        in_dims = [_split_dim(t, bd, n) for t in leaves]
    got = [(i, g) for i, g in enumerate(grads_out) if g is not None]
    if out_dims is None:
        g_dims = [_grad_dim(g, bd, n) for _, g in got]
    else:
        g_dims = [out_dims[i] for i, _ in got]
        if None in g_dims:
            raise UnsupportedModelError(
                f"per_sample: {type(module).__name__} returned an output without batch "
                "dimension that got a gradient; the torch.func fallback cannot split it into "
                "samples. Freeze this module's parameters, or register a rule for it."
            )

    def outputs(
        p: dict[str, Tensor], in_leaves: list[Any], g_leaves: list[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """One sample's outputs that got a gradient, and those gradients (batch dim kept)."""
        full = [
            t.unsqueeze(d) if d is not None else t for t, d in zip(in_leaves, in_dims, strict=True)
        ]
        a, kw = tree_unflatten(full, spec)
        out_leaves, _ = tree_flatten(functional_call(module, p, a, kw))
        gs = [g.unsqueeze(d) for g, d in zip(g_leaves, g_dims, strict=True)]
        return [out_leaves[i] for i, _ in got], gs

    def one(p: dict[str, Tensor], in_leaves: list[Any], g_leaves: list[Tensor]) -> Tensor:
        outs, gs = outputs(p, in_leaves, g_leaves)
        return sum(((o * g).sum() for o, g in zip(outs, gs, strict=True)), torch.zeros(()))

    g_leaves = [g for _, g in got]
    try:
        with warnings.catch_warnings():
            # torch's note that some op (e.g. CPU flash attention) is vmapped by a slow loop
            warnings.filterwarnings("ignore", message="There is a performance drop")
            return vmap(grad(one), in_dims=(None, in_dims, g_dims))(params, leaves, g_leaves)
    except RuntimeError:
        # some modules cannot be vmapped (e.g. RNNs build their hidden state from the batch
        # size): differentiate one sample at a time with ordinary autograd instead
        return _loop(params, outputs, leaves, in_dims, g_leaves, g_dims, n)


def loop_over_samples(
    params: dict[str, Tensor],
    n: int,
    sample: Callable[[dict[str, Tensor], int], tuple[list[Tensor], list[Tensor]]],
) -> dict[str, Tensor]:
    """Individual gradients ``{name: [N, *p.shape]}`` one sample at a time: ``sample(params,
    i)`` gives sample ``i``'s outputs and their gradients, whose vector-Jacobian product with
    respect to ``params`` alone is its gradient (``torch.func.grad``: the inputs and output
    gradients are constants of it, even where they depend on the same parameters, e.g. a
    state the module computed itself). Under grad mode (a ``create_graph`` backward) the
    results stay differentiable with respect to everything."""

    def total(p: dict[str, Tensor], i: int) -> Tensor:
        outs, gs = sample(p, i)
        return sum(((o * g).sum() for o, g in zip(outs, gs, strict=True)), torch.zeros(()))

    rows = [grad(total)(params, i) for i in range(n)]
    return {k: torch.stack([r[k] for r in rows]) for k in params}


def _loop(
    params: dict[str, Tensor],
    outputs: Any,
    leaves: list[Any],
    in_dims: list[int | None],
    g_leaves: list[Tensor],
    g_dims: list[int],
    n: int,
) -> dict[str, Tensor]:
    """The slow path of :func:`fallback_batch_grads`: a loop over samples."""
    create_graph = torch.is_grad_enabled()

    def pick(t: Any, d: int | None, i: int) -> Any:
        if d is None:
            return t
        t = t.select(d, i)
        return t if create_graph or not isinstance(t, Tensor) else t.detach()

    def sample(p: dict[str, Tensor], i: int) -> tuple[list[Tensor], list[Tensor]]:
        ins = [pick(t, d, i) for t, d in zip(leaves, in_dims, strict=True)]
        return outputs(p, ins, [pick(g, d, i) for g, d in zip(g_leaves, g_dims, strict=True)])

    return loop_over_samples(params, n, sample)
