"""Step any ``torch.optim`` optimizer during ``backward``, freeing each gradient once used.

``opt = InBackward(model.parameters(), torch.optim.AdamW, lr=1e-3)`` builds the plain optimizer
(``inner``) and hooks every parameter's gradient accumulation. During ``loss.backward()``,
parameters whose gradient is final (``register_post_accumulate_grad_hook``: after every use,
tied parameters included) are collected; as soon as their gradients reach ``bucket_mb`` they
are stepped together by one call of the inner optimizer (its foreach/fused kernels), and their
gradients are freed. The rest is stepped when the backward pass ends. Peak memory is thus the
optimizer state plus about one bucket of gradients instead of all of them.

Exactness: a separable optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...; anything whose
update of a tensor reads only that tensor's gradient and state) gives bit-identical parameters
to ``backward(); step(); zero_grad()`` with the same kernel family, since each tensor sees the
same operations. Optimizers that need a closure or couple tensors (LBFGS) are rejected.

The facade *is* a ``torch.optim.Optimizer`` sharing the inner optimizer's ``param_groups`` and
``state``: LR schedulers, ``state_dict()`` / ``load_state_dict()`` (interchangeable with the
plain optimizer's) and trainers work. ``step()`` steps what backward held (nothing, in a plain
loop); ``step(closure)`` runs the closure once, its backward stepping as usual.

Trainers (see :mod:`leanprop.optim.trainers`): under accelerate (HF ``Trainer``) and Lightning
a backward steps only when it is the last micro-batch of a step and the trainer's clipping is
known not to need the gradients; otherwise the gradients are held and ``step()`` steps them,
exactly as the plain optimizer. The first step of such a loop is held to learn its clipping.

A backward that raises (a hook, anomaly detection, out of memory) is abandoned: buckets it
already stepped stay stepped, and every gradient it left unstepped is dropped (with a warning)
when the next backward or ``step()`` comes, so the next backward steps with its own gradients
only (gradients accumulated by ``accumulate()`` micro-batches before it are dropped too: they
cannot be told apart from the failed backward's partial ones).

A second backward through one retained graph cannot work: the first stepped the parameters
the graph saved (torch raises "modified by an inplace operation"); add the losses and call
backward once.

Clipping: while any InBackward hooks parameters, ``torch.nn.utils.clip_grad_norm_`` goes through
a guard (installed once, removed with the last InBackward): with ``max_norm=inf`` it returns the
global norm of the last backward's gradients as backward produced them, before any clipping
(what trainers log; recorded per bucket before its step); clipping gradients already stepped
and freed is refused with what to use instead. ``clip_grad_value_``, ``clip_grads_with_norm_``
and accelerate's ``Accelerator.clip_grad_norm_`` (which takes the norm of the gradients that
are there, so would see none) are guarded alike. ``torch.nn.utils.get_total_norm`` takes
gradients, not parameters, so cannot be: read ``opt.last_grad_norm`` instead.

A backward run inside another (``checkpoint(use_reentrant=True)``) that accumulates gradients
of these parameters is refused: stepping there would step them once per inner backward with
part of their gradient; use ``use_reentrant=False``. The hooks hold the optimizer weakly: one
dropped without :meth:`InBackward.remove` stops stepping when it is collected.

Under ``DistributedDataParallel`` pass ``ddp=``: buckets are stepped after their all-reduce
(see :mod:`leanprop.optim.distributed`); under FSDP2 pass ``fsdp=`` to step each unit with one
call after its reduce-scatter.
"""

from __future__ import annotations

import functools
import numbers
import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .._torch_compat import (
    current_graph_task_id,
    foreach_norms,
    inside_function_backward,
    is_dtensor,
    queue_callback,
)
from ..errors import LeanpropValueError, UnsupportedModelError
from .distributed import DDPStepper, fsdp_units
from .kernels import DirectKernels
from .norms import (
    SteppedNorms,
    clip_factor,
    global_norm,
    grad_norms,
    norm_in_order,
    scale_grads,
)
from .trainers import (
    TrainerClipping,
    accelerate_caller,
    accelerate_syncs,
    called_by_grad_scaler,
    closure_driven,
    lightning_running,
    lightning_sees_gradients,
    lightning_wrapper,
    run_on_wrapped,
)

# parameter -> weak reference to the InBackward stepping it (hooks and this map never keep an
# optimizer alive: one dropped without remove() releases its hooks when collected)
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _owner(p: Tensor) -> InBackward | None:
    ref = _OWNER.get(p)
    return None if ref is None else ref()


_NEEDS_CLOSURE = (torch.optim.LBFGS,)

# what a trainer's wrapper of the optimizer (Lightning's) must run on the optimizer itself
_WRAPPED_API = (
    "zero_grad",
    "state_dict",
    "load_state_dict",
    "add_param_group",
    "accumulate",
    "clipped_backward",
    "remove",
    "last_grad_norm",
    "ddp_bucket_bytes",
    "ddp_bucket_peak_bytes",
)


# what the guards hand ordinary calls to: the functions they replaced, while installed
# ((module or class, name) -> the original), else torch's own
_GUARDED: dict[tuple[Any, str], Any] = {}
_TORCH_CLIPPING = {
    name: getattr(torch.nn.utils, name, None)
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")
}


def _original(name: str) -> Any:
    """torch's ``torch.nn.utils.<name>`` as the guards found it."""
    return _GUARDED.get((torch.nn.utils, name), _TORCH_CLIPPING[name])


