"""Where the batch is in a call of a fallback root: a module hooked as a whole and
differentiated per sample by torch.func (``rules/fallback.py``), or an RNN over a packed
sequence (``rules/packed_rnn.py``).

For each input and output leaf of the call: the dimension that holds the samples, as the
batch tracker followed it into the call (an RNN's batch-free initial state holds them in its
dimension 1 by the RNN's contract); where tracking is off (the BackPACK facade), the module's
documented layout. Calls the samples cannot be told in are refused with what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .._torch_compat import tree_flatten
from ..errors import BatchError, UnsupportedModelError
from .batch import BatchDim, BatchTracker, Lost, packed_data
from .rules.fallback import batch_dim_of
from .rules.packed_rnn import sample_count, sorted_order

if TYPE_CHECKING:
    from .capture import Site


def _refuse_rnn_dropout(site: Site) -> None:
    """An RNN's dropout between its layers draws its masks inside one op, where no rerun can
    replay them: refuse rather than compute with other masks."""
    for name, m in site.module.named_modules():
        if isinstance(m, nn.RNNBase) and m.training and m.dropout > 0 and m.num_layers > 1:
            where = f"'{site.name}.{name}'" if name else f"'{site.name}'"
            raise UnsupportedModelError(
                f"per_sample: {type(m).__name__} {where} is in training mode with "
                f"dropout={m.dropout} between its {m.num_layers} layers. That dropout draws "
                "its masks inside one fused op that leanprop cannot replay per sample. Use "
                "single-layer RNNs with nn.Dropout between them, or dropout=0, or eval mode."
            )


def call_dims(
    site: Site, args: tuple[Any, ...], kwargs: dict[str, Any], out_leaves: list[Any],
    tracker: BatchTracker, tracking: bool, name_of: Callable[[nn.Parameter], str],
) -> tuple[int | None, list[int | None] | None, list[int | None] | None]:  # fmt: skip
    """Where the batch is in a call of a fallback root.

    Args:
        site: the fallback root.
        args, kwargs: the call's inputs.
        out_leaves: its outputs, flattened.
        tracker: the batch tracker of this forward.
        tracking: whether batch tracking is on (off: the module's documented layout).
        name_of: a parameter's name, for errors.

    Returns:
        ``(n, in_dims, out_dims)``: the samples in the call (None: it takes no batch), and the
        dimension of the batch in each input and output leaf (None for a leaf without one;
        both None: the documented layout, tracking off).

    Raises:
        BatchError, UnsupportedModelError: a call whose samples cannot be told apart.
    """
    _refuse_rnn_dropout(site)
    if args and isinstance(args[0], PackedSequence):
        return _packed_samples(site, args[0], args, kwargs, tracker, tracking, name_of), None, None
    if any(isinstance(a, PackedSequence) for a in (*args, *kwargs.values())):
        raise UnsupportedModelError(
            f"per_sample: {type(site.module).__name__} '{site.name}' got a PackedSequence "
            "other than as its first argument. Only an RNN's input may be packed; freeze "
            "this module's parameters, or register a rule for it."
        )
    leaves = tree_flatten((args, kwargs))[0]
    if not tracking:
        bd = batch_dim_of(site.module)
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        if not tensors or tensors[0].dim() <= bd:
            shapes = [tuple(t.shape) for t in tensors]
            raise BatchError(
                f"per_sample: {type(site.module).__name__} '{site.name}' got inputs of "
                f"shapes {shapes}; expected a batch dimension at dim {bd}."
            )
        n = tensors[0].shape[bd]
        if not isinstance(site.module, nn.RNNBase):
            return n, None, None
        # an RNN's state (hx in, h_n out) holds the batch in dimension 1, whatever its
        # batch_first: sliced by the documented layout, it would be cut along the layers
        in_dims = [bd if t is tensors[0] else None for t in leaves]
        in_dims = _rnn_state_dims(site, args, kwargs, leaves, in_dims, tracker, name_of)
        out_dims = [bd if i == 0 else 1 for i, _ in enumerate(out_leaves)]
        return n, in_dims, out_dims

    def dim_of(t: Any, what: str) -> int | None:
        info = tracker.info(t)
        if info is None:
            return None
        if isinstance(info, Lost) or info.inner != 1:
            reason = info.reason if isinstance(info, Lost) else "samples flattened together"
            raise BatchError(
                f"per_sample: {type(site.module).__name__} '{site.name}' got {what} in "
                f"which leanprop cannot tell which dimension holds the samples: {reason}."
            )
        return info.dim

    in_dims = [dim_of(t, "an input") for t in leaves]
    if isinstance(site.module, nn.RNNBase):
        in_dims = _rnn_state_dims(site, args, kwargs, leaves, in_dims, tracker, name_of)
    # an output that mixed samples is refused in backward, if it gets a gradient
    out_dims = [
        info.dim if isinstance(info := tracker.info(t), BatchDim) and info.inner == 1
        else None
        for t in out_leaves
    ]  # fmt: skip
    sizes = {t.shape[d] for t, d in zip(leaves, in_dims, strict=True) if d is not None}
    if not sizes:
        return None, in_dims, out_dims
    return sizes.pop(), in_dims, out_dims


def _refuse_learned_state(
    site: Site, hx: Any, tracker: BatchTracker, name_of: Callable[[nn.Parameter], str]
) -> None:
    """An RNN's initial state computed from parameters (a learned ``h0`` expanded over the
    batch) would need its per-sample gradients through the RNN: not supported."""
    for h in tree_flatten(hx)[0]:
        if not (isinstance(h, Tensor) and h.requires_grad):
            continue  # (a detached one is a constant)
        learned = sorted(name_of(p) for p in tracker.derived_params(h))
        if learned:
            raise UnsupportedModelError(
                f"per_sample: {type(site.module).__name__} '{site.name}' got an initial "
                f"state hx computed from parameters ({', '.join(map(repr, learned))}: a "
                "learned initial state); per-sample gradients through an RNN's initial "
                "state are not supported. Freeze those parameters, or leave hx out."
            )


def _rnn_state_dims(
    site: Site, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any],
    in_dims: list[int | None], tracker: BatchTracker, name_of: Callable[[nn.Parameter], str],
) -> list[int | None]:  # fmt: skip
    """An RNN's batch-free initial state (e.g. zeros ``[layers, N, H]``) holds sample n in
    column n by the RNN's contract: its batch dimension is 1."""
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    _refuse_learned_state(site, hx, tracker, name_of)
    states = {id(h) for h in tree_flatten(hx)[0] if isinstance(h, Tensor) and h.dim() == 3}
    return [1 if d is None and id(t) in states else d for t, d in zip(leaves, in_dims, strict=True)]


