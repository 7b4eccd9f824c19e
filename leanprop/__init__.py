"""leanprop: get more out of each PyTorch backward pass, with less memory."""

from ._registry import register_rule
from .errors import (
    BatchError,
    LeanpropError,
    LeanpropValueError,
    UnsupportedModelError,
)
from .per_sample import per_sample
from .quantities import BatchGrad, BatchL2Grad, Quantity, SumGradSquared, Variance

__version__ = "0.1.0"

__all__ = [
    # per-sample quantities
    "BatchGrad",
    "BatchL2Grad",
    "Quantity",
    "SumGradSquared",
    "Variance",
    "per_sample",
    "register_rule",
    # errors
    "BatchError",
    "LeanpropError",
    "LeanpropValueError",
    "UnsupportedModelError",
]
