"""BackPACK's ``custom_module`` building blocks, as plain modules (same names and module
paths). BackPACK needs them to express branches, sums and tensor reshuffles as modules it has
extensions for; leanprop follows any module graph (and ``torch.fx``-free code), so here they
are ordinary modules kept for code written against BackPACK.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F

from ....errors import LeanpropValueError


class ActiveIdentity(nn.Module):
    """The identity (BackPACK's variant that its graph conversion does not remove)."""

    def forward(self, input: Tensor) -> Tensor:
        return input


class SumModule(nn.Module):
    """The sum of its inputs, all of one shape."""

    def forward(self, *inputs: Tensor) -> Tensor:
        if not inputs:
            raise LeanpropValueError("SumModule() needs at least one input tensor.")
        if len({tuple(t.shape) for t in inputs}) > 1:
            raise LeanpropValueError(
                f"SumModule(): inputs of different shapes {[tuple(t.shape) for t in inputs]}; "
                "it adds tensors of one shape."
            )
        total = inputs[0]
        for t in inputs[1:]:
            total = total + t
        return total


class _Branch(nn.Module):
    def __init__(self, *modules: nn.Module | OrderedDict[str, nn.Module]) -> None:
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            for name, m in modules[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(modules):
                self.add_module(str(i), m)

    def forward(self, input: Tensor) -> tuple[Any, ...]:
        return tuple(m(input) for m in self.children())


class Parallel(nn.Module):
    """Branches applied to one input, merged (by default summed): ``merge(*[m(x) for m in
    branches])``."""

    def __init__(
        self,
        *modules: nn.Module | OrderedDict[str, nn.Module],
        merge_module: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.branch = _Branch(*modules)
        self.merge = SumModule() if merge_module is None else merge_module

    def forward(self, input: Tensor) -> Tensor:
        return self.merge(*self.branch(input))


class Pad(nn.Module):
    """``F.pad(input, pad, mode, value)`` as a module."""

    def __init__(self, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> None:
        super().__init__()
        self.pad, self.mode, self.value = tuple(pad), mode, value

    def forward(self, input: Tensor) -> Tensor:
        return F.pad(input, self.pad, mode=self.mode, value=self.value)


class Permute(nn.Module):
    """``input.permute(*dims)``, or ``input.transpose(*dims)`` with ``init_transpose=True``
    (two dimensions)."""

    def __init__(self, *dims: int, init_transpose: bool = False) -> None:
        super().__init__()
        if init_transpose and len(dims) != 2:
            raise LeanpropValueError(
                f"Permute(*dims, init_transpose=True) swaps two dimensions, got dims={dims}."
            )
        self.dims, self.init_transpose = dims, init_transpose

    def forward(self, input: Tensor) -> Tensor:
        if self.init_transpose:
            return input.transpose(*self.dims)
        return input.permute(*self.dims)


class ReduceTuple(nn.Module):
    """Element ``index`` of a tuple input (e.g. an RNN's output without its state)."""

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        self.index = index

    def forward(self, input: tuple[Any, ...]) -> Any:
        return input[self.index]


class ScaleModule(nn.Module):
    """``input * weight`` for a constant float ``weight``."""

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        if not isinstance(weight, float):
            raise LeanpropValueError(f"ScaleModule(weight={weight!r}): the weight must be a float.")
        self.weight = weight

    def forward(self, input: Tensor) -> Tensor:
        return input * self.weight


class Slicing(nn.Module):
    """``input[slice_info]``."""

    def __init__(self, slice_info: tuple[slice | int, ...]) -> None:
        super().__init__()
        self.slice_info = slice_info

    def forward(self, input: Tensor) -> Tensor:
        return input[self.slice_info]


__all__ = [
    "ActiveIdentity", "Pad", "Parallel", "Permute", "ReduceTuple", "ScaleModule", "Slicing",
    "SumModule",
]  # fmt: skip
