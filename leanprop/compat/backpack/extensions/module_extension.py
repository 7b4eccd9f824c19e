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
inputs with the batch first), ``module.output`` (what that call returned: its first element
for a tuple, as BackPACK's; kept detached from the forward, with grad enabled, by a
process-wide forward hook installed with the first extension, for the module's 16 most recent
calls whose inputs live; a second call on the same input tensor replaces the first's) and
``g_out = (output gradient,)``; ``g_inp`` and
``bpQuantities`` are None (nothing is backpropagated but the ordinary gradient). They are called
for all samples: ``ext.get_subsampling()`` is None there, and a ``subsampling=`` of the
extension in use is applied to what they return.

Extensions of the other quantities (``DiagGGNExact().set_module_extension(...)`` with a
``backpropagate`` method, ...) are accepted, and not called: leanprop derives every quantity
from the module's individual gradients (its ``BatchGrad`` extension, else its ops as the
engine captures them, else the torch.func fallback) and backpropagates through the module with
autograd, exactly; a warning says so.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook

from ....errors import LeanpropValueError
from ....per_sample.registry import RuleOptions, has_rule, register_rule

# module class -> the extension set_module_extension registered for it (the last)
_REGISTERED: dict[type[nn.Module], ModuleExtension] = {}
_KEEPS_OUTPUT: list[object] = []  # the global forward hook keeping the outputs, once set
# module -> its calls' (input, output) while their inputs live (module.output for each call)
_CALLS: weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref, Any]]] = (
    weakref.WeakKeyDictionary()
)
_KEPT_CALLS = 16  # the most recent calls of each module whose outputs are kept


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
    all_samples = copy.copy(ext)  # (subsampled after the call)
    object.__setattr__(all_samples, "subsampling", None)

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
        output = _output_of(module, inputs[0] if inputs else None)
        if output is not None:
            module.output = output
        try:
            return {
                k: getattr(extension, k)(all_samples, module, None, (g,), None)
                for k in sorted(wanted)
            }
        except AttributeError as e:
            if output is None and "output" in str(e):
                raise LeanpropValueError(
                    f"{type(extension).__name__} read {module_type.__name__}.output, which "
                    "leanprop keeps for the module's 16 latest calls whose input it gets "
                    "unchanged: this call's input was moved (batch_dim != 0), cast "
                    "(autocast) or cut into chunks of samples (max_workspace_mib) for the "
                    "rule, the call ran without grad, or more calls came after it. Compute "
                    "what you need from module.input0 and g_out instead."
                ) from e
            raise
        finally:
            for i in range(len(inputs)):
                delattr(module, f"input{i}")
            if output is not None:
                del module.output

    register_rule(module_type)(batch_grads)
    _REGISTERED[module_type] = extension
    if not _KEEPS_OUTPUT:
        _KEEPS_OUTPUT.append(register_module_forward_hook(_keep_output))


def _keep_output(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
    """The output of a call of a module with a registered extension, with grad enabled (as
    BackPACK keeps it; the first element of a tuple), kept beside the call's input while
    that input lives (a later call on the same input replaces it)."""
    if type(module) not in _REGISTERED or not torch.is_grad_enabled():
        return
    x = inputs[0] if inputs else None
    if not isinstance(x, Tensor):
        return
    kept = []
    for ref, out in _CALLS.get(module, ()):
        held = ref()
        if held is not None and held is not x:  # (by identity: == compares values)
            kept.append((ref, out))
    out = output[0] if isinstance(output, tuple) else output
    # (detached: a graph kept here would keep the model alive, its key)
    kept.append((weakref.ref(x), out.detach() if isinstance(out, Tensor) else out))
    _CALLS[module] = kept[-_KEPT_CALLS:]


def _output_of(module: nn.Module, x: Any) -> Any:
    """What the call of ``module`` on ``x`` (the very tensor) returned, or None."""
    for ref, out in _CALLS.get(module, ()):
        if ref() is x:
            return out
    return None


def accept_other_extension(ext: Any, module_type: type[nn.Module], extension: Any) -> None:
    """``set_module_extension`` of an extension other than ``BatchGrad``: checked, then
    accepted with a warning that its functions are not called (see the module docstring)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise LeanpropValueError(
            f"{type(ext).__name__}().set_module_extension({module_type!r}, ...): pass the "
            "module class."
        )
    if not isinstance(extension, ModuleExtension):
        raise LeanpropValueError(
            f"{type(ext).__name__}().set_module_extension({module_type.__name__}, "
            f"{extension!r}): pass an instance of a ModuleExtension subclass."
        )
    how = (
        "its BatchGrad extension" if module_type in _REGISTERED
        else "its built-in rule" if has_rule(module_type)
        else "its ops as leanprop captures them, or the torch.func fallback"
    )  # fmt: skip
    warnings.warn(
        f"{type(ext).__name__}().set_module_extension({module_type.__name__}, "
        f"{type(extension).__name__}()): leanprop does not call this extension's functions; it "
        f"derives {type(ext).__name__} for {module_type.__name__} from the module's individual "
        f"gradients ({how}) and backpropagates through it with autograd, exactly. To give "
        "leanprop a custom module's closed form, set a BatchGrad extension.",
        UserWarning,
        stacklevel=3,
    )
