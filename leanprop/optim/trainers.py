"""What the training loop around an InBackward optimizer will do, as far as it can be known.

A step inside backward is only right for the backward of the last micro-batch of a step, when
nothing clips the gradients afterwards (or the clipping is the approximate one the user chose).
Trainers decide both outside the optimizer; this module reads what they expose:

* **accelerate** (HF ``Trainer``, ``Accelerator.accumulate``): ``Accelerator.prepare`` wraps
  the optimizer in an ``AcceleratedOptimizer``, which reads its ``state_dict()`` (and later
  calls its ``step()``) from accelerate's own code; the shared ``GradientState`` then says
  whether the current micro-batch synchronises gradients (``sync_gradients``), and the loop
  calls ``optimizer.step()`` after each micro-batch that does.
* **Lightning**: its ``LightningOptimizer`` wraps the optimizer in a class made on the fly that
  derives from the optimizer's class (``InBackward.__init_subclass__`` sees it); while its
  trainer fits, Lightning runs the backward of the micro-batch that steps inside
  ``optimizer.step(closure)``, and the backward of the others outside it. Fabric's wrapper is
  made the same way (it only needs the optimizer's own methods run on the optimizer).
* **Clipping** (:class:`TrainerClipping`): what the loop does to held gradients between
  backward and ``step()``: its ``clip_grad_norm_`` / ``clip_grad_value_`` calls, and any other
  change to them (seen from the gradients' versions).

These read internals of other packages (accelerate's shared state and wrapper frames,
Lightning's wrapper frame and trainer state). Where a reader cannot tell, InBackward either
holds the gradients for ``step()`` (always exact) or refuses with a clear error; the tests
against the real packages (tests/optim/test_trainers.py) pin what each reads.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


def accelerate_syncs() -> bool | None:
    """Whether accelerate's current micro-batch synchronises gradients; None where no
    accelerate ``GradientState`` exists in this process (accelerate is not driving)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    if not shared:  # (an empty dict until an Accelerator or GradientState is made)
        return None
    return bool(shared.get("sync_gradients", True))


def accelerate_caller(depth: int = 6) -> str | None:
    """Whether accelerate's optimizer wrapper is among the few callers above the caller:
    ``"__init__"`` when ``Accelerator.prepare`` is wrapping it (directly, or wrapping a wrapper
    of it), another of its functions' names (``"step"``), else None."""
    frame, found = sys._getframe(2), None
    for _ in range(depth):
        if frame is None:
            break
        if frame.f_globals.get("__name__") == "accelerate.optimizer":
            if frame.f_code.co_name == "__init__":
                return "__init__"
            found = found or frame.f_code.co_name
        frame = frame.f_back
    return found


def lightning_wrapper(cls: type) -> Any:
    """The wrapper instance when ``cls`` is the class Lightning makes for wrapping an
    optimizer (``type("Lightning" + name, (LightningOptimizer, the optimizer's class), {})`` in
    ``LightningOptimizer.__init__``, likewise Fabric's ``_FabricOptimizer``); else None. The
    wrapped optimizer is its ``_optimizer``."""
    names = ("LightningOptimizer", "_FabricOptimizer")
    ours = (c for c in cls.__mro__ if c.__module__.split(".")[0].endswith("lightning"))
    if not any(c.__name__ in names for c in ours):
        return None
    frame = sys._getframe(1)
    for _ in range(8):  # up to the wrapper's __init__ (type() itself runs in C)
        if frame is None:
            return None
        wrapper = frame.f_locals.get("self")
        if wrapper is not None and type(wrapper).__name__ in names:
            return wrapper
        frame = frame.f_back
    return None


def closure_driven(wrapper: Any) -> bool:
    """Whether ``wrapper`` is Lightning's (not Fabric's): its trainer runs the backward of the
    micro-batch that steps inside ``optimizer.step(closure)``."""
    return any(c.__name__ == "LightningOptimizer" for c in type(wrapper).__mro__)


