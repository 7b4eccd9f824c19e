"""Private or version-dependent torch APIs, in one place."""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# private modules torch itself builds on (stable since torch 2.0), re-exported from here only
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase  # noqa: F401
from torch.optim import optimizer as _optimizer_module
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten  # noqa: F401


def current_graph_task_id() -> int:
    """Id of the backward pass running on this thread, -1 outside backward."""
    return torch._C._current_graph_task_id()


def _called_from(name: str, *path: str, first_arg: str | None = None) -> bool:
    """Whether a function ``name`` of torch's file ``path`` (whose first parameter is named
    ``first_arg``, if given) is on this thread's call stack."""
    where = os.path.join("torch", *path)
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if (
            code.co_name == name
            and code.co_filename.endswith(where)
            and (first_arg is None or code.co_varnames[:1] == (first_arg,))
        ):
            return True
        frame = frame.f_back
    return False


def in_reentrant_checkpoint_backward() -> bool:
    """Whether this code runs inside ``checkpoint(use_reentrant=True)``'s backward (its
    recomputation of the forward, whose graph that backward then differentiates)."""
    return _called_from("backward", "utils", "checkpoint.py")


def recomputing_checkpoint() -> bool:
    """Whether this code runs inside a non-reentrant checkpoint's recomputation of its block
    (started in a backward, where a saved tensor it dropped is needed)."""
    return _called_from("recompute_fn", "utils", "checkpoint.py")


def selective_checkpoint_active() -> bool:
    """Whether selective activation checkpointing's caching is active here (its
    recomputation hands out each op's cached result once only)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    names = ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
    return any(type(m).__name__ in names for m in _get_current_dispatch_mode_stack())


_CHECKPOINT_REFUSED = (
    "per_sample: torch's non-reentrant checkpoint refused to recompute a block of a forward "
    "a per_sample context recorded (torch's error above). Where torch alone accepts the "
    "model, the cause is one of: this backward runs after the context's `with` block ended "
    "(run every backward through a forward recorded inside it before the block ends); or "
    "non-reentrant checkpoints are nested (one inside another's block, as HF Swin's "
    "gradient checkpointing of its stages and their layers): not supported yet, use "
    "use_reentrant=True or checkpoint one level only."
)


@contextmanager
def explained_checkpoint_errors() -> Iterator[None]:
    """Torch's CheckpointError inside as an error that says why (a backward through a forward
    that a per_sample context recorded)."""
    from torch.utils.checkpoint import CheckpointError

    from .errors import UnsupportedModelError

    try:
        yield
    except CheckpointError as e:
        raise UnsupportedModelError(_CHECKPOINT_REFUSED) from e


def checkpointed_saved_tensors(ctx: Any) -> tuple[torch.Tensor, ...]:
    """``ctx.saved_tensors`` of one of leanprop's autograd Functions (also after the context
    ended), with :func:`explained_checkpoint_errors`."""
    with explained_checkpoint_errors():
        return ctx.saved_tensors


def detaching_checkpoint_inputs() -> bool:
    """Whether this code runs inside ``torch.utils.checkpoint``'s ``detach_variable`` (a
    reentrant checkpoint's recomputation detaching the block's saved inputs)."""
    return _called_from("detach_variable", "utils", "checkpoint.py")


def through_reentrant_checkpoint(t: torch.Tensor) -> bool:
    """Whether ``t``'s graph reaches an output of ``checkpoint(use_reentrant=True)`` (a
    graph back into the block exists only once that checkpoint's backward recomputes it)."""
    return any(
        type(node).__name__ == "CheckpointFunctionBackward" for node in graph_nodes([t.grad_fn])
    )


def inside_function_backward() -> bool:
    """Whether this code runs inside the backward of an autograd ``Function`` (a backward or
    ``autograd.grad`` started there is nested in a running one: a reentrant checkpoint's)."""
    # BackwardCFunction.apply(self, ...) runs a backward; Function.apply(cls, ...) a forward
    return _called_from("apply", "autograd", "function.py", first_arg="self")


def is_checkpoint_error(e: BaseException) -> bool:
    """Whether ``e`` is torch's refusal of something inside ``torch.utils.checkpoint`` (a
    second unpack of a non-reentrant checkpoint's saved tensors, ``autograd.grad`` through a
    reentrant one)."""
    from torch.utils import checkpoint

    error = getattr(checkpoint, "CheckpointError", None)
    return (error is not None and isinstance(e, error)) or (
        isinstance(e, RuntimeError) and "checkpoint" in str(e).lower()
    )


def graph_nodes(starts: Iterable[Any], stop: frozenset[int] = frozenset()) -> Iterator[Any]:
    """Each autograd node reachable from ``starts`` (nodes; None is skipped), once, not going
    past a node whose ``id`` is in ``stop``. The nodes seen are held while walking: torch
    makes a node's Python object anew when none holds it, and a later node could otherwise
    get a visited one's ``id`` and be skipped."""
    seen: dict[int, Any] = {}
    todo = list(starts)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        yield node
        todo.extend(fn for fn, _ in node.next_functions)


