"""Which tensors carry the batch, and in which dimension.

The model's input tensors carry the batch at ``batch_dim``. Every op run inside the model's
forward is seen by the op interception (``fused.py``), which calls :meth:`BatchTracker.propagate`
to say where the batch went in the op's outputs. So a rule knows which dimension of its input is
the batch, and a dimension of the same size (sequence length T == batch size N) is never taken
for it. Tensors derived from parameters only (position embeddings looked up with
``arange(T)``) carry no batch: they are *parameter-derived* and ``broadcast.py`` takes their
per-sample contributions where they meet the batch.

A batch dimension may hold the samples as the outer factor of a flattened dimension:
``x.view(-1, D)`` of ``[N, T, D]`` gives ``[N*T, D]`` with ``BatchDim(0, inner=T)``.

Where the batch goes cannot be told (an op this module does not know changed the shape), or
samples were mixed (a reduction or a slice over the batch), the tensor is :class:`Lost`; a rule
that meets such a tensor raises an error instead of guessing. Where a tensor's values mix the
samples (a softmax over the batch, ``o @ o.T``), the tracker says why, and a backward from it
is refused. So is one through an op whose effect on the samples it cannot tell (an op it does
not know that changes the shape, arguments it cannot read): such a result is taken to mix
them (``MAY_MIX``), since a function of it may combine the samples' values in any way.

The modules, in the order a newcomer reads them: ``infos.py`` (what is said of a tensor),
``rules.py`` (where each op puts the batch; with ``indexing.py``, ``matrices.py`` and
``order.py`` for indexing, matrices and reordered samples, ``unknown.py`` for ops with no
branch of their own), ``spread.py`` (picks of the
samples, and samples over several dimensions, followed exactly), ``mixing.py`` (which ops mix
the samples) and ``tracker.py`` (the state of one forward, updated op by op).
"""

from .infos import BatchDim, Lost, how_to_keep, packed_data, to_front
from .rules import batch_norm_training, in_place, op_name, tensors_in
from .tracker import BatchTracker, Lookup, ThroughCopies

__all__ = [
    "BatchDim",
    "BatchTracker",
    "Lookup",
    "Lost",
    "ThroughCopies",
    "batch_norm_training",
    "how_to_keep",
    "in_place",
    "op_name",
    "packed_data",
    "tensors_in",
    "to_front",
]