def _owners(params: Iterable[Tensor]) -> list[InBackward]:
    """The InBackward optimizers stepping ``params``, each once."""
    return list({id(o): o for p in params if (o := _owner(p)) is not None}.values())


def _stepped_in_last_backward(p: Tensor) -> bool:
    """``p`` belongs to an InBackward that stepped it (and freed its gradient) in its last
    backward."""
    o = _owner(p)
    return p.grad is None and o is not None and id(p) in o._stepped.stepped


def _note_clipping(params: list[Tensor], kind: str) -> None:
    """A clipping call on held gradients: their optimizers learn what the caller does."""
    for o in _owners(params):
        o._clipping.saw(kind)


def _params_of(parameters: Any) -> list[Tensor]:
    """A clipping call's parameters (one tensor or an iterable of them) as a list."""
    return [parameters] if isinstance(parameters, Tensor) else list(parameters)


def _approximate(stepped: list[Tensor]) -> bool:
    """Every one of ``stepped`` belongs to an InBackward with approximate clipping."""
    return all(o.clip_grad_norm is not None for p in stepped if (o := _owner(p)))


def _nothing_left_to_clip(call: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{call} got parameters of an InBackward optimizer: their gradients were already "
        "stepped and freed during backward, so there is nothing left to clip (only reading the "
        "2-norm, clip_grad_norm_(params, inf), works). Use opt.clipped_backward(loss, "
        "max_norm) for exact clipping, or InBackward(..., clip_grad_norm=max_norm) for the "
        "cheaper approximate mode. A trainer's clipping is learnt on the optimizer's first "
        "step: one that starts clipping later (another run with the same optimizer) needs a "
        "new InBackward."
    )


def _norms_not_kept(o: InBackward, call: str) -> UnsupportedModelError:
    """``call`` read the norms of gradients ``o`` stepped and freed without keeping them."""
    if o._stepped.dropped:
        why = (
            "InBackward keeps them by default only while they are read: nothing read them "
            "after the first backward that stepped, so it stopped keeping them (one read of "
            "every gradient less). Pass InBackward(..., record_norms=True) to read them "
            "later, or read them once after the first backward that steps (then they are kept)."
        )
    else:
        why = "it was built with record_norms=False: pass record_norms=True."
    return UnsupportedModelError(
        f"{call}: the gradients of {type(o.inner).__name__}'s parameters were stepped and freed "
        f"in backward without their norms being kept; {why}"
    )


def _guarded_clip_grad_norm_(
    parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:  # fmt: skip
    """torch's ``clip_grad_norm_``, for parameters whose gradients InBackward stepped and
    freed in backward: with ``max_norm=inf`` (reading the norm, as trainers do to log it) the
    global norm of those gradients as the last backward produced them (before any clipping,
    as ``clip_grad_norm_`` returns it); clipping them is refused, except where the user chose
    InBackward's approximate clipping (``clip_grad_norm=``), which stands in for it. On held
    gradients it is torch's, and their optimizer learns that the caller clips."""
    params = _params_of(parameters)
    stepped = [p for p in params if _stepped_in_last_backward(p)]
    torch_clip = _original("clip_grad_norm_")
    finite = float(max_norm) != float("inf")
    if not stepped:
        if finite:
            _note_clipping(params, "norm")
        total = torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if not finite:  # a read (torch multiplied the gradients by 1 in place)
            for o in _owners(params):
                o._clipping.refresh(params)
        return total
    if (finite and not _approximate(stepped)) or float(norm_type) != 2.0:
        raise _nothing_left_to_clip(
            f"clip_grad_norm_(max_norm={max_norm!r}, norm_type={norm_type!r})"
        )
    unkept = [o for p in stepped if (o := _owner(p)) and not o._stepped.keep]
    if unkept:
        raise _norms_not_kept(unkept[0], "clip_grad_norm_(params, inf)")
    # the last backward among the optimizers involved (another one's older norms are over)
    last = max(o._stepped.task for p in stepped if (o := _owner(p)) is not None)
    for o in _owners(stepped):
        o._stepped.read()
    held = iter(grad_norms([p.grad for p in params if p.grad is not None]))
    norms: list[Tensor] = []
    for p in params:
        if p.grad is not None:
            norms.append(next(held))
        elif (o := _owner(p)) is not None and o._stepped.task == last and id(p) in o._stepped.norms:
            norms.append(o._stepped.norms[id(p)])
    total = global_norm(norms)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            "clip_grad_norm_: the total norm of order 2.0 of the gradients is non-finite "
            "(error_if_nonfinite=True)."
        )
    if finite:  # (the approximate rule stands in for the stepped ones; held ones are clipped)
        _clip_held(params, max_norm, total, foreach)
    return total


def _clip_held(params: list[Tensor], max_norm: float, total: Tensor, foreach: Any) -> None:
    """torch's ``clip_grads_with_norm_`` on those of ``params`` whose gradients are there
    (another optimizer's, or held for ``step()``), their optimizers told."""
    held = [p for p in params if p.grad is not None]
    if held:
        _note_clipping(held, "norm")
        _original("clip_grads_with_norm_")(held, max_norm, total, foreach)


