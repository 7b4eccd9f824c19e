"""leanprop: get more out of each PyTorch backward pass, with less memory."""

from .errors import (
    BatchError,
    LeanpropError,
    LeanpropValueError,
    UnsupportedModelError,
)
from .measure import MismatchError, Timing, compare, time_fn, track_memory
from .optim import InBackward
from .per_sample import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    Quantity,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
    all_reduce_quantities,
    ggn,
    per_sample,
    register_rule,
)
from .privacy import DPOptimizer, clip_per_sample, poisson_loader
from .side_losses import chunked_linear_cross_entropy, scale_grad, side_loss, transform_grad

__version__ = "0.1.0"

__all__ = [
    # per-sample quantities
    "BatchDotGrad",
    "BatchGrad",
    "BatchL2Grad",
    "Quantity",
    "SumGradSquared",
    "Variance",
    "all_reduce_quantities",
    "per_sample",
    "register_rule",
    # curvature (generalized Gauss-Newton, Hessian diagonal)
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDiagHessian",
    "DiagGGNExact",
    "DiagGGNMC",
    "DiagHessian",
    "GGNMP",
    "HMP",
    "PCHMP",
    "KFAC",
    "KFLR",
    "KFRA",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "ggn",
    # private training (DP-SGD)
    "DPOptimizer",
    "clip_per_sample",
    "poisson_loader",
    # optimizer step in backward
    "InBackward",
    # eager side losses
    "chunked_linear_cross_entropy",
    "scale_grad",
    "side_loss",
    "transform_grad",
    # measurement
    "Timing",
    "compare",
    "time_fn",
    "track_memory",
    # errors
    "BatchError",
    "LeanpropError",
    "LeanpropValueError",
    "MismatchError",
    "UnsupportedModelError",
]
