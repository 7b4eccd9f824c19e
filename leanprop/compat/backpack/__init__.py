"""A BackPACK-style facade: run BackPACK code on leanprop with an import change.

    from leanprop.compat.backpack import backpack, extend, extensions
    from leanprop.compat.backpack import weight_jac_t_save_memory

    model, lossfunc = extend(model), extend(lossfunc)
    loss = lossfunc(model(X), y)
    with backpack(extensions.BatchGrad(), extensions.Variance()):
        loss.backward()
    model[0].weight.grad_batch, model[0].weight.variance

    with backpack(extensions.DiagGGNExact()):  # curvature: the loss module must be extended
        loss.backward()
    model[0].weight.diag_ggn_exact

Differences from BackPACK, all in the user's favour: any module graph works (a module called
twice gets the summed individual gradients BackPACK gets wrong; modules without a rule go
through leanprop's torch.func fallback), ``Variance`` is computed from centred values, and a
model that mixes samples (BatchNorm in training mode) raises instead of returning numbers.

Curvature (DiagGGNExact/MC, BatchDiagGGNExact/MC, SqrtGGNExact/MC, GGNMP, KFLR, KFAC, KFRA,
DiagHessian, BatchDiagHessian, HMP, PCHMP) needs the loss module extended (``nn.CrossEntropyLoss``,
``nn.MSELoss``, ``nn.BCEWithLogitsLoss``): when a backward
inside a ``backpack(...)`` block asking for it reaches the loss, it first runs one backward per
column of the loss Hessian's factor through the model (:func:`leanprop.ggn`), then the
backward goes on with the first-order quantities. Any layer the per-sample engine supports is
covered, with BackPACK's attribute names and mean/sum conventions. ``HMP``'s and ``PCHMP``'s
products (``p.hmp(mat)``) differentiate twice through the forward's graph: inside a block
asking for one, backward calls keep that graph (``retain_graph=True``), which lives as long as
the functions.

``extend`` installs hooks that stay until :func:`unextend` or until the model is garbage
collected (as in BackPACK, whose ``extend`` has no undo); the forward pass records what the
layers need, and backward computes the quantities only inside a ``backpack(...)`` block.
Prefer :func:`leanprop.per_sample` in new code: it is scoped, removes its hooks on exit, and is
faster (it also swaps the Linear/Conv ops so autograd does not compute their parameter
gradients twice, which a permanent facade cannot do).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..._torch_compat import current_graph_task_id, queue_callback, top_function_mode
from ...errors import LeanpropError, UnsupportedModelError
from ...per_sample.capture import PerSample
from ...per_sample.curvature.ggn import compute_ggn, validate_curvature
from ...per_sample.curvature.loss_hessian import SUPPORTED as CURVATURE_LOSSES
from ...per_sample.curvature.quantities import CurvatureQuantity
from ...per_sample.quantities import BatchGrad, Quantity, subsampling_of, validate_quantities
from . import extensions

__all__ = ["backpack", "extend", "extensions", "unextend", "weight_jac_t_save_memory"]

# captures live as long as their model (only the model's hooks reference them)
_EXTENDED: weakref.WeakSet[PerSample] = weakref.WeakSet()
_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # capture -> its hook
_SAVE_MEMORY: list[bool | None] = [None]  # innermost weight_jac_t_save_memory setting
_LOSS_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loss module -> hook
# curvature asked for by each open backpack(...) block, innermost last (by Monte-Carlo count)
_CURVATURE: list[dict[int | None, list[CurvatureQuantity]]] = []
_CURVATURE_RUNNING: list[bool] = []  # non-empty while its backward passes run
_CURVATURE_DONE: set[int] = set()  # backward passes (graph tasks) whose curvature ran
_OPEN_BLOCKS: list[_Block] = []  # open backpack(...) blocks, innermost last (the one that acts)


@dataclass(eq=False)
class _Block:
    """One open ``backpack(...)`` block: what its backward passes compute, and the models
    extended while it is open (set to compute it too, and idle again when it closes)."""

    kinds: frozenset[type[Quantity]]
    subsampling: tuple[int, ...] | None
    extended_inside: list[PerSample] = field(default_factory=list)


def _alive() -> list[PerSample]:
    """The captures of extended models that still exist."""
    return [c for c in list(_EXTENDED) if c.model_alive]


def _covered(module: nn.Module) -> bool:
    return any(any(s is module for s in c.model.modules()) for c in _alive())


def extend(module: nn.Module, debug: bool = False, use_converter: bool = False) -> nn.Module:
    """Prepare ``module`` (and its sub-modules) for ``backpack(...)``; returns it unchanged.

    Loss modules whose Hessian the curvature quantities use (``nn.CrossEntropyLoss``,
    ``nn.MSELoss``, ``nn.BCEWithLogitsLoss``) get a forward hook that records their input and
    target; other modules without trainable parameters need nothing and are returned as is.
    ``debug`` and ``use_converter`` are accepted for compatibility: leanprop needs no graph
    conversion (it follows any module graph, branches and weight sharing included).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"extend() takes an nn.Module, got {type(module).__name__}.")
    if type(module) in CURVATURE_LOSSES:
        if module not in _LOSS_HOOKS:
            _LOSS_HOOKS[module] = module.register_forward_hook(_on_loss, with_kwargs=True)
        return module
    if not any(p.requires_grad for p in module.parameters()) or _covered(module):
        return module
    # no op swap: a TorchFunctionMode cannot stay on torch's mode stack for the model's life
    capture = PerSample(module, BatchGrad(), fuse=False)
    capture.set_quantities(frozenset(), "auto")
    if _OPEN_BLOCKS:  # extended inside an open block: its backward passes compute that block's
        block = _OPEN_BLOCKS[-1]
        capture.set_quantities(block.kinds, _algorithm(), block.subsampling)
        block.extended_inside.append(capture)
    capture.__enter__()
    _HOLDERS[capture] = capture.owned_by_model()
    _EXTENDED.add(capture)
    return module


