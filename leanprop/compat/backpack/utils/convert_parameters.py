"""BackPACK's ``utils.convert_parameters``: a flat vector as views shaped like parameters."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from ....errors import LeanpropValueError


def vector_to_parameter_list(vec: Tensor, parameters: Iterable[Tensor]) -> list[Tensor]:
    """``vec`` ``[P]`` as views of the shapes of ``parameters`` (which are left unchanged),
    in their order: the inverse of ``torch.nn.utils.parameters_to_vector``.

    Raises:
        TypeError: ``vec`` is not a tensor.
        LeanpropValueError: ``vec`` holds another number of entries than the parameters.
    """
    if not isinstance(vec, Tensor):
        raise TypeError(f"vector_to_parameter_list: expected a Tensor, got {type(vec).__name__}")
    params = list(parameters)
    total = sum(p.numel() for p in params)
    if vec.dim() != 1 or vec.numel() != total:
        raise LeanpropValueError(
            f"vector_to_parameter_list: got a vector of shape {tuple(vec.shape)}; the "
            f"parameters hold {total} entries: pass a 1-d vector of that length "
            "(parameters_to_vector(parameters) has it)."
        )
    views, start = [], 0
    for p in params:
        views.append(vec[start : start + p.numel()].view_as(p))
        start += p.numel()
    return views
