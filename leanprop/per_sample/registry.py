"""Registry of per-layer rules: plain functions computing individual gradients of a module's
own parameters from its captured inputs and output gradient.

A rule is registered for exact module types (a subclass that overrides ``forward`` must not
inherit a rule silently; it goes to the generic torch.func fallback instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .factors import Factors

# batch_grads(module, inputs, grad_out, names, options) -> {param name: [n, *p.shape]}
BatchGradsFn = Callable[[nn.Module, tuple[Any, ...], Tensor, frozenset[str], "RuleOptions"], dict]
# batch_l2(module, inputs, grad_out, names, options) -> {param name: [n]} or None if not cheaper
BatchL2Fn = Callable[..., "dict[str, Tensor] | None"]
# factors(module, inputs, grad_out, names) -> {param name: factors.Outer | factors.Lookup}
# (the individual gradients as factors, for the names where norms from them are cheaper)
FactorsFn = Callable[..., "dict[str, Factors]"]
# workspace(module, inputs, grad_out, options) -> bytes of scratch memory per sample
WorkspaceFn = Callable[..., int]
# the name under which batch_grads returns the input's gradient, where asked (see
# Rule.input_grad_too)
INPUT = "<input>"
# input_grad(module, x, grad_out) -> gradient w.r.t. the input (ordinary backward)
InputGradFn = Callable[[nn.Module, Tensor, Tensor], Tensor]
# param_grads(module, x, grad_out, names) -> {name: summed gradient} (ordinary backward)
ParamGradsFn = Callable[[nn.Module, Tensor, Tensor, frozenset[str]], "dict[str, Tensor]"]


@dataclass(frozen=True)
class RuleOptions:
    """Options forwarded to every rule.

    Attributes:
        conv_algorithm: ``"auto"``, ``"unfold"``, ``"grouped"`` or ``"weight_backward"``.
        workspace_bytes: scratch memory a rule may use for one chunk of samples.
        sums_wanted: ``batch_l2`` is asked for the norms and, after them, the summed gradient
            (which materialised individual gradients give for free); False under clipping,
            which forms a weighted sum instead, so closed-form norms pay off sooner.
    """

    conv_algorithm: str = "auto"
    workspace_bytes: int = 256 * 2**20
    sums_wanted: bool = True


@dataclass(frozen=True)
class Rule:
    """The functions that make up the rule of one layer family."""

    batch_grads: BatchGradsFn
    batch_l2: BatchL2Fn | None = None
    workspace: WorkspaceFn | None = None
    check_input: Callable[[nn.Module, tuple[Any, ...]], str | None] | None = None
    # both given: the layer's op is replaced during capture so that autograd does not compute
    # the parameter gradients a second time (they are the sums of the individual gradients)
    input_grad: InputGradFn | None = None
    param_grads: ParamGradsFn | None = None
    can_fuse: Callable[[nn.Module], bool] | None = None
    # batch_grads takes ``out={name: buffer or None}`` and may write its result there
    accepts_out: bool = False
    # the layer's op itself needs the batch in dimension 0 (channels in 1)
    batch_first: bool = False
    # the layer's op takes the module's input as is (its rule may run at the op, on the op's
    # input; else the module's forward is hooked)
    op_takes_module_input: Callable[[nn.Module], bool] | None = None
    # the individual gradients as factors: the norms of a weight used several times (tied)
    # are formed from them without materialising it (see factors.py)
    factors: FactorsFn | None = None
    # batch_grads may also return the input's gradient ``[n, ...]`` under ``INPUT`` where
    # ``INPUT`` is among the names (and autograd does not record): computed with the
    # individual gradients for little more; the replaced op's backward then takes it
    input_grad_too: bool = False

    def at_op_level(self, module: nn.Module) -> bool:
        """Whether the rule runs at the module's own op (else the module is hooked as a
        whole: its input and output gradient, whatever its forward does inside)."""
        return self.op_takes_module_input is not None and self.op_takes_module_input(module)


_RULES: dict[type[nn.Module], Rule] = {}


def register_rule(
    *module_types: type[nn.Module],
    batch_l2: BatchL2Fn | None = None,
    workspace: WorkspaceFn | None = None,
    check_input: Callable[[nn.Module, tuple[Any, ...]], str | None] | None = None,
    input_grad: InputGradFn | None = None,
    param_grads: ParamGradsFn | None = None,
    can_fuse: Callable[[nn.Module], bool] | None = None,
    accepts_out: bool = False,
    batch_first: bool = False,
    op_takes_module_input: Callable[[nn.Module], bool] | None = None,
    factors: FactorsFn | None = None,
    input_grad_too: bool = False,
) -> Callable[[BatchGradsFn], BatchGradsFn]:
    """Register ``batch_grads`` (the decorated function) as the rule of ``module_types``.

    Args:
        batch_l2: squared norms ``[N]`` by a closed form, for the names where it is cheaper.
        workspace: scratch bytes per sample of ``batch_grads`` (sets the chunk size).
        check_input: returns a description of what is wrong with the inputs, or None.
        input_grad, param_grads: the ordinary backward of the layer's op; with them the op is
            replaced during capture (``can_fuse(module)`` says for which modules).
        accepts_out: ``batch_grads`` takes ``out={name: buffer or None}``, contiguous
            ``[n_chunk, *p.shape]`` slices of the result to write into (saves a copy).
        batch_first: the layer's op needs the batch in dimension 0 (convolutions, GroupNorm);
            elsewhere the batch may be in any dimension (rules get it moved to the front).
        op_takes_module_input: whether the module calls its op (the first op using its
            ``weight``) on its input unchanged, so the rule may run at that op; default (None):
            no, the module is hooked as a whole (the rule gets the module's input and output
            gradient whatever its forward does inside: what a rule for your own module wants).
        factors: the individual gradients as :mod:`factors` (``Outer``/``Lookup``), where
            norms from them are cheaper; used for ``BatchL2Grad`` of a weight used several
            times.
        input_grad_too: ``batch_grads`` may return the input's gradient too, under
            ``INPUT``, when ``INPUT`` is among the names it gets (it may leave it out);
            where it comes, the replaced op's backward does not call ``input_grad``.
    """

    def decorate(fn: BatchGradsFn) -> BatchGradsFn:
        rule = Rule(
            fn, batch_l2, workspace, check_input, input_grad, param_grads, can_fuse, accepts_out,
            batch_first, op_takes_module_input, factors, input_grad_too,
        )  # fmt: skip
        for t in module_types:
            _RULES[t] = rule
        return fn

    return decorate


def _builtin_rules() -> None:
    """Register the built-in rules (on first use: they import this module)."""
    if not _BUILTIN:
        from . import rules  # noqa: F401

        _BUILTIN.append(True)


_BUILTIN: list[bool] = []  # (the built-in rules are registered)


def has_rule(module_type: type[nn.Module]) -> bool:
    """Whether a rule is registered for ``module_type`` (built-in or by the user)."""
    _builtin_rules()
    return module_type in _RULES


def rule_for(module: nn.Module) -> Rule | None:
    """The rule registered for ``type(module)`` exactly, or None."""
    if not _BUILTIN:
        _builtin_rules()
    return _RULES.get(type(module))


def element_bytes(t: Tensor) -> int:
    """Bytes of one element of ``t``'s floating dtype (indices count as float32)."""
    return t.element_size() if t.is_floating_point() else torch.finfo(torch.float32).bits // 8
