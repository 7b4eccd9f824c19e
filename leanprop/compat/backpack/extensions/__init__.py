"""BackPACK's extensions, as leanprop quantities (same names, same attributes:
``grad_batch``, ``batch_l2``, ``batch_dot``, ``sum_grad_squared``, ``variance``, and the
curvature ones ``diag_ggn_exact``, ``diag_ggn_mc``, ``diag_ggn_exact_batch``,
``diag_ggn_mc_batch``, ``sqrt_ggn_exact``, ``sqrt_ggn_mc``, ``ggnmp``, ``kflr``, ``kfac``, ``kfra``,
``diag_h``, ``diag_h_batch``, ``hmp``, ``pchmp``).

``BatchGrad().set_module_extension(MyModule, MyModuleBatchGrad())`` adds a custom module for
every quantity (see ``module_extension.py``); the other extensions accept theirs with a warning
that leanprop does not call them. ``ext.get_subsampling()`` is BackPACK's.
"""

from torch import nn

from ....per_sample import quantities as _first
from ....per_sample.curvature import quantities as _curvature
from .module_extension import ModuleExtension, accept_other_extension, register_module_extension


class _Extension:
    """What BackPACK's extensions have beyond leanprop's quantities."""

    def get_subsampling(self) -> list[int] | None:
        """The sample indices the extension keeps (None: all)."""
        kept = getattr(self, "subsampling", None)
        return None if kept is None else list(kept)

    def set_module_extension(
        self, module: type[nn.Module], extension: ModuleExtension, overwrite: bool = False
    ) -> None:
        """Accepted, not called: see ``module_extension.accept_other_extension``."""
        accept_other_extension(self, module, extension)


class BatchGrad(_Extension, _first.BatchGrad):
    """BackPACK's ``BatchGrad``; ``set_module_extension`` adds a custom module."""

    def set_module_extension(
        self, module: type[nn.Module], extension: ModuleExtension, overwrite: bool = False
    ) -> None:
        register_module_extension(self, module, extension, overwrite)


class BatchL2Grad(_Extension, _first.BatchL2Grad): ...


class BatchDotGrad(_Extension, _first.BatchDotGrad): ...


class SumGradSquared(_Extension, _first.SumGradSquared): ...


class Variance(_Extension, _first.Variance): ...


class DiagGGNExact(_Extension, _curvature.DiagGGNExact): ...


class DiagGGNMC(_Extension, _curvature.DiagGGNMC): ...


class BatchDiagGGNExact(_Extension, _curvature.BatchDiagGGNExact): ...


class BatchDiagGGNMC(_Extension, _curvature.BatchDiagGGNMC): ...


class SqrtGGNExact(_Extension, _curvature.SqrtGGNExact): ...


class SqrtGGNMC(_Extension, _curvature.SqrtGGNMC): ...


# the products as BackPACK's signatures take them (savefield first, positional too)
class GGNMP(_Extension, _curvature.GGNMP):
    def __init__(self, savefield: str = "ggnmp") -> None:
        super().__init__(savefield=savefield)


class HMP(_Extension, _curvature.HMP):
    def __init__(self, savefield: str = "hmp") -> None:
        super().__init__(savefield=savefield)


class PCHMP(_Extension, _curvature.PCHMP):
    def __init__(self, savefield: str = "pchmp", modify: str = "clip") -> None:
        super().__init__(modify=modify, savefield=savefield)


class KFLR(_Extension, _curvature.KFLR): ...


class KFRA(_Extension, _curvature.KFRA): ...


class KFAC(_Extension, _curvature.KFAC): ...


class DiagHessian(_Extension, _curvature.DiagHessian): ...


class BatchDiagHessian(_Extension, _curvature.BatchDiagHessian): ...


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
    "SqrtGGNExact",
    "SqrtGGNMC",
    "SumGradSquared",
    "Variance",
]