def _packed_samples(
    site: Site, packed: PackedSequence, args: tuple[Any, ...], kwargs: dict[str, Any],
    tracker: BatchTracker, tracking: bool, name_of: Callable[[nn.Parameter], str],
) -> int:  # fmt: skip
    """Samples of an RNN's packed input; checks they are the batch, in the order tracked,
    and that its initial state ``hx`` holds them in their own order."""
    what = f"{type(site.module).__name__} '{site.name}'"
    if not isinstance(site.module, nn.RNNBase):
        raise UnsupportedModelError(
            f"per_sample: {what} got a PackedSequence; only torch's RNNs (nn.LSTM, nn.GRU, "
            "nn.RNN) take one. Freeze this module's parameters, or register a rule for it."
        )
    if not tracking:
        raise UnsupportedModelError(
            f"per_sample: {what} got a PackedSequence, but batch tracking is off here (the "
            "BackPACK facade), so leanprop cannot tell which sample each packed sequence "
            "is. Use leanprop.per_sample(model, ...) for RNNs over packed sequences."
        )
    info = tracker.info(packed.data)
    if info != packed_data(sorted_order(packed)):
        reason = (
            "it carries no batch" if info is None
            else info.reason if isinstance(info, Lost)
            else "its rows are not the packed samples of the batch"
        )  # fmt: skip
        raise BatchError(
            f"per_sample: {what} got a PackedSequence whose samples leanprop cannot match "
            f"to the batch's: {reason}. Pack the model's input with pack_padded_sequence "
            "or pack_sequence (inside or before the model), unchanged."
        )
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    _refuse_learned_state(site, hx, tracker, name_of)
    for h in tree_flatten(hx)[0]:
        info = tracker.info(h)
        if info is not None and info != BatchDim(1):
            reason = info.reason if isinstance(info, Lost) else f"its batch is at {info}"
            raise BatchError(
                f"per_sample: {what} got an initial state hx in which leanprop cannot "
                f"tell which sample each column is: {reason}. Pass hx as [layers, N, H] "
                "with the samples in the batch's order."
            )
    return sample_count(packed)