def _module_and_trainer(wrapper: Any) -> tuple[Any, Any] | None:
    """The LightningModule and the trainer that own ``wrapper`` (None once gone or before
    they are attached)."""
    try:
        module = getattr(wrapper._strategy, "lightning_module", None)
    except (AttributeError, ReferenceError):  # (the strategy is gone, or not set yet)
        return None
    trainer = getattr(module, "_trainer", None)
    return None if trainer is None else (module, trainer)


def lightning_running(wrapper: Any) -> bool:
    """Whether a running Lightning trainer (fitting now) steps ``wrapper``'s optimizer."""
    owners = _module_and_trainer(wrapper)
    try:
        if owners is None or str(owners[1].state.status.value) != "running":
            return False
        return any(o is wrapper._optimizer for o in owners[1].strategy.optimizers)
    except AttributeError:  # (a trainer without that state: not one we know)
        return False


def lightning_sees_gradients(wrapper: Any) -> bool:
    """Whether the LightningModule or a callback of the trainer that owns ``wrapper``
    overrides ``on_before_optimizer_step``, the hook that sees the gradients before the step
    (logging their norms, changing them): they must be there then."""
    owners = _module_and_trainer(wrapper)
    if owners is None:
        return False
    from lightning.pytorch import Callback, LightningModule

    module, trainer = owners
    hook = "on_before_optimizer_step"
    overridden = getattr(type(module), hook) is not getattr(LightningModule, hook)
    base = getattr(Callback, hook)
    return overridden or any(getattr(type(c), hook) is not base for c in trainer.callbacks)


def run_on_wrapped(cls: type, wrapped: Any, names: tuple[str, ...]) -> None:
    """Make the wrapper class ``cls`` (one per wrapper) hand the methods and properties
    ``names`` to the wrapped optimizer, except those the wrapper defines itself: Lightning's
    and Fabric's wrappers share none of its state (Fabric copies it once), so they would
    otherwise run with the wrapper as ``self`` and set state the hooks never see."""
    own = {k for c in cls.__mro__ if not isinstance(wrapped, c) for k in vars(c)}
    for name in names:
        if name in own:
            continue
        if isinstance(getattr(type(wrapped), name), property):
            setattr(cls, name, property(lambda _, name=name: getattr(wrapped, name)))
        else:
            setattr(cls, name, getattr(wrapped, name))


def called_by_grad_scaler() -> bool:
    """Whether the caller of the caller is torch's ``GradScaler.step`` (which asks the
    optimizer's ``_step_supports_amp_scaling`` before handing it the scaler)."""
    import torch.amp.grad_scaler as grad_scaler

    frame = sys._getframe(2)
    return frame is not None and frame.f_code is grad_scaler.GradScaler.step.__code__


@dataclass
class TrainerClipping:
    """What the caller does to the gradients between backward and ``step()``, learnt on steps
    whose gradients were held: ``known`` once a step has shown it; ``kind`` None (nothing: at
    most the norm is read), ``"norm"`` or ``"value"`` (a clipping call), ``"other"`` (the
    gradients changed otherwise: a callback, a clip function the guard does not see)."""

    known: bool = False
    kind: str | None = None
    seen: str | None = None  # what was done since the last step()
    versions: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(p) -> grad

    def saw(self, kind: str) -> None:
        """A ``clip_grad_norm_`` with a finite max_norm (``"norm"``) or ``clip_grad_value_``
        (``"value"``) on held gradients."""
        self.seen = kind

    def snapshot(self, params: list[Tensor]) -> None:
        """The held gradients as backward left them (their tensors and versions)."""
        self.versions = {id(p): _identity(p.grad) for p in params if p.grad is not None}

    def refresh(self, params: list[Tensor]) -> None:
        """The guard read these held gradients' norm (torch multiplies them by 1 in place)."""
        for p in params:
            if id(p) in self.versions and p.grad is not None:
                self.versions[id(p)] = _identity(p.grad)

    def end_of_step(self, held: list[Tensor]) -> None:
        """``step()``: a step with held gradients shows what the caller does each step."""
        if held:
            changed = any(self.versions.get(id(p)) != _identity(p.grad) for p in held)
            self.known = True
            self.kind = self.seen or ("other" if changed else None)
        self.seen, self.versions = None, {}


def _identity(g: Tensor) -> tuple[int, int]:
    return id(g), g._version
