"""Private training (DP-SGD) on the per-sample engine: clipping in one backward pass
(:func:`clip_per_sample`), noise and averaging (:class:`DPOptimizer`), Poisson sampling
(:func:`poisson_loader`) and accounting through Opacus' accountants (``accounting.py``)."""

from .accounting import make_accountant, noise_multiplier_for
from .clip import clip_per_sample
from .optimizer import DPOptimizer, gaussian_noise
from .sampling import PoissonBatchSampler, poisson_loader

__all__ = [
    "DPOptimizer",
    "PoissonBatchSampler",
    "clip_per_sample",
    "gaussian_noise",
    "make_accountant",
    "noise_multiplier_for",
    "poisson_loader",
]