def not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t``, or, where it is a view (``F.linear`` on a ``[N, T, I]`` input with a bias returns
    one), the same memory as a tensor autograd does not take for a view: a custom
    ``Function``'s output that is a view refuses in-place ops (``ReLU(inplace=True)``,
    ``h += x``), which the op replaced accepts (``aten._unsafe_view``: no copy)."""
    return t if t._base is None else torch.ops.aten._unsafe_view(t, t.shape)


def saveable(t: torch.Tensor | None) -> torch.Tensor | None:
    """What a custom autograd Function saves (``ctx.save_for_backward``) for its input ``t``:
    a leaf that requires grad (a parameter) as a view of itself. On torch 2.8 (not 2.13),
    saving the leaf itself while saved-tensor hooks are in effect (a non-reentrant
    checkpoint's, ``save_on_cpu``) loses the hooks registered on it with ``register_hook``:
    they never fire. The view has the same values and version counter, and a backward from
    it reaches the leaf. Call inside ``forward``. (Where this torch keeps the hooks, the leaf
    itself: a view costs a few µs per call.)"""
    if t is None or not (t.is_leaf and t.requires_grad) or not saving_loses_leaf_hooks():
        return t
    with torch.enable_grad():  # (forward runs without: the view must lead to the leaf)
        return t.view_as(t)


_LOSES_LEAF_HOOKS: list[bool] = []  # (the probe's answer, once it ran)


def saving_loses_leaf_hooks() -> bool:
    """Whether this torch loses a leaf's ``register_hook`` hooks when a custom autograd
    Function saves the leaf itself under saved-tensor hooks (torch 2.8 does, 2.13 does not):
    tried once, on a tensor of one element (False, and tried again later, where saved-tensor
    hooks are disabled)."""
    if not _LOSES_LEAF_HOOKS:
        try:
            _LOSES_LEAF_HOOKS.append(_probe_lost_leaf_hooks())
        except RuntimeError:  # (torch.autograd.graph.disable_saved_tensors_hooks)
            return False
    return _LOSES_LEAF_HOOKS[0]


def _probe_lost_leaf_hooks() -> bool:
    """One backward through a Function that saves a leaf under identity saved-tensor hooks:
    True where the leaf's hook did not run."""

    class _Saves(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(w)
            return w * 1

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (w,) = ctx.saved_tensors  # (unpacking it is what loses them)
            return g * w.new_ones(())

    with torch.inference_mode(False), torch.enable_grad():
        w = torch.zeros(1, requires_grad=True)
        fired: list[bool] = []
        w.register_hook(lambda g: fired.append(True))
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = _Saves.apply(w)
        engine_backward((out,), (torch.ones_like(out),), False, False, ())
    return not fired


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _top_saved_tensors_hooks() -> tuple | None:
    """The (pack, unpack) saved-tensor hooks in effect; None where none are, or where this
    torch does not say."""
    try:
        return _TOP_HOOKS(False) if _TOP_HOOKS is not None else None
    except (RuntimeError, TypeError):
        return None


def _is_checkpoints(hooks: tuple | None) -> bool:
    name = getattr(hooks[0], "__qualname__", "") if hooks else ""
    return name.startswith(("_checkpoint_hook.", "_recomputation_hook."))


def checkpoint_saves_tensors() -> bool:
    """Whether the saved-tensor hooks in effect are a non-reentrant checkpoint's (its
    forward's, which drop what is saved, or its recomputation's); False where this torch does
    not say."""
    return _is_checkpoints(_top_saved_tensors_hooks())


def saved_tensor_hooks_in_effect() -> str | None:
    """Which saved-tensor hooks are in effect: ``"checkpoint"`` (a non-reentrant checkpoint's
    own), ``"other"`` (``save_on_cpu``, activation offloading, ...), or None."""
    hooks = _top_saved_tensors_hooks()
    if hooks is None:
        return None
    return "checkpoint" if _is_checkpoints(hooks) else "other"


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass ends (only inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _run_engine() -> Callable[..., tuple[torch.Tensor | None, ...]]:
    """The autograd engine's entry (its Python wrapper where this torch has one)."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    return run if run is not None else torch.autograd.Variable._execution_engine.run_backward


def function_modes() -> list[object]:
    """The active ``TorchFunctionMode`` objects, outermost first."""
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def function_modes_active() -> int:
    """How many ``TorchFunctionMode`` objects are active (on the stack) here."""
    return torch._C._len_torch_function_stack()


def top_function_mode() -> object | None:
    """The innermost active ``TorchFunctionMode``, or None."""
    stack = function_modes()
    return stack[-1] if stack else None


def pop_innermost_mode(mode: object) -> object | None:
    """Take ``mode`` off the ``TorchFunctionMode`` stack where it is the innermost active one
    and return it (None, the stack untouched, elsewhere); :func:`push_mode` puts it back. (The
    C calls directly: torch's own context manager costs microseconds on every layer.)"""
    depth = torch._C._len_torch_function_stack()
    if mode is None or depth == 0 or torch._C._get_function_stack_at(depth - 1) is not mode:
        return None
    return torch._C._pop_torch_function_stack()


def push_mode(mode: object) -> None:
    """Put a mode taken off by :func:`pop_innermost_mode` back on the stack."""
    torch._C._push_on_torch_function_stack(mode)


def engine_backward(
    tensors: tuple[torch.Tensor, ...],
    grad_tensors: tuple[torch.Tensor | None, ...],
    retain_graph: bool | None,
    create_graph: bool,
    inputs: tuple[torch.Tensor, ...],
) -> None:
    """``torch.autograd.backward`` after its ``__torch_function__`` check: runs the engine
    with the caller's torch function modes still active (torch >= 2.12 checks there too)."""
    from torch.autograd import _make_grads

    grads = _make_grads(tensors, grad_tensors, is_grads_batched=False)
    retain = create_graph if retain_graph is None else retain_graph
    _run_engine()(tensors, grads, retain, create_graph, inputs, allow_unreachable=True,
                  accumulate_grad=True)  # fmt: skip


def engine_grad(
    outputs: tuple[torch.Tensor, ...],
    inputs: tuple[torch.Tensor, ...],
    grad_outputs: tuple[torch.Tensor | None, ...],
    retain_graph: bool | None,
    create_graph: bool,
    allow_unused: bool,
    is_grads_batched: bool,
    materialize_grads: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` after its ``__torch_function__`` check (see
    :func:`engine_backward`); ``materialize_grads``: zeros for the unused inputs (whose
    gradient is None), as torch's."""
    from torch import _vmap_internals
    from torch.autograd import _make_grads

    grads = _make_grads(outputs, grad_outputs, is_grads_batched=is_grads_batched)
    retain = create_graph if retain_graph is None else retain_graph
    run = _run_engine()

    def vjp(g: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return run(outputs, g, retain, create_graph, inputs, allow_unused, accumulate_grad=False)

    if is_grads_batched:
        result = _vmap_internals._vmap(vjp, 0, 0, allow_none_pass_through=True)(grads)
    else:
        result = vjp(grads)
    if materialize_grads:
        result = tuple(
            torch.zeros_like(x, requires_grad=create_graph) if r is None else r
            for r, x in zip(result, inputs, strict=True)
        )
    return result


def register_packed_sequence_pytree() -> None:
    """Make ``tree_flatten`` split a ``PackedSequence`` into its tensors, as torch >= 2.5
    does (older versions treat it as one leaf, so an RNN's packed output would hide its
    tensors)."""
    from torch.nn.utils.rnn import PackedSequence
    from torch.utils import _pytree

    if PackedSequence in _pytree.SUPPORTED_NODES:
        return
    _pytree.register_pytree_node(
        PackedSequence,
        lambda p: (list(p), None),
        lambda leaves, _: PackedSequence(*leaves),
        serialized_type_name="torch.nn.utils.rnn.PackedSequence",
    )


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def foreach_norms(tensors: list[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """``[vector_norm(t, ord) for t in tensors]`` in a few multi-tensor kernels (DTensors too)."""
    return list(torch._foreach_norm(tensors, ord))


def foreach_scale_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """``t.mul_(factor)`` for each tensor, in a few multi-tensor kernels."""
    torch._foreach_mul_(tensors, factor)


@contextmanager
def leaf_hooks_suspended(params: list[torch.Tensor]) -> Iterator[None]:
    """Suspend the ``register_hook`` hooks of the leaf tensors ``params`` in the block."""
    saved = [(p, p._backward_hooks) for p in params if p._backward_hooks]
    try:
        for p, _ in saved:
            p._backward_hooks = None
        yield
    finally:
        for p, hooks in saved:
            p._backward_hooks = hooks


def ddp_syncs_gradients(ddp: torch.nn.Module) -> bool:
    """Whether a ``DistributedDataParallel`` module all-reduces in this backward (False
    inside its ``no_sync()``)."""
    return bool(ddp.require_backward_grad_sync)


def grouped_by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by (device, dtype) in the order torch's multi-tensor code (e.g.
    ``clip_grad_norm_``) groups them."""
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    grouped = _group_tensors_by_device_and_dtype([tensors])
    return [list(group[0]) for group, _ in grouped.values()]


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 shard); False where torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def optimizer_step_hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step pre- or post-hooks are registered on ``optimizer`` or on all optimizers
    (``step()`` runs them; a direct kernel call would not)."""
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _optimizer_module._global_optimizer_pre_hooks
        or _optimizer_module._global_optimizer_post_hooks
    )


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """What ``Optimizer.__init__`` sets up besides the parameter groups (step, state-dict and
    load hooks, and the wrapper of ``step`` that runs them), for an optimizer that wraps
    another's groups instead of calling it."""
    for name in (
        "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
    ):  # fmt: skip
        setattr(optimizer, name, OrderedDict())
    optimizer._patch_step_function()


def post_accumulate_hooks(p: torch.Tensor) -> int:
    """How many post-accumulate-grad hooks ``p`` has (``register_post_accumulate_grad_hook``)."""
    return len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
