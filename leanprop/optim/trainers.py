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
  derives from the optimizer's class (``InBackward.__init_subclass__`` sees it); Lightning then
  runs the backward of the micro-batch that steps inside ``optimizer.step(closure)``, and the
  backward of the others outside it.
* **Clipping** (:class:`TrainerClipping`): what a trainer's ``clip_grad_norm_`` /
  ``clip_grad_value_`` calls asked for, learnt on a step whose gradients were held.

These read internals of other packages (accelerate's shared state, the frame of Lightning's
wrapper); each reader returns "unknown" where they are not there, and InBackward then holds the
gradients for ``step()``, which is always exact.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


def accelerate_syncs() -> bool | None:
    """Whether accelerate's current micro-batch synchronises gradients; None where no
    accelerate ``GradientState`` exists in this process (accelerate is not driving)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    if not shared:  # (an empty dict until an Accelerator or GradientState is made)
        return None
    return bool(shared.get("sync_gradients", True))


def called_from_accelerate(depth: int = 4) -> bool:
    """Whether one of the few callers above the caller is accelerate's optimizer wrapper."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == "accelerate.optimizer":
            return True
        frame = frame.f_back
    return False


def lightning_wrapped(cls: type) -> Any:
    """The optimizer that Lightning's ``LightningOptimizer`` is wrapping, when ``cls`` is the
    class it makes for the wrapper (``type("Lightning" + name, (LightningOptimizer, the
    optimizer's class), {})``, in ``LightningOptimizer.__init__``); else None."""
    if not any(
        c.__name__ == "LightningOptimizer" and c.__module__.split(".")[0].endswith("lightning")
        for c in cls.__mro__
    ):
        return None
    frame = sys._getframe(1)
    for _ in range(8):  # up to LightningOptimizer.__init__ (type() itself runs in C)
        if frame is None:
            return None
        wrapper = frame.f_locals.get("self")
        if wrapper is not None and type(wrapper).__name__ == "LightningOptimizer":
            return wrapper.__dict__.get("_optimizer")
        frame = frame.f_back
    return None


def run_on_wrapped(cls: type, wrapped: Any, names: tuple[str, ...]) -> None:
    """Make the wrapper class ``cls`` (one per wrapper) hand the methods and properties
    ``names`` to the wrapped optimizer: Lightning's wrapper copies none of its state, so they
    would otherwise run with the wrapper as ``self`` and set state the hooks never see."""
    for name in names:
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
    """What the caller does to the gradients between backward and ``step()``, learnt from its
    clipping calls on a step whose gradients were held: ``known`` once a step has shown it;
    ``kind`` None (no clipping: at most the norm is read), ``"norm"`` or ``"value"``."""

    known: bool = False
    kind: str | None = None
    seen: str | None = None  # the clipping asked for since the last step()

    def saw(self, kind: str) -> None:
        """A ``clip_grad_norm_`` with a finite max_norm (``"norm"``) or ``clip_grad_value_``
        (``"value"``) on held gradients."""
        self.seen = kind

    def end_of_step(self, held: bool) -> None:
        """``step()``: a step with held gradients shows what the caller does each step."""
        if held:
            self.known, self.kind = True, self.seen
        self.seen = None