def _guarded_clip_grad_value_(
    parameters: Any, clip_value: float, foreach: bool | None = None
) -> None:
    """torch's ``clip_grad_value_``; refused for gradients InBackward already stepped and
    freed (torch would silently clip nothing); on held gradients their optimizer learns that
    the caller clips."""
    params = _params_of(parameters)
    if any(_stepped_in_last_backward(p) for p in params):
        raise UnsupportedModelError(
            f"clip_grad_value_(clip_value={clip_value!r}) got parameters of an InBackward "
            "optimizer whose gradients were already stepped and freed during backward: there "
            "is nothing left to clip. In your own loop, clip by norm with "
            "opt.clipped_backward(loss, max_norm); trainers (HF, Lightning) are detected and "
            "get their gradients held for step() from the first step on."
        )
    _note_clipping(params, "value")
    _original("clip_grad_value_")(params, clip_value, foreach=foreach)


def _guarded_clip_grads_with_norm_(
    parameters: Any, max_norm: float, total_norm: Tensor, foreach: bool | None = None
) -> None:
    """torch's ``clip_grads_with_norm_`` (the scaling half of ``clip_grad_norm_``; accelerate
    calls it after taking the norm itself): refused for gradients InBackward already stepped
    and freed (torch would silently scale nothing), except where the user chose InBackward's
    approximate clipping (``clip_grad_norm=``), which stands in for it. On held gradients it is
    torch's, and their optimizer learns that the caller clips."""
    params = _params_of(parameters)
    stepped = [p for p in params if _stepped_in_last_backward(p)]
    if stepped and not _approximate(stepped):
        raise _nothing_left_to_clip(f"clip_grads_with_norm_(max_norm={max_norm!r})")
    _clip_held(params, max_norm, total_norm, foreach)


def _guarded_accelerator_clip(original: Any) -> Any:
    """accelerate's ``Accelerator.clip_grad_norm_``, which takes the norm of the gradients
    that are there (``get_total_norm``) and would silently see none of those InBackward
    stepped and freed: for those, :func:`_guarded_clip_grad_norm_` (their recorded norm, or a
    clear refusal to clip them); otherwise accelerate's own."""

    @functools.wraps(original)
    def clip_grad_norm_(
        accelerator: Any, parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any
    ) -> Any:
        params = _params_of(parameters)
        if any(_stepped_in_last_backward(p) for p in params):
            return _guarded_clip_grad_norm_(params, max_norm, norm_type)
        return original(accelerator, params, max_norm, norm_type, **kwargs)

    return clip_grad_norm_


def _guard_clipping(on: bool) -> None:
    """Route ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_`` and
    ``clip_grads_with_norm_``, and accelerate's ``Accelerator.clip_grad_norm_`` once accelerate
    is imported, through the guards while any InBackward hooks parameters (calls through a
    reference taken before that are not seen). Called again (accelerate wrapping an
    optimizer), it adds what is new."""
    import torch.nn.utils.clip_grad as clip_module

    if not on:
        if _GUARDED and not any(r() is not None for r in _OWNER.values()):
            for (target, name), original in _GUARDED.items():
                setattr(target, name, original)
            _GUARDED.clear()
        return
    guards = zip(
        _TORCH_CLIPPING,
        (_guarded_clip_grad_norm_, _guarded_clip_grad_value_, _guarded_clip_grads_with_norm_),
        strict=True,
    )
    for name, guard in guards:
        for target in (torch.nn.utils, clip_module):
            if hasattr(target, name) and (target, name) not in _GUARDED:
                _GUARDED[target, name] = getattr(target, name)
                setattr(target, name, guard)
    _guard_accelerate()


def _guard_accelerate() -> None:
    """Wrap accelerate's ``Accelerator.clip_grad_norm_`` once accelerate is imported (checked
    where the guards are installed, where accelerate wraps an optimizer, and as each backward
    begins: accelerate may be imported after the InBackward is made, and a loop need not
    prepare the optimizer)."""
    accelerator = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    if accelerator is None or (accelerator, "clip_grad_norm_") in _GUARDED:
        return
    original = vars(accelerator).get("clip_grad_norm_")
    if original is not None:
        _GUARDED[accelerator, "clip_grad_norm_"] = original
        accelerator.clip_grad_norm_ = _guarded_accelerator_clip(original)


