"""A BackPACK-style facade: run BackPACK code on leanprop with an import change.

    from leanprop.compat.backpack import backpack, extend, extensions
    from leanprop.compat.backpack import weight_jac_t_save_memory

    model, lossfunc = extend(model), extend(lossfunc)
    loss = lossfunc(model(X), y)
    with backpack(extensions.BatchGrad(), extensions.Variance()):
        loss.backward()
    model[0].weight.grad_batch, model[0].weight.variance

Differences from BackPACK, all in the user's favour: any module graph works (a module called
twice gets the summed individual gradients BackPACK gets wrong; modules without a rule go
through leanprop's torch.func fallback), ``Variance`` is computed from centred values, and a
model that mixes samples (BatchNorm in training mode) raises instead of returning numbers.

``extend`` installs hooks that stay until :func:`unextend` or until the model is garbage
collected (as in BackPACK, whose ``extend`` has no undo); the forward pass records what the
layers need, and backward computes the quantities only inside a ``backpack(...)`` block.
Prefer :func:`leanprop.per_sample` in new code: it is scoped, removes its hooks on exit, and is
faster (it also swaps the Linear/Conv ops so autograd does not compute their parameter
gradients twice, which a permanent facade cannot do).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ...per_sample.capture import PerSample
from ...per_sample.quantities import BatchGrad, Quantity, validate_quantities
from . import extensions

__all__ = ["backpack", "extend", "extensions", "unextend", "weight_jac_t_save_memory"]

# captures live as long as their model (only the model's hooks reference them)
_EXTENDED: weakref.WeakSet[PerSample] = weakref.WeakSet()
_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # capture -> its hook
_SAVE_MEMORY: list[bool | None] = [None]  # innermost weight_jac_t_save_memory setting


def _covered(module: nn.Module) -> bool:
    return any(any(s is module for s in c.model.modules()) for c in list(_EXTENDED))


class _Holder:
    """A no-op forward pre-hook through which an extended model owns its capture (the capture
    holds the model weakly and its hooks hold the capture weakly: no reference cycle, so a
    model dropped every iteration, as in BackPACK's usage, is freed at once)."""

    def __init__(self, capture: PerSample) -> None:
        self.capture = capture

    def __call__(self, module: nn.Module, args: tuple) -> None:
        return None

    def __deepcopy__(self, memo: dict) -> _Holder:
        return self  # a deep copy of the model shares it (not a copy of the capture)


def extend(module: nn.Module, debug: bool = False, use_converter: bool = False) -> nn.Module:
    """Prepare ``module`` (and its sub-modules) for ``backpack(...)``; returns it unchanged.

    Modules without trainable parameters (loss functions) need nothing and are returned as is.
    ``debug`` and ``use_converter`` are accepted for compatibility; leanprop needs no graph
    conversion.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"extend() takes an nn.Module, got {type(module).__name__}.")
    if not any(p.requires_grad for p in module.parameters()) or _covered(module):
        return module
    # no op swap: a TorchFunctionMode cannot stay on torch's mode stack for the model's life
    capture = PerSample(module, BatchGrad(), fuse=False)
    capture.set_quantities(frozenset(), "auto")
    capture.__enter__()
    _HOLDERS[capture] = module.register_forward_pre_hook(_Holder(capture))
    capture.owned_by_model()
    _EXTENDED.add(capture)
    return module


def unextend(module: nn.Module) -> nn.Module:
    """Remove what :func:`extend` installed on ``module``."""
    for capture in [c for c in list(_EXTENDED) if c.model is module]:
        _EXTENDED.discard(capture)
        _HOLDERS.pop(capture).remove()
        capture.__exit__(None, None, None)
    return module


def _algorithm() -> str:
    return {True: "grouped", False: "unfold", None: "auto"}[_SAVE_MEMORY[-1]]


@contextmanager
def backpack(*exts: Quantity, extension_hook: object = None, debug: bool = False) -> Iterator[None]:
    """Compute ``exts`` during the backward passes run inside the block, for every extended
    model (results on the parameters, as BackPACK's)."""
    if extension_hook is not None:
        raise NotImplementedError(
            "backpack(extension_hook=...) is not supported by leanprop's facade; compute what "
            "the hook needs from the parameters' attributes after backward instead."
        )
    kinds = validate_quantities(exts)
    captures = list(_EXTENDED)
    before = [(c.kinds, c.conv_algorithm) for c in captures]
    for c in captures:
        c.set_quantities(kinds, _algorithm())
    try:
        yield
    finally:
        for c, (k, algo) in zip(captures, before, strict=True):
            c.set_quantities(k, algo)


@contextmanager
def weight_jac_t_save_memory(save_memory: bool = True) -> Iterator[None]:
    """BackPACK's switch for the convolution weight algorithm: ``save_memory=True`` selects
    leanprop's ``"grouped"`` algorithm (Rochette et al. 2019), ``False`` the im2col one."""
    _SAVE_MEMORY.append(bool(save_memory))
    try:
        yield
    finally:
        _SAVE_MEMORY.pop()
