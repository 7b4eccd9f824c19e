"""Replacing a layer's op during capture, so autograd does not compute its parameter gradients
twice.

An ordinary backward computes ``p.grad`` itself, and per-sample methods then compute the
individual gradients again (whose sum *is* ``p.grad``). While a :class:`PerSample` context is
active, a ``TorchFunctionMode`` swaps the op call made by a fusable rule module's own forward
(``F.linear`` in ``nn.Linear``, ``F.convNd`` in ``nn.ConvNd``, ``F.layer_norm`` and
``F.group_norm`` in ``nn.LayerNorm`` and ``nn.GroupNorm``) for :class:`FusedOp`, whose
backward computes the input gradient, hands the output gradient to the capture, and returns the
sums of the individual gradients as the parameter gradients. Nothing on the user's modules
changes; only calls made while the module runs its forward are swapped.

``backward`` is written with differentiable ops, so ``create_graph=True`` works through it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

from .._torch_compat import (
    checkpointed_saved_tensors,
    engine_backward,
    engine_grad,
    explained_checkpoint_errors,
    function_modes,
    not_a_view,
    saveable,
    saved_tensor_hooks_in_effect,
)
from .registry import INPUT

if TYPE_CHECKING:
    from .capture import PerSample
    from .cycle import Call


def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, shape: Any, eps: float) -> Tensor:
    return F.layer_norm(x, shape, weight, bias, eps)


def _group_norm(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int, eps: float) -> Tensor:
    return F.group_norm(x, groups, weight, bias, eps)


# the ops replaced, each called as ``op(x, weight, bias, *extra)``: linear and convolutions
# are so; the norms are called ``F.layer_norm(x, shape, weight=, bias=, eps=)``
FUSABLE_OPS = {F.linear: F.linear, F.conv1d: F.conv1d, F.conv2d: F.conv2d, F.conv3d: F.conv3d,
               F.layer_norm: _layer_norm, F.group_norm: _group_norm}  # fmt: skip
_NORMS = frozenset({F.layer_norm, F.group_norm})
_NORM_ARGS = ("input", "arg", "weight", "bias", "eps")


def _as_fused(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
    """``(x, weight, bias, *extra)`` of a fusable op's call as the modules make it, or None
    for other forms (left to torch)."""
    if func in _NORMS:
        bound = dict(zip(_NORM_ARGS, args, strict=False)) | kwargs
        if len(bound) != len(_NORM_ARGS) or not set(bound) <= set(_NORM_ARGS):
            return None
        return bound["input"], bound["weight"], bound["bias"], bound["arg"], bound["eps"]
    return args if len(args) >= 3 and not kwargs else None


# the parameter gradients a replaced op's backward is asked for, by (weight's, bias's) need
_WANT = {
    (w, b): frozenset(k for k, need in (("weight", w), ("bias", b)) if need)
    for w in (False, True) for b in (False, True)
}  # fmt: skip


class FusedOp(torch.autograd.Function):
    """``op(x, weight, bias, *extra)`` whose backward feeds the capture."""

    @staticmethod
    def forward(ctx: Any, capture: PerSample, call: Call, op: Any, x: Tensor, weight: Tensor,
                bias: Tensor | None, *extra: Any) -> Tensor:  # fmt: skip
        ctx.capture, ctx.call, ctx.module, ctx.n_extra = capture, call, call.site.module, len(extra)
        # (what it saves goes through hooks, a checkpoint's or offloading's: read by autograd
        # alone, in a backward, never directly: the curvature's columns, batched_columns.py)
        ctx.hooked = saved_tensor_hooks_in_effect() is not None
        # the weight is read from the module in backward, for the input's gradient: saving it
        # then too (no copy) has autograd refuse a weight changed in place since the forward,
        # as it does for the op replaced
        ctx.save_for_backward(saveable(x), saveable(weight) if x.requires_grad else None)
        return not_a_view(op(x, weight, bias, *extra))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, _ = checkpointed_saved_tensors(ctx)
        capture, module, rule = ctx.capture, ctx.module, ctx.call.site.rule
        needs = ctx.needs_input_grad
        want = _WANT[needs[4], needs[5]]
        if capture.layer_outputs_only:  # (a backward to layer outputs: the curvature's)
            want = _WANT[False, False]
        call = capture.fused_backward(ctx.call, x, g)
        with capture.own_work():  # the layer's backward ops are not the model's
            sums = {} if call is None else capture.compute_call(call)
            grad_x = sums.get(INPUT)  # (computed with the individual gradients, by some rules)
            missing = want - sums.keys()
            if missing:
                sums = {**sums, **rule.param_grads(module, x, g, missing)}
            if not needs[3]:
                grad_x = None
            elif grad_x is None:
                grad_x = rule.input_grad(module, x, g)
        weight = sums.get("weight") if "weight" in want else None
        bias = sums.get("bias") if "bias" in want else None
        return (None, None, None, grad_x, weight, bias) + (None,) * ctx.n_extra


_BACKWARD_ENTRIES = (torch.Tensor.backward, torch.autograd.backward)

# what a tensor's metadata is read by (no tensor comes out, no value is used): passed through
# without the capture's bookkeeping (each such call otherwise costs about 10 µs of Python,
# and models and the curvature passes make dozens per step)
_METADATA_METHODS = frozenset({
    Tensor.dim, Tensor.size, Tensor.numel, Tensor.nelement, Tensor.ndimension, Tensor.stride,
    Tensor.is_floating_point, Tensor.is_complex, Tensor.element_size, Tensor.is_contiguous,
    Tensor.get_device, Tensor.data_ptr,
})  # fmt: skip
_METADATA_ATTRIBUTES = frozenset(
    id(inspect.getattr_static(Tensor, name))
    for name in (
        "shape", "dtype", "device", "ndim", "requires_grad", "grad_fn", "is_leaf", "layout",
        "is_cuda", "is_sparse", "is_nested", "is_meta", "is_quantized", "output_nr",
        "_version", "itemsize", "nbytes",
    )
    if hasattr(Tensor, name)
)  # fmt: skip


# autograd's bookkeeping on a tensor, read and written (a parameter's .grad, by the clipping
# and accumulation hooks of leanprop and of optimizers, a few times per parameter and step):
# passed through too (each was followed as a use of the parameter, about 40 µs), but for a
# read of .grad where autograd records: what is computed from a create_graph gradient leads
# back to the parameter (a penalty on it is watched as the parameter's use)
_BOOKKEEPING_ATTRIBUTES = frozenset(
    id(inspect.getattr_static(Tensor, name))
    for name in ("grad", "_post_accumulate_grad_hooks", "_backward_hooks")
    if hasattr(Tensor, name)
)
_GRAD = id(inspect.getattr_static(Tensor, "grad"))


def _passed_through(func: Any) -> bool:
    """Whether ``func`` reads a tensor's metadata only (a method or an attribute getter), or
    reads or sets autograd's bookkeeping on it (``.grad``, read where autograd does not
    record)."""
    if func in _METADATA_METHODS:
        return True
    name = getattr(func, "__name__", None)
    if name not in ("__get__", "__set__"):
        return False
    attribute = id(getattr(func, "__self__", None))
    if name == "__get__" and attribute in _METADATA_ATTRIBUTES:
        return True
    if name == "__get__" and attribute == _GRAD and torch.is_grad_enabled():
        return False
    return attribute in _BOOKKEEPING_ATTRIBUTES


def _backward_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
    """``(tensors, grad_tensors, retain_graph, create_graph, inputs)`` of a plain backward
    call, or None for forms left to torch (gradient edges, dict inputs)."""
    names = ("gradient", "retain_graph", "create_graph", "inputs")
    if func is torch.autograd.backward:
        names = ("grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
    if not args or len(args) > len(names) + 1 or any(k not in names for k in kwargs):
        return None
    bound = dict(zip(names, args[1:], strict=False)) | kwargs
    if bound.get("grad_variables") is not None:
        return None
    tensors = args[0]
    tensors = (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)
    grads = bound.get("gradient", bound.get("grad_tensors"))
    grads = (grads,) if grads is None or isinstance(grads, Tensor) else tuple(grads)
    if len(grads) == 1 and len(tensors) > 1 and grads[0] is None:
        grads = (None,) * len(tensors)
    inputs = bound.get("inputs")
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, Tensor) else inputs
    if isinstance(inputs, dict) or (bound.get("inputs") is not None and not len(inputs)):
        return None  # torch's own handling (and its error for an empty `inputs`)
    if not all(isinstance(t, Tensor) for t in (*tensors, *inputs)) or len(grads) != len(tensors):
        return None
    return tensors, grads, bound.get("retain_graph"), bool(bound.get("create_graph")), tuple(inputs)


def _grad_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
    """The arguments of :func:`engine_grad` for a plain ``torch.autograd.grad`` call, or None
    for forms left to torch (gradient edges, dict inputs)."""
    names = ("outputs", "inputs", "grad_outputs", "retain_graph", "create_graph", "only_inputs",
             "allow_unused", "is_grads_batched", "materialize_grads")  # fmt: skip
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    bound = dict(zip(names, args, strict=False)) | kwargs
    if "outputs" not in bound or "inputs" not in bound:
        return None
    outputs, inputs = bound["outputs"], bound["inputs"]
    # (an output may be a GradientEdge, a NamedTuple: the Hessian's passes start at one)
    outputs = (outputs,) if isinstance(outputs, Tensor | GradientEdge) else tuple(outputs)
    inputs = (inputs,) if isinstance(inputs, Tensor) else inputs
    if isinstance(inputs, dict) or not all(isinstance(t, Tensor) for t in inputs):
        return None
    if not all(isinstance(t, Tensor | GradientEdge) for t in outputs):
        return None
    grads = bound.get("grad_outputs")
    grads = (grads,) if grads is None or isinstance(grads, Tensor) else tuple(grads)
    if len(grads) == 1 and grads[0] is None:
        grads = (None,) * len(outputs)
    if len(grads) != len(outputs) or not inputs:
        return None
    return (
        outputs, tuple(inputs), grads, bound.get("retain_graph"),
        bool(bound.get("create_graph")), bool(bound.get("allow_unused")),
        bool(bound.get("is_grads_batched")), bool(bound.get("materialize_grads")),
    )  # fmt: skip


class Intercept(TorchFunctionMode):
    """The op interception of one :class:`PerSample`: swaps fusable op calls made inside a
    fusable site's forward for :class:`FusedOp`, and has every op that touches a tracked tensor
    followed by the capture (where the batch went, parameters broadcast over the batch)."""

    def __init__(self, capture: PerSample) -> None:
        super().__init__()
        self.capture = capture

    def _captures(self) -> list[PerSample]:
        """This mode's capture and those of the per_sample contexts around it: a backward run
        here is theirs too (this mode runs it, so theirs never see the call)."""
        outer = [m.capture for m in function_modes() if isinstance(m, Intercept) and m is not self]
        return list(dict.fromkeys([*outer, self.capture]))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _passed_through(func):
            return func(*args, **kwargs)
        capture = self.capture
        # keep this mode on while the engine runs, so that the forward a checkpoint recomputes
        # during backward goes through it as the original forward did
        if func in _BACKWARD_ENTRIES:
            inputs = kwargs.get("inputs")
            if inputs is not None and not isinstance(inputs, Tensor | list | tuple | dict):
                kwargs = {**kwargs, "inputs": tuple(inputs)}  # a generator is read once
            call = _backward_call(func, args, kwargs)
            with contextlib.ExitStack() as scopes:
                for c in self._captures():  # every per_sample context active here
                    passive = call is not None and bool(call[4]) and not any(map(c.tracks, call[4]))
                    roots = call[0] if call is not None else ()
                    scopes.enter_context(c.backward_scope(passive, True, roots))
                if call is None:
                    return func(*args, **kwargs)
                with self, explained_checkpoint_errors():
                    return engine_backward(*call)
        if func is torch.autograd.grad:
            call = _grad_call(args, kwargs)
            with contextlib.ExitStack() as scopes:
                wanting = []  # (the captures this call computes quantities for)
                for c in self._captures():
                    # with respect to inputs only (a gradient penalty, an adversarial step), or
                    # batched (vmap's tensors must not reach the results): nothing per sample
                    passive = call is None or call[6] or not any(map(c.tracks, call[1]))
                    roots = call[0] if call is not None else ()
                    scopes.enter_context(c.backward_scope(passive, False, roots))
                    wanting += [] if passive else [c]
                if call is None:
                    return func(*args, **kwargs)
                for c in wanting:
                    c.before_grad()
                with self, explained_checkpoint_errors():
                    results = engine_grad(*call)
                for c in wanting:
                    c.after_grad(call[1], results)
                return results
        fused = _as_fused(func, args, kwargs) if func in FUSABLE_OPS else None
        if fused is not None:
            call = capture.begin_fused(fused[0], fused[1])
            if call is not None:
                out = FusedOp.apply(capture, call, FUSABLE_OPS[func], *fused)
                capture.end_fused(call, func, args, kwargs, out)
                return out
        return capture.follow_op(func, args, kwargs)