def _positive(x: Any, allow_inf: bool = False) -> bool:
    """A positive number (not a bool, not NaN; infinite only where allowed)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    return x > 0 and (allow_inf or x < float("inf"))


def _before_accumulate(ref: weakref.ref, grad: Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._before_accumulate(grad)


def _on_ready(ref: weakref.ref, p: Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._on_ready(p)


def _release(handles: list[RemovableHandle]) -> None:
    """An InBackward was collected without remove(): its hooks go, and the clipping guard
    with the last one."""
    for h in handles:
        h.remove()
    handles.clear()
    _guard_clipping(False)


class InBackward(torch.optim.Optimizer):
    """Optimizer whose steps happen inside ``backward``; see the module docstring.

    Example:
        >>> import torch
        >>> from leanprop.optim import InBackward
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = InBackward(model.parameters(), torch.optim.AdamW, lr=1e-2)
        >>> model(torch.randn(8, 4)).pow(2).mean().backward()  # steps here
        >>> model.weight.grad is None  # freed after its step
        True
        >>> opt.step()  # no-op, for schedulers and trainers
        >>> opt.remove()

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer.
        optimizer_class: the optimizer to run, e.g. ``torch.optim.AdamW``.
        bucket_mb: step as soon as this many MiB of final gradients are waiting.
        clip_grad_norm: cheap approximate global-norm clipping: each gradient is scaled by
            ``clip_grad_norm / (norm + 1e-6)`` (at most 1) where ``norm`` is the global gradient
            norm of the *previous* backward (the first backward is not clipped). For exact
            clipping use :meth:`clipped_backward` (one extra backward). Gradients held for
            ``step()`` (micro-batches, trainers) are all there: they are clipped exactly.
        record_norms: keep each stepped gradient's norm (one extra read of every gradient,
            a few percent of a step on CPU): what ``last_grad_norm``, approximate clipping
            and ``clip_grad_norm_(params, inf)`` (trainers' logging) read. Off: those raise.
            None (the default) decides by use: kept in the first backward that steps, and
            from then on if they were read before the next backward began (a trainer that
            logs the norm reads it after every backward); else no longer kept, and a later
            read raises, saying to pass ``record_norms=True``.
        ddp: the ``DistributedDataParallel`` module whose parameters these are: each DDP bucket
            is stepped once its all-reduce has finished, and DDP's bucket memory is released
            between uses (see :mod:`leanprop.optim.distributed`). Buckets are then DDP's
            (its ``bucket_cap_mb``), and ``bucket_mb`` is not used. In a process group of
            several ranks without ``ddp=``, a backward outside a trainer is refused (DDP would
            average the gradients after it stepped them; a trainer's ``step()`` gets them held
            instead); ``ddp=False`` says that no DDP synchronises these parameters.
        fsdp: the model sharded with FSDP2 ``fully_shard``: each unit's parameters are stepped
            by one optimizer call as soon as the unit's gradients are reduce-scattered (without
            it, FSDP2 models still train exactly, stepped by ``bucket_mb``).
        **kwargs: the optimizer's own arguments (``lr``, ``weight_decay``, ``fused``, ...).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        bucket_mb: float = 25.0,
        clip_grad_norm: float | None = None,
        record_norms: bool | None = None,
        ddp: Any = None,
        fsdp: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise LeanpropValueError(
                f"InBackward() needs a torch.optim.Optimizer class, got {optimizer_class!r}; "
                "pass the class itself: InBackward(model.parameters(), torch.optim.AdamW, lr=...)."
            )
        if issubclass(optimizer_class, InBackward):
            raise LeanpropValueError(
                "InBackward() cannot wrap InBackward; wrap the plain optimizer."
            )
        if issubclass(optimizer_class, _NEEDS_CLOSURE):
            raise LeanpropValueError(
                f"InBackward() cannot run {optimizer_class.__name__}: it needs a closure that "
                "re-evaluates the loss, which a step inside backward cannot provide."
            )
        if clip_grad_norm is not None and not _positive(clip_grad_norm):
            raise LeanpropValueError(
                f"InBackward() got clip_grad_norm={clip_grad_norm!r}; it must be a positive, "
                "finite number (the largest global gradient norm) or None."
            )
        if clip_grad_norm is not None and record_norms is False:
            raise LeanpropValueError(
                "InBackward(clip_grad_norm=..., record_norms=False): approximate clipping "
                "uses the recorded norms of the previous backward; leave record_norms on."
            )
        if not _positive(bucket_mb):
            raise LeanpropValueError(
                f"InBackward() got bucket_mb={bucket_mb!r}; it must be a positive, finite "
                "number of MiB (e.g. 25)."
            )
        self._ddp_off = ddp is False  # the user says: no DDP synchronises these gradients
        ddp = None if ddp is False else ddp
        if ddp is not None and fsdp is not None:
            raise LeanpropValueError(
                "InBackward() takes ddp= (a DistributedDataParallel module) or fsdp= (a model "
                "sharded with fully_shard), not both."
            )
        self.inner = optimizer_class(params, **kwargs)
        self._kernels = DirectKernels(self.inner)  # bucket steps without Optimizer.step()
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self._share()
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._ready: list[Tensor] = []
        self._ready_bytes = 0
        self._accumulating = False
        self._callback_queued = False
        self._queued_task = -1  # the backward whose end will step what is left
        self._nested_task = -1  # a backward run inside a running one (reentrant checkpoint)
        self._measuring: dict[int, Tensor] | None = None  # id(p) -> grad norm, first pass
        self.clip_grad_norm = clip_grad_norm
        self._approx_coef: Tensor | None = None  # clip factor from last_grad_norm
        # gradient norms of the last backward (approximate clipping reads them every time)
        self._stepped = SteppedNorms(
            keep=record_norms is not False,
            auto=record_norms is None and clip_grad_norm is None,
        )
        self._coef: Tensor | None = None  # clipped_backward, second pass
        # the training loop around (see trainers.py): who drives, what it clips, what is held
        self._lightning_wrapper: weakref.ref | None = None  # Lightning's: steps in step(closure)
        self._accelerate = False  # wrapped by accelerate: its GradientState says what syncs
        self._in_step = False  # step(closure) is running its closure
        self._clipping = TrainerClipping()
        self._decided_task = -1  # the backward _holds was decided for
        self._holding = False  # that backward leaves its gradients for step()
        self._awaiting_step = False  # gradients of a backward that would have stepped are held
        self._stepped_outside_closure = False  # since the last step()
        self._handles: list[RemovableHandle] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(p) -> (group, position)
        params_all = [p for g in self.param_groups for p in g["params"]]
        for o in _owners(params_all):
            if o._lightning_done():  # Lightning's finished run still references it
                o.remove()
        taken = [p for p in params_all if _owner(p) is not None]
        if taken:
            raise LeanpropValueError(
                f"InBackward(): {len(taken)} parameter(s) already belong to another InBackward "
                "optimizer; call .remove() on that one first (each gradient can be stepped once)."
            )
        trainable = [p for p in params_all if p.requires_grad]
        self._unit_of = {} if fsdp is None else fsdp_units(fsdp, trainable)
        self._unit_size = Counter(self._unit_of.values())  # unit -> parameters in it
        self._unit_ready: dict[int, list[Tensor]] = {}
        self._ddp: DDPStepper | None = None
        if ddp is not None:
            self._ddp = DDPStepper(self, ddp)
        for p in params_all:
            if p.requires_grad:
                self._hook(p)
        self._constructed = True
        _guard_clipping(True)
        # dropped without remove(): its hooks go when it is collected
        weakref.finalize(self, _release, self._handles)

    def _hook(self, p: Tensor) -> None:
        me = weakref.ref(self)
        _OWNER[p] = me
        if self._ddp is None:
            self._handles.append(p.register_hook(functools.partial(_before_accumulate, me)))
            self._handles.append(
                p.register_post_accumulate_grad_hook(functools.partial(_on_ready, me))
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (as ``torch.optim.Optimizer.add_param_group``); its
        parameters are stepped in backward like the others."""
        if not getattr(self, "_constructed", False):  # torch's __init__ adding the groups
            super().add_param_group(param_group)
            return
        if self._ddp is not None:
            raise UnsupportedModelError(
                "InBackward(ddp=...).add_param_group(): DDP's buckets are fixed when it wraps "
                "the model; build the InBackward with every parameter group instead."
            )
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        taken = [p for p in params if _owner(p) is not None]
        if taken:
            raise LeanpropValueError(
                f"InBackward.add_param_group(): {len(taken)} parameter(s) already belong to an "
                "InBackward optimizer (each gradient can be stepped once)."
            )
        self.inner.add_param_group({**group, "params": params})
        self._share()
        if not self._hooked:  # after remove(): an ordinary optimizer
            return
        for p in params:
            if p.requires_grad:
                self._hook(p)

    def _share(self) -> None:
        """The facade and the inner optimizer use the same groups and state objects."""
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._kernels.clear()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Lightning (and Fabric) wrap the optimizer in a subclass of its class made on the
        fly: its methods are made to run on the optimizer itself, and under Lightning's
        trainer the optimizer learns that it drives it (see trainers.py)."""
        super().__init_subclass__(**kwargs)
        wrapper = lightning_wrapper(cls)
        wrapped = None if wrapper is None else wrapper.__dict__.get("_optimizer")
        if isinstance(wrapped, InBackward):
            run_on_wrapped(cls, wrapped, _WRAPPED_API)
            if closure_driven(wrapper):
                wrapped._lightning_wrapper = weakref.ref(wrapper)
                wrapped._clipping = TrainerClipping()  # a new run learns it again

    @property
    def _lightning(self) -> bool:
        """Lightning's trainer drives this optimizer now (it is fitting)."""
        wrapper = None if self._lightning_wrapper is None else self._lightning_wrapper()
        return wrapper is not None and lightning_running(wrapper)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True for torch's ``GradScaler.step`` only, which then calls ``step(grad_scaler=...)``
        and is refused clearly (steps in backward used scaled gradients); False for everyone
        else asking (Lightning asks it before clipping, e.g. under bf16-mixed)."""
        return called_by_grad_scaler()

    # ------------------------------------------------------------------ torch.optim API
    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        """Steps what backward left: the gradients it held (accumulated micro-batches, a
        trainer's first step, gradients a trainer clips), exactly as the plain optimizer's
        ``step()`` would; nothing when backward stepped everything. After :meth:`remove`, an
        ordinary step.

        Args:
            closure: run once, before stepping, and its result returned (as torch optimizers
                do; Lightning runs the last micro-batch's forward and backward in it, and the
                backward steps as usual).

        Raises:
            UnsupportedModelError: with a ``GradScaler``, or when a closure-driven loop
                (Lightning) ran a backward that stepped outside the closure.
        """
        # torch passes grad_scaler=...; announced: it will set grad_scale/found_inf instead
        if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:
            raise UnsupportedModelError(
                "InBackward cannot be used with torch.amp.GradScaler: it steps each parameter "
                "during backward, before the scaler can unscale the gradients or skip a step "
                "with inf/nan, so the parameters were just updated with *scaled* gradients. "
                "Train with bfloat16 autocast instead (no loss scaling needed), or use the "
                "ordinary optimizer with the scaler."
            )
        if self._callback_queued and current_graph_task_id() == -1:
            self._drop_failed_backward()  # a backward raised: its end never came
        if not self._hooked:
            return self.inner.step(closure)
        self._accelerate |= accelerate_caller() is not None
        result = None
        if closure is not None:
            if self._stepped_outside_closure and not self._lightning:
                self._stepped_outside_closure = False
                raise UnsupportedModelError(
                    "InBackward.step(closure): a backward before this step, outside the "
                    "closure, already stepped parameters in backward. A loop that runs the "
                    "last micro-batch inside step(closure) (Lightning) must run the others' "
                    "backward without stepping: wrap them in `with opt.accumulate():`."
                )
            self._in_step = True
            try:
                with torch.enable_grad():
                    result = closure()
            finally:
                self._in_step = False
        held = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        try:
            self._clipping.end_of_step(held)  # (before the step frees them)
            if held and self.clip_grad_norm is not None:
                self._clip_held(held)
            self.step_bucket(held, in_backward=False)
        finally:
            self._awaiting_step = self._stepped_outside_closure = False
        return result

    def _clip_held(self, held: list[Tensor]) -> None:
        """The user's clipping (``clip_grad_norm=``) of gradients held for ``step()``: all of
        them are there, so exactly, as ``clip_grad_norm_(params, clip_grad_norm)``; their norm
        is recorded (``last_grad_norm``) and sets the next approximate factor."""
        self._stepped.begin(-2)  # (a step outside backward: its own record)
        self._stepped.record(held, [p.grad for p in held])
        total = self.last_grad_norm
        coef = clip_factor(self.clip_grad_norm, total)
        scale_grads([p.grad for p in held], coef)
        self._approx_coef = coef

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are freed after their step; this clears any left by :meth:`accumulate`
        or held for ``step()`` (a loop that skips this step)."""
        self.inner.zero_grad(set_to_none=set_to_none)
        self._awaiting_step = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved from this facade or from the plain optimizer."""
        self.inner.load_state_dict(state_dict)
        self._share()

    def state_dict(self) -> dict[str, Any]:
        """The plain optimizer's state dict (loadable by either)."""
        if accelerate_caller() == "__init__":  # Accelerator.prepare wraps it (each run)
            self._accelerate, self._clipping = True, TrainerClipping()
            if self._hooked:
                _guard_accelerate()  # (imported by now)
        return self.inner.state_dict()

    # ------------------------------------------------------------------ extras
    @contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (micro-batches before the last);
        the next backward outside steps with the accumulated gradients.

        Raises:
            UnsupportedModelError: with ``ddp=``; use DDP's ``ddp.no_sync()`` instead, which
                also skips the all-reduce of the micro-batches before the last.
        """
        if self._ddp is not None:
            raise UnsupportedModelError(
                "InBackward(ddp=...).accumulate(): use DDP's own `with ddp.no_sync():` for the "
                "micro-batches before the last; it skips their all-reduce as well, and the "
                "next backward outside it steps with the accumulated gradients."
            )
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def clipped_backward(self, loss: Tensor, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``loss.backward()`` with global gradient-norm clipping, exactly as
        ``clip_grad_norm_(params, max_norm, norm_type)`` before an ordinary step.

        Two backward passes over the graph: the first only measures each gradient's norm (and
        frees it at once), the second scales every gradient by ``max_norm / (norm + 1e-6)``
        (at most 1) before its step. Costs one extra backward; use it only when asked for.

        Returns:
            The total gradient norm (before clipping), as ``clip_grad_norm_`` returns it.
        """
        if not _positive(max_norm) or not _positive(norm_type, allow_inf=True):
            raise LeanpropValueError(
                f"InBackward.clipped_backward() got max_norm={max_norm!r}, norm_type="
                f"{norm_type!r}; max_norm must be a positive, finite number and norm_type a "
                "positive number (or inf)."
            )
        if self._accumulating:
            raise UnsupportedModelError(
                "InBackward.clipped_backward() inside accumulate(): clip in the last "
                "micro-batch's backward, outside the context."
            )
        if self._ddp is not None:
            raise UnsupportedModelError(
                "InBackward(ddp=...).clipped_backward() is not supported: its two backward "
                "passes would all-reduce twice. Use InBackward(..., clip_grad_norm=max_norm) "
                "(previous step's global norm, computed from the all-reduced gradients)."
            )
        self._norm_type = float(norm_type)
        self._stepped.wanted()  # (a loop that clips reads the norm: kept, as by a read)
        self._measuring = {}
        # only these (other leaves get their gradient once, in the second pass); under FSDP2
        # the graph's leaves are the unsharded parameters, which its hooks reduce: all of them
        mine = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        try:
            loss.backward(retain_graph=True, inputs=None if self._unit_of else mine)
            norms = self._measuring
        finally:
            self._measuring = None
        total = norm_in_order(norms, self.param_groups, norm_type, loss.device)
        coef = clip_factor(max_norm, total)
        self._coef = coef
        try:
            loss.backward()
        finally:
            self._coef = None
        return total

    def remove(self) -> None:
        """Remove the hooks: the model trains ordinarily and this is a plain optimizer again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._ddp is not None:
            self._ddp.restore()
            self._ddp = None
        for g in self.param_groups:
            for p in g["params"]:
                if _owner(p) is self:
                    del _OWNER[p]
        _guard_clipping(False)

    def _lightning_done(self) -> bool:
        """Lightning's trainer drove this optimizer and is no longer running it, no backward
        is running and no gradient is held: a new run's optimizer (``configure_optimizers``
        called again: a second ``fit``, after ``lr_find``) may take its parameters."""
        params = [p for g in self.param_groups for p in g["params"]]
        return (
            self._lightning_wrapper is not None
            and not self._lightning
            and not self._callback_queued
            and all(p.grad is None for p in params)
        )

    @property
    def _hooked(self) -> bool:
        return bool(self._handles) or self._ddp is not None

    @property
    def ddp_bucket_bytes(self) -> int:
        """With ``ddp=``: bytes of DDP bucket memory held now (0 between backward passes)."""
        return 0 if self._ddp is None else self._ddp.held_bytes()

    @property
    def ddp_bucket_peak_bytes(self) -> int:
        """With ``ddp=``: most bytes of DDP bucket memory held at once in the last backward (all
        buckets, for the moment of DDP's end-of-backward bookkeeping; see ``ddp_bucket_bytes``
        for what is held while backward computes)."""
        return 0 if self._ddp is None else self._ddp.peak_bytes

    # ------------------------------------------------------------------ hooks
    def _positions(
        self, group_params: list[list[Tensor]], params: list[Tensor]
    ) -> dict[int, tuple[int, int]]:
        """``id(p) -> (group, position in it)`` for ``params``; the map is built once and
        rebuilt when a lookup finds the groups changed (parameters added, moved, replaced)."""
        where = self._where
        try:  # (indices from the map are never negative)
            for p in params:
                group, at = where[id(p)]
                if group_params[group][at] is not p:
                    break
            else:
                return where
        except (KeyError, IndexError):
            pass
        self._where = {id(p): (i, j) for i, ps in enumerate(group_params) for j, p in enumerate(ps)}
        return self._where

    @property
    def last_grad_norm(self) -> Tensor | None:
        """Global 2-norm of the gradients of the last backward (as it produced them, before
        any clipping), over the parameters it stepped; None before any.

        Raises:
            UnsupportedModelError: built with ``record_norms=False``, or with the default and
                the norms were not read after the first backward (no longer kept).
        """
        if not self._stepped.keep:
            raise _norms_not_kept(self, "last_grad_norm")
        self._stepped.read()
        return self._stepped.total(self.param_groups)

    def _before_accumulate(self, grad: Tensor) -> None:
        """Before a gradient is accumulated: the first time in a backward, queue its end (also
        inside accumulate()). If an earlier backward's end never came (it raised), drop what it
        left first, so this backward does not add to it. (A backward run from inside the queued
        one, e.g. by a reentrant checkpoint, is part of it.)"""
        task = current_graph_task_id()
        if task in (self._queued_task, self._nested_task):
            return
        if inside_function_backward():  # a backward run from inside another one's
            self._nested_task = task
            return
        if self._callback_queued:
            self._drop_failed_backward()
        self._queue_end(task)

    def _queue_end(self, task: int) -> None:
        """Step what is left when the backward ``task`` ends."""
        _guard_accelerate()  # (accelerate imported since: guarded before a clip calls it)
        self._callback_queued = True
        self._queued_task = task
        queue_callback(self.end_backward)

    def _drop_failed_backward(self, warn: bool = True) -> None:
        """Forget a backward that raised: its unstepped gradients are dropped."""
        dropped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p in dropped:
            p.grad = None
        self._ready.clear()
        self._ready_bytes = 0
        self._unit_ready.clear()
        self._callback_queued = False
        self._queued_task = -1
        if dropped and warn:
            warnings.warn(
                f"InBackward: an earlier backward raised before it ended; the {len(dropped)} "
                "gradient(s) it left unstepped were dropped (buckets it stepped before the "
                "error stay stepped). This step uses only the gradients of backward passes "
                "after it.",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ stepping interface
    # used by the hooks here and by the steppers of optim/distributed.py (DDP's comm hook)

    def begin_backward(self, task: int | None = None) -> None:
        """A backward (``task``, default: the running one) accumulates gradients of these
        parameters (also inside accumulate()): the last one's gradient norms are over.
        (Approximate clipping, also switched on after construction, reads them each time.)"""
        if self.clip_grad_norm is not None:
            self._stepped.wanted()
            if not self._stepped.keep:  # (set after construction; nothing is stepped yet)
                raise LeanpropValueError(
                    "InBackward(record_norms=False) with clip_grad_norm set: approximate "
                    "clipping uses the recorded norms of the previous backward; build it with "
                    "record_norms left at its default (or True)."
                )
        self._stepped.begin(current_graph_task_id() if task is None else task)

    def _holds(self, task: int, p: Tensor) -> bool:
        """Whether backward ``task`` leaves its gradients for ``step()`` instead of stepping
        them: a micro-batch before the last, or a trainer's step whose clipping is unknown
        (its first) or exact (a finite ``clip_grad_norm_``/``clip_grad_value_`` by the
        trainer, which needs every gradient). Decided at the backward's first gradient."""
        if task != self._decided_task and task != self._nested_task:
            if self._awaiting_step:
                self._drop_failed_backward(warn=False)
                self._awaiting_step = False
                raise UnsupportedModelError(
                    "InBackward: the previous backward's gradients were held for step() (a "
                    "training loop driven by accelerate or Lightning: its first step, or one "
                    "whose gradients it clips), but step() was not called before this backward. "
                    "Call optimizer.step() after each backward (and zero_grad()), as with any "
                    "optimizer; the held gradients were dropped."
                )
            self._decided_task = task
            why = self._why_hold(p)
            self._holding = why is not None
            self._awaiting_step = why == "step" and not self._accumulating
        return self._holding or self._accumulating

    def _unsynced_ranks(self, p: Tensor) -> bool:
        """Whether ``p``'s gradient may still be averaged over ranks after backward (DDP
        without ``ddp=``): several ranks, not ``ddp=False``, not an FSDP2 shard (whose
        gradient is reduced before this hook)."""
        if self._ddp_off or not (dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size() > 1 and not self._unit_of and not is_dtensor(p)

    def _why_hold(self, p: Tensor) -> str | None:
        """None: step in this backward; "micro-batch": one before the last; "step": the
        trainer's step must see the gradients (its clipping is unknown or exact)."""
        if self._measuring is not None or self._coef is not None:
            return None  # clipped_backward's own passes
        syncs = accelerate_syncs()
        if syncs is False and not self._accelerate and not self._lightning:
            raise UnsupportedModelError(
                "InBackward: accelerate says this micro-batch does not synchronise gradients "
                "(an Accelerator's accumulate()), but this optimizer was not wrapped by "
                "Accelerator.prepare() with device placement on (the default), the moment "
                "leanprop learns that accelerate drives it; stepping here would step a "
                "micro-batch before the last. Prepare it with device_placement=True. If no "
                "Accelerator drives this loop, its state is left from an earlier one: reset it "
                "with accelerate.state.GradientState._reset_state()."
            )
        lightning = self._lightning
        driven = lightning or self._accelerate
        if (lightning and not self._in_step) or (self._accelerate and syncs is False):
            return "micro-batch"
        if self._ddp is None and self._unsynced_ranks(p):
            if not driven:
                raise UnsupportedModelError(
                    "InBackward: a backward in a process group of "
                    f"{dist.get_world_size()} ranks, without ddp=: under "
                    "DistributedDataParallel the gradients are averaged over the ranks after "
                    "this hook, so stepping here would use this rank's own gradient. Pass the "
                    "DDP module: InBackward(ddp.parameters(), ..., ddp=ddp) (each bucket is "
                    "stepped once averaged). If these parameters are not synchronised across "
                    "ranks (each rank trains its own), pass ddp=False."
                )
            return "step"  # the trainer steps after DDP averaged the gradients
        if not driven or self.clip_grad_norm is not None:
            return None  # (approximate clipping: the user's choice stands in for the trainer's)
        if not self._clipping.known or self._clipping.kind is not None:
            return "step"
        wrapper = None if self._lightning_wrapper is None else self._lightning_wrapper()
        if lightning and wrapper is not None and lightning_sees_gradients(wrapper):
            return "step"  # its on_before_optimizer_step hook sees the gradients
        return None

    def _on_ready(self, p: Tensor) -> None:
        if p.grad is None:
            return
        task = current_graph_task_id()
        self.begin_backward(task)
        if self._holds(task, p):
            return
        if task == self._nested_task:
            self._drop_failed_backward(warn=False)  # none of its gradients may stay
            raise UnsupportedModelError(
                "InBackward: a backward run inside another backward (checkpoint(use_reentrant="
                "True)) accumulated gradients of its parameters. Stepping there would step them "
                "once per inner backward, each time with part of the gradient. Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (HF: "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False}))."
            )
        if self._measuring is not None:  # first pass of clipped_backward: norm only
            self._measuring[id(p)] = foreach_norms([p.grad], self._norm_type)[0]
            p.grad = None
            return
        if not self._callback_queued:  # (FSDP2's sharded parameters fire no pre-hook)
            self._queue_end(task)
        unit = self._unit_of.get(id(p))
        if unit is not None:  # FSDP2: step the unit once all its gradients are reduced
            waiting = self._unit_ready.setdefault(unit, [])
            waiting.append(p)
            if len(waiting) == self._unit_size[unit]:
                self.step_bucket(self._unit_ready.pop(unit))
            return
        self._ready.append(p)
        self._ready_bytes += p.grad.numel() * p.grad.element_size()
        if self._ready_bytes >= self.bucket_bytes:
            self._step_ready()

    def end_backward(self) -> None:
        """The backward ended: step what is left waiting, and set the next approximate clip
        factor from this backward's norms."""
        self._callback_queued = False
        self._queued_task = -1
        if self._awaiting_step:  # held for a trainer's step(): what it does to them is seen there
            self._clipping.snapshot([p for g in self.param_groups for p in g["params"]])
        self._step_ready()
        for waiting in self._unit_ready.values():  # units with parameters left unused
            self.step_bucket(waiting)
        self._unit_ready.clear()
        if self._stepped.task != current_graph_task_id() or not self._stepped.stepped:
            return  # stepped nothing (autograd.grad, accumulate()): the clip factor stays
        norm = self.last_grad_norm if self.clip_grad_norm is not None else None
        self._approx_coef = None if norm is None else clip_factor(self.clip_grad_norm, norm)

    def _step_ready(self) -> None:
        """Step exactly the parameters whose gradient is final, then free their gradients."""
        self.step_bucket(self._ready)
        self._ready.clear()
        self._ready_bytes = 0

    def step_bucket(self, params: list[Tensor], in_backward: bool = True) -> None:
        """One inner-optimizer step restricted to ``params``, then free their gradients.

        In backward, their norms are recorded first (``last_grad_norm``, and what
        ``clip_grad_norm_(params, inf)`` reads), then the clipping mode scales them; held
        gradients stepped by ``step()`` are stepped as they are (as the plain optimizer).

        Args:
            params: parameters whose ``.grad`` is final (a bucket, an FSDP2 unit, a DDP
                bucket after its all-reduce, or the gradients held for ``step()``).
            in_backward: stepped during backward (not by ``step()``).
        """
        if not params:
            return
        grads = [p.grad for p in params]
        if in_backward:
            self._stepped.record(params, grads)
            self._stepped_outside_closure |= not self._in_step
            coef = self._coef
            if coef is None and self.clip_grad_norm is not None:
                coef = self._approx_coef
            if coef is not None:
                scale_grads(grads, coef)
        groups = self.param_groups
        saved = [g["params"] for g in groups]
        where = self._positions(saved, params)
        if self._kernels.step(params, where):
            for p in params:
                p.grad = None
            return
        subsets: list[list[Tensor]] = [[] for _ in groups]
        for p in sorted(params, key=lambda p: where[id(p)]):  # each group's own order
            subsets[where[id(p)][0]].append(p)
        try:
            for g, subset in zip(groups, subsets, strict=True):
                g["params"] = subset
            with torch.no_grad():
                self.inner.step()
        finally:
            for g, group_params in zip(self.param_groups, saved, strict=True):
                g["params"] = group_params
        for p in params:
            p.grad = None
