"""BackPACK's module-extension API, mapped onto :func:`leanprop.register_rule`.

BackPACK needs one module extension per quantity and module; leanprop derives every
first-order and curvature quantity from a layer's individual gradients, so a custom module
needs one thing: the ``BatchGrad`` extension, whose functions return each sample's gradient
of a parameter ``[N, *p.shape]``::

    class ScaleModuleBatchGrad(FirstOrderModuleExtension):
        def __init__(self):
            super().__init__(params=["weight"])

        def weight(self, ext, module, g_inp, g_out, bpQuantities):
            return (g_out[0] * module.input0).flatten(start_dim=1).sum(1).unsqueeze(-1)

    extension = extensions.BatchGrad()
    extension.set_module_extension(ScaleModule, ScaleModuleBatchGrad())

That registers a rule for ``ScaleModule`` (for every context and extension, as
``register_rule`` does): its functions get ``module.input0`` (and ``input1``, ...: the module's
inputs with the batch first) and ``g_out = (output gradient,)``; ``g_inp`` and
``bpQuantities`` are None (nothing is backpropagated but the ordinary gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from ....errors import LeanpropValueError
from ....per_sample.registry import RuleOptions, has_rule, register_rule

# module class -> the extension set_module_extension registered for it (the last)
_REGISTERED: dict[type[nn.Module], ModuleExtension] = {}


class ModuleExtension:
    """A module's extension: one method per parameter name in ``params``, each
    ``(ext, module, g_inp, g_out, bpQuantities) -> [N, *p.shape]``."""

    def __init__(self, params: Sequence[str] | None = None) -> None:
        self.params = list(params or [])
        for name in self.params:
            if not callable(getattr(self, name, None)):
                raise LeanpropValueError(
                    f"{type(self).__name__}(params={self.params}) has no method {name!r}; define "
                    f"`def {name}(self, ext, module, g_inp, g_out, bpQuantities)` returning "
                    "the individual gradients [N, *p.shape]."
                )


def register_module_extension(
    ext: Any, module_type: type[nn.Module], extension: ModuleExtension, overwrite: bool = False
) -> None:
    """Register ``extension`` (a BatchGrad module extension) as ``module_type``'s rule."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise LeanpropValueError(
            f"set_module_extension({module_type!r}, ...): pass the module class."
        )
    same = type(_REGISTERED.get(module_type)) is type(extension)  # (set again: e.g. each step)
    if has_rule(module_type) and not overwrite and not same:
        raise LeanpropValueError(
            f"{module_type.__name__} already has a rule (built in, or set before); pass "
            "overwrite=True to replace it."
        )
    if not isinstance(extension, ModuleExtension):
        raise LeanpropValueError(
            f"set_module_extension({module_type.__name__}, {extension!r}): pass an instance of "
            "a FirstOrderModuleExtension subclass."
        )
    names = set(extension.params)

    def batch_grads(
        module: nn.Module, inputs: tuple[Any, ...], g: Tensor, wanted: frozenset[str],
        _: RuleOptions,
    ) -> dict[str, Tensor]:  # fmt: skip
        missing = sorted(wanted - names)
        if missing:
            raise LeanpropValueError(
                f"{type(extension).__name__} (the BatchGrad extension of "
                f"{module_type.__name__}) has no function for its parameter(s) {missing}; add "
                "them to params=[...] with a method each."
            )
        for i, x in enumerate(inputs):
            setattr(module, f"input{i}", x)
        try:
            return {k: getattr(extension, k)(ext, module, None, (g,), None) for k in sorted(wanted)}
        finally:
            for i in range(len(inputs)):
                delattr(module, f"input{i}")

    register_rule(module_type)(batch_grads)
    _REGISTERED[module_type] = extension
