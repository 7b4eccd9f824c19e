"""Opacus' data-parallel wrapper, for the facade: ``DifferentiallyPrivateDistributedDataParallel``
(``DPDDP``) under the path Opacus has it, with only the package name changed.

As Opacus', it only makes the ranks' replicas equal (rank 0's parameters, broadcast) and calls
the model: there is no gradient hook, since each rank's gradients must be clipped per sample
before they are added. :meth:`PrivacyEngine.make_private` recognises it (and Opacus' own) and
makes the optimizer add the ranks' clipped sums and rank 0's noise once per step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import LeanpropValueError


class DifferentiallyPrivateDistributedDataParallel(nn.Module):
    """Rank 0's parameters on every rank; ``forward`` calls the wrapped model.

    Args:
        model: the model, the same architecture on every rank.

    Raises:
        LeanpropValueError: no initialized process group.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise LeanpropValueError(
                "DifferentiallyPrivateDistributedDataParallel needs an initialized process "
                "group (torch.distributed.init_process_group) on every rank."
            )
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=0)
        self.module = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


DPDDP = DifferentiallyPrivateDistributedDataParallel


def is_dpddp(module: nn.Module) -> bool:
    """Whether ``module`` is this wrapper or Opacus' own (the same thing)."""
    return type(module).__name__ == "DifferentiallyPrivateDistributedDataParallel" and isinstance(
        getattr(module, "module", None), nn.Module
    )
