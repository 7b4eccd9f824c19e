"""BackPACK's module path ``custom_module.graph_utils``: its ``torch.fx`` tracer.

BackPACK's converter (``extend(model, use_converter=True)``) rewrites a model's graph into its
custom modules; leanprop follows any graph and does not need it (``use_converter`` is accepted
and changes nothing). The tracer is kept for code that prints or inspects graphs with it.
"""

from __future__ import annotations

from torch import nn
from torch.fx import Tracer

from . import Permute, ReduceTuple, ScaleModule, SumModule, _Branch


class BackpackTracer(Tracer):
    """A ``torch.fx`` tracer that keeps the custom modules (``ScaleModule``, ``SumModule``,
    the branches, ``ReduceTuple``, ``Permute``) as leaves, as BackPACK's does."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (ScaleModule, SumModule, _Branch, ReduceTuple, Permute)):
            return True
        return super().is_leaf_module(m, module_qualified_name)


__all__ = ["BackpackTracer"]
