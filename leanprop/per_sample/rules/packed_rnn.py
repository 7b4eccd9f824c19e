"""Individual gradients of an RNN over a ``PackedSequence``.

A packed batch holds its sequences sorted by length (``sorted_indices``), time step by time
step: the rows of time step ``t`` are the sorted positions ``0 .. batch_sizes[t] - 1``. Each
sample's sequence is run on its own, at its own length and without padding (so its final hidden
state is the one the packed run computed), and dotted with its rows of the output gradient and
its column of the final states' gradients: a loop over samples with ordinary autograd, like the
fallback for any RNN.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils.rnn import PackedSequence

from ..._torch_compat import register_packed_sequence_pytree, tree_flatten
from .fallback import loop_over_samples

register_packed_sequence_pytree()


def sample_count(packed: PackedSequence) -> int:
    """Sequences in a packed batch."""
    return int(packed.batch_sizes[0]) if packed.batch_sizes.numel() else 0


def sorted_order(packed: PackedSequence) -> tuple[int, ...]:
    """Which sample each sorted position holds (``sorted_indices``; in order if None)."""
    if packed.sorted_indices is None:
        return tuple(range(sample_count(packed)))
    return tuple(packed.sorted_indices.tolist())


def _rows(packed: PackedSequence) -> list[list[int]]:
    """For each sample (original order), its rows of the packed data, one per time step."""
    sizes = packed.batch_sizes.tolist()
    starts = [0]
    for size in sizes[:-1]:
        starts.append(starts[-1] + size)
    rows: list[list[int]] = [[] for _ in range(sample_count(packed))]
    for position, sample in enumerate(sorted_order(packed)):
        rows[sample] = [
            start + position for start, size in zip(starts, sizes, strict=True) if size > position
        ]
    return rows


def packed_rnn_batch_grads(
    module: nn.RNNBase,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grads_out: list[Tensor | None],
    names: frozenset[str],
) -> dict[str, Tensor]:
    """Individual gradients ``{name: [N, *p.shape]}`` of an RNN called on a PackedSequence.

    Args:
        module: the RNN, called as ``module(packed, hx=None)``.
        args, kwargs: the captured call; ``hx`` (``[layers * directions, N, H]``, a pair for
            LSTM) in the samples' own order, as the module takes it.
        grads_out: gradients of the leaves of the flattened output ``(PackedSequence(data
            [T_total, H_out], ...), h_n[, c_n])``, None where one got none.
        names: parameter names (as in ``module.named_parameters()``) to differentiate.
    """
    packed: PackedSequence = args[0]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    hidden = [] if hx is None else [hx] if isinstance(hx, Tensor) else list(hx)
    n_states = 2 if isinstance(module, nn.LSTM) else 1
    g_data, g_states = grads_out[0], grads_out[-n_states:]
    if not torch.is_grad_enabled():  # (create_graph: kept, so the results stay differentiable)
        data, hidden = packed.data.detach(), [h.detach() for h in hidden]
    else:
        data = packed.data
    rows = _rows(packed)
    batch_dim = 0 if module.batch_first else 1

    def sample(p: dict[str, Tensor], i: int) -> tuple[list[Tensor], list[Tensor]]:
        index = torch.tensor(rows[i], device=data.device)
        x = data.index_select(0, index).unsqueeze(batch_dim)  # [1, T_i, D] or [T_i, 1, D]
        h0 = [h[:, i : i + 1] for h in hidden]
        h_arg = None if not h0 else h0[0] if n_states == 1 else tuple(h0)
        out = tree_flatten(functional_call(module, p, (x, h_arg)))[0]
        outs, gs = [], []
        if g_data is not None:
            outs.append(out[0].squeeze(batch_dim))
            gs.append(g_data.index_select(0, index))
        for state, g in zip(out[-n_states:], g_states, strict=True):
            if g is not None:
                outs.append(state[:, 0])
                gs.append(g[:, i])
        return outs, gs

    params = {k: p for k, p in module.named_parameters() if k in names}
    return loop_over_samples(params, sample_count(packed), sample)