def unextend(module: nn.Module) -> nn.Module:
    """Remove what :func:`extend` installed on ``module``."""
    handle = _LOSS_HOOKS.pop(module, None)
    if handle is not None:
        handle.remove()
    for capture in [c for c in _alive() if c.model is module]:
        _EXTENDED.discard(capture)
        _HOLDERS.pop(capture).remove()
        capture.__exit__(None, None, None)
    return module


def _algorithm() -> str:
    return {True: "grouped", False: "unfold", None: "auto"}[_SAVE_MEMORY[-1]]


def _on_loss(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss: Any) -> None:
    """An extended loss ran: when a backward reaches its output, curvature asked for by the
    ``backpack(...)`` block around that backward is computed first."""
    output = args[0] if args else kwargs.get("input")
    target = args[1] if len(args) > 1 else kwargs.get("target")
    if output is None or target is None or not isinstance(loss, Tensor) or loss.grad_fn is None:
        return
    # (the hook lives with the graph; it holds the loss module, which may be made inline)
    prehook = functools.partial(_curvature_first, module, output, target)
    loss.grad_fn.register_prehook(prehook)


def _curvature_first(
    module: nn.Module, output: Tensor, target: Tensor, grad_outputs: tuple[Tensor | None, ...]
) -> None:
    """Backward reached an extended loss's output: run the curvature passes through the
    model output it took (before backward goes on, while the graph is whole)."""
    by_mc = _CURVATURE[-1] if _CURVATURE else {}
    if not by_mc:
        return
    (g,) = grad_outputs
    if g is None or g.numel() != 1 or g.item() != 1.0:
        raise UnsupportedModelError(
            "backpack(): the curvature quantities are those of the extended loss module's "
            "output; this backward reached it with gradient "
            f"{None if g is None else g.flatten()[:1].tolist()} (the loss was scaled or used "
            "in another expression). Call backward on the loss module's output itself."
        )
    reached = _leaves_of(output)
    contexts = [
        c for c in _alive() if c.active and any(id(p) in reached for p in c.model.parameters())
    ]
    if not contexts:
        return  # (no extended model's parameters behind this loss)
    task = current_graph_task_id()
    if task in _CURVATURE_DONE:
        raise UnsupportedModelError(
            "backpack(): this backward reached the outputs of two extended losses (a loss "
            "called twice, or two losses added); the curvature quantities are those of one "
            "loss. Call backward on one extended loss's output per backward."
        )
    _CURVATURE_DONE.add(task)
    _CURVATURE_RUNNING.append(True)
    try:
        # (in backward, grad mode is the backward's create_graph)
        compute_ggn(contexts, output, module, target, by_mc, None, torch.is_grad_enabled())
    finally:
        _CURVATURE_RUNNING.pop()


