"""Per-sample quantities during the ordinary backward pass.

One backward, followed through this folder:

* ``api.py``: :func:`per_sample`, the public context manager (options, docs).
* ``capture.py``: :class:`PerSample`: plans which modules own which parameters, follows each
  forward (through ``fused.py``'s op interception) and, as output gradients arrive during
  backward, has each call's quantities computed (``compute.py``: from closed forms, or the
  individual gradients over chunks of samples); ends the cycle (write results, sum check)
  when the backward ends, or aborts it on an exception.
* ``fused.py``: the op interception (one ``TorchFunctionMode``, also kept on during backward so
  checkpoints recompute through it); swaps Linear/Conv/LayerNorm/GroupNorm ops so autograd
  does not compute their parameter gradients twice.
* ``batch/``: which tensors carry the batch, and in which dimension (model inputs at
  ``batch_dim``, followed op by op: ``rules.py`` says where each op puts it, ``mixing.py``
  which ops mix the samples, ``tracker.py`` holds one forward's state).
* ``broadcast.py``: parameters whose output is broadcast over the batch (position embeddings,
  class tokens, learned scales): their per-sample contributions where they meet it.
* ``ops.py`` and ``op_rules.py``: any other op that uses a parameter (a layer rule's own op,
  a closed form for linear/matmul/addmm, or a batched vector-Jacobian product).
* ``registry.py`` and ``rules/``: one plain-function rule per layer family, and the torch.func
  fallback for modules hooked as a whole (RNNs); ``fallback_calls.py``: where the batch is in
  each of their calls.
* ``stats.py``: statistics over samples (cache-blocked, centred variance); ``quantities.py``:
  what can be requested; ``distributed.py``: :func:`all_reduce_quantities` over ranks.
* ``curvature/``: the generalized Gauss-Newton matrix (:func:`ggn`): one backward per column
  of the loss Hessian's factor through the same recorded forward; the Hessian's diagonal adds
  the curved activations' terms (``hessian.py``), backpropagated from their inputs.
"""

from .api import per_sample
from .capture import PerSample
from .curvature import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    ggn,
)
from .distributed import all_reduce_quantities
from .quantities import BatchDotGrad, BatchGrad, BatchL2Grad, Quantity, SumGradSquared, Variance
from .registry import register_rule

__all__ = [
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDiagHessian",
    "BatchDotGrad",
    "BatchGrad",
    "BatchL2Grad",
    "DiagGGNExact",
    "DiagGGNMC",
    "DiagHessian",
    "GGNMP",
    "HMP",
    "PCHMP",
    "KFAC",
    "KFLR",
    "KFRA",
    "PerSample",
    "Quantity",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "SumGradSquared",
    "Variance",
    "all_reduce_quantities",
    "ggn",
    "per_sample",
    "register_rule",
]
