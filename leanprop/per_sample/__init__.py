"""Per-sample quantities during the ordinary backward pass.

One backward, followed through this folder:

* ``api.py``: :func:`per_sample`, the public context manager (options, docs).
* ``capture.py``: :class:`PerSample`: plans which modules own which parameters, records each
  call during forward, and when an output gradient arrives during backward computes that call's
  individual gradients over chunks of samples; ends the cycle (write results, sum check) when the
  backward ends, or aborts it on an exception.
* ``batch.py``: which tensors carry the batch, and in which dimension (model inputs at
  ``batch_dim``, followed op by op).
* ``broadcast.py``: parameters whose output is broadcast over the batch (position embeddings,
  class tokens, learned scales): their per-sample contributions where they meet the batch.
* ``fused.py``: the op interception (one ``TorchFunctionMode``) that swaps Linear/Conv ops so
  autograd does not compute their parameter gradients twice, and feeds ``batch.py``.
* ``registry.py`` and ``rules/``: one plain-function rule per layer family, and the torch.func
  fallback for any other module.
* ``stats.py``: statistics over samples (cache-blocked, centred variance); ``quantities.py``:
  what can be requested; ``distributed.py``: :func:`all_reduce_quantities` over ranks.
"""

from .api import per_sample
from .capture import PerSample
from .distributed import all_reduce_quantities
from .quantities import BatchGrad, BatchL2Grad, Quantity, SumGradSquared, Variance
from .registry import register_rule

__all__ = [
    "BatchGrad",
    "BatchL2Grad",
    "PerSample",
    "Quantity",
    "SumGradSquared",
    "Variance",
    "all_reduce_quantities",
    "per_sample",
    "register_rule",
]