def _leaves_of(t: Tensor) -> set[int]:
    """``id`` of the leaf tensors ``t``'s autograd graph accumulates into (the parameters it
    depends on)."""
    seen, leaves, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None:
            leaves.add(id(variable))
        todo.extend(fn for fn, _ in node.next_functions)
    return leaves


@contextmanager
def _after_each_backward(
    block: _Block, captures: list[PerSample], fn: Callable[[int, list[PerSample]], object]
) -> Iterator[None]:
    """Call ``fn(task, models)`` when each backward in the block that reached parameters of
    the extended models has ended (after the quantities are written): ``task`` the backward,
    ``models`` the captures of the models it reached. Only while ``block`` is the innermost
    open block (an inner block's backward passes are its own, as in BackPACK)."""
    reached: dict[int, list[PerSample]] = {}  # backward (graph task) -> models it reached

    def on_grad(capture: PerSample, p: Tensor) -> None:
        if _CURVATURE_RUNNING or _OPEN_BLOCKS[-1] is not block:
            return
        task = current_graph_task_id()
        if task not in reached:
            reached[task] = []
            queue_callback(lambda: fn(task, reached.pop(task)))  # (after the engine's end)
        if capture not in reached[task]:
            reached[task].append(capture)

    handles = [
        p.register_post_accumulate_grad_hook(functools.partial(on_grad, c))
        for c in captures
        for p in c.model.parameters()
        if p.requires_grad
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _run_extension_hook(hook: Callable[[nn.Module], object], task: int, models: list) -> None:
    """BackPACK's ``extension_hook``: each module of the models reached, last layer first."""
    for c in models:
        for m in reversed(list(c.model.modules())):
            hook(m)


def _curvature_computed(names: list[str], task: int, models: list) -> None:
    """A backward asked for curvature ended: it must have reached an extended loss."""
    if task in _CURVATURE_DONE:
        _CURVATURE_DONE.discard(task)
        return
    raise UnsupportedModelError(
        f"backpack({', '.join(names)}): this backward did not start at the output of an "
        "extended loss module (nn.CrossEntropyLoss, nn.MSELoss or nn.BCEWithLogitsLoss, "
        "passed through extend()), whose Hessian the curvature is built from; no curvature "
        "was computed. Extend the loss module and call backward on its output."
    )


class _RetainGraph(TorchFunctionMode):
    """Inside a ``backpack(HMP())`` block: backward calls keep the forward's graph
    (``p.hmp(mat)`` differentiates through it after the backward; BackPACK keeps what it needs
    itself, so its users do not pass ``retain_graph=True``)."""

    _ENTRIES = (torch.Tensor.backward, torch.autograd.backward)
    on = True  # (off: left on the stack by a mode not exited in order; passes ops through)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on and func in self._ENTRIES:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.arguments["retain_graph"] = True
            return func(*bound.args, **bound.kwargs)
        return func(*args, **kwargs)


@contextmanager
def _retaining_graph() -> Iterator[None]:
    """Backward calls in the block keep their graph (see :class:`_RetainGraph`)."""
    mode = _RetainGraph()
    mode.__enter__()
    try:
        yield
    finally:
        if top_function_mode() is mode:
            mode.__exit__(None, None, None)
        else:  # leaving would pop another mode: ours stays, passing every op through
            mode.on = False
            raise LeanpropError(
                "backpack(HMP()): the block ended while a TorchFunctionMode entered inside it "
                "was still active, so the facade could not remove its own mode (it now passes "
                "every op through unchanged). Exit modes in the reverse order of entering them."
            )


@contextmanager
def backpack(
    *exts: Quantity | CurvatureQuantity,
    extension_hook: Callable[[nn.Module], object] | None = None,
    debug: bool = False,
    retain_graph: bool = False,
) -> Iterator[None]:
    """Compute ``exts`` during the backward passes run inside the block, for every extended
    model (results on the parameters, as BackPACK's).

    Args:
        *exts: first-order extensions (BatchGrad, BatchL2Grad, BatchDotGrad, SumGradSquared,
            Variance) and curvature ones (DiagGGNExact/MC, BatchDiagGGNExact/MC,
            SqrtGGNExact/MC, GGNMP, KFLR, KFAC, KFRA, DiagHessian, BatchDiagHessian, HMP,
            PCHMP; they need the loss module extended; with HMP or PCHMP, backward calls in the
            block keep the graph).
        extension_hook: called with each module of the extended models (last layer first)
            after each backward in the block, once the quantities are written (BackPACK calls
            it as each module's backward ends: the results are the same, the memory is not
            freed earlier).
        debug: accepted for compatibility.
        retain_graph: keep what the modules recorded in forward for further backward passes
            through the same graph (``loss.backward(retain_graph=True)``), each with results
            of its own.
    """
    curvature = [e for e in exts if isinstance(e, CurvatureQuantity)]
    first = tuple(e for e in exts if not isinstance(e, CurvatureQuantity))
    kinds = validate_quantities(first) if first or not curvature else frozenset()
    by_mc = validate_curvature(curvature) if curvature else {}
    captures = _alive()
    before = [(c.kinds, c.conv_algorithm, c.subsampling) for c in captures]
    subsampling = subsampling_of(first)
    for c in captures:
        c.set_quantities(kinds, _algorithm(), subsampling)
        if by_mc:  # (an earlier block's curvature is not this one's)
            for p in c.model.parameters():
                for attr in {e.savefield for e in curvature}:
                    if hasattr(p, attr):
                        delattr(p, attr)
    _CURVATURE.append(by_mc)
    block = _Block(kinds, subsampling)
    _OPEN_BLOCKS.append(block)
    try:
        with ExitStack() as stack:
            if retain_graph:
                for c in captures:
                    stack.enter_context(c.computing())
            if any(e.second_order for e in curvature):
                stack.enter_context(_retaining_graph())
            if by_mc:
                names = [f"{type(e).__name__}()" for e in curvature]
                check = functools.partial(_curvature_computed, names)
                stack.enter_context(_after_each_backward(block, captures, check))
            if extension_hook is not None:
                run = functools.partial(_run_extension_hook, extension_hook)
                stack.enter_context(_after_each_backward(block, captures, run))
            yield
    finally:
        _CURVATURE.pop()
        _OPEN_BLOCKS.remove(block)
        for c, (k, algo, samples) in zip(captures, before, strict=True):
            c.set_quantities(k, algo, samples)
        for c in block.extended_inside:
            if c.model_alive:
                c.set_quantities(frozenset(), "auto")


@contextmanager
def weight_jac_t_save_memory(save_memory: bool = True) -> Iterator[None]:
    """BackPACK's switch for the convolution weight algorithm: ``save_memory=True`` selects
    leanprop's ``"grouped"`` algorithm (Rochette et al. 2019), ``False`` the im2col one."""
    _SAVE_MEMORY.append(bool(save_memory))
    try:
        yield
    finally:
        _SAVE_MEMORY.pop()
