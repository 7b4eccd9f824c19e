"""BackPACK's extensions, as leanprop quantities (same names, same attributes:
``grad_batch``, ``batch_l2``, ``batch_dot``, ``sum_grad_squared``, ``variance``, and the
curvature ones ``diag_ggn_exact``, ``diag_ggn_mc``, ``diag_ggn_exact_batch``,
``diag_ggn_mc_batch``, ``sqrt_ggn_exact``, ``sqrt_ggn_mc``, ``ggnmp``, ``kflr``, ``kfac``, ``kfra``,
``diag_h``, ``diag_h_batch``, ``hmp``, ``pchmp``).

``BatchGrad().set_module_extension(MyModule, MyModuleBatchGrad())`` adds a custom module for
every quantity (see ``module_extension.py``); the other extensions say so.
"""

from torch import nn

from ....errors import LeanpropValueError
from ....per_sample import quantities as _first
from ....per_sample.curvature import quantities as _curvature
from .module_extension import ModuleExtension, register_module_extension


class _OnlyBatchGradExtends:
    def set_module_extension(
        self, module: type[nn.Module], extension: ModuleExtension, overwrite: bool = False
    ) -> None:
        raise LeanpropValueError(
            f"{type(self).__name__}().set_module_extension(...): leanprop computes every "
            "quantity from a module's individual gradients; set the module's extension on "
            "BatchGrad() (its functions return [N, *p.shape]) and all quantities use it."
        )


class BatchGrad(_first.BatchGrad):
    """BackPACK's ``BatchGrad``; ``set_module_extension`` adds a custom module."""

    def set_module_extension(
        self, module: type[nn.Module], extension: ModuleExtension, overwrite: bool = False
    ) -> None:
        register_module_extension(self, module, extension, overwrite)


class BatchL2Grad(_OnlyBatchGradExtends, _first.BatchL2Grad): ...


class BatchDotGrad(_OnlyBatchGradExtends, _first.BatchDotGrad): ...


class SumGradSquared(_OnlyBatchGradExtends, _first.SumGradSquared): ...


class Variance(_OnlyBatchGradExtends, _first.Variance): ...


class DiagGGNExact(_OnlyBatchGradExtends, _curvature.DiagGGNExact): ...


class DiagGGNMC(_OnlyBatchGradExtends, _curvature.DiagGGNMC): ...


class BatchDiagGGNExact(_OnlyBatchGradExtends, _curvature.BatchDiagGGNExact): ...


class BatchDiagGGNMC(_OnlyBatchGradExtends, _curvature.BatchDiagGGNMC): ...


class SqrtGGNExact(_OnlyBatchGradExtends, _curvature.SqrtGGNExact): ...


class SqrtGGNMC(_OnlyBatchGradExtends, _curvature.SqrtGGNMC): ...


# the products as BackPACK's signatures take them (savefield first, positional too)
class GGNMP(_OnlyBatchGradExtends, _curvature.GGNMP):
    def __init__(self, savefield: str = "ggnmp") -> None:
        super().__init__(savefield=savefield)


class HMP(_OnlyBatchGradExtends, _curvature.HMP):
    def __init__(self, savefield: str = "hmp") -> None:
        super().__init__(savefield=savefield)


class PCHMP(_OnlyBatchGradExtends, _curvature.PCHMP):
    def __init__(self, savefield: str = "pchmp", modify: str = "clip") -> None:
        super().__init__(modify=modify, savefield=savefield)


class KFLR(_OnlyBatchGradExtends, _curvature.KFLR): ...


class KFRA(_OnlyBatchGradExtends, _curvature.KFRA): ...


class KFAC(_OnlyBatchGradExtends, _curvature.KFAC): ...


class DiagHessian(_OnlyBatchGradExtends, _curvature.DiagHessian): ...


class BatchDiagHessian(_OnlyBatchGradExtends, _curvature.BatchDiagHessian): ...


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
