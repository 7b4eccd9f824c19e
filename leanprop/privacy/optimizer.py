"""DP-SGD's step: noise once on the clipped sum, average, step, account (:class:`DPOptimizer`)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._torch_compat import init_optimizer_hooks
from ..errors import LeanpropValueError, UnsupportedModelError, checked_number
from ..optim import InBackward
from ..per_sample.capture import PerSample
from .accounting import make_accountant


def gaussian_noise(
    std: float, like: Tensor, generator: torch.Generator | None, secure_mode: bool
) -> Tensor:  # fmt: skip
    """Gaussian noise ``N(0, std²)`` of ``like``'s shape, dtype and device.

    Args:
        std: the standard deviation (0: zeros).
        like: the tensor to shape it as.
        generator: the random generator (None: torch's default one; not with
            ``secure_mode``).
        secure_mode: the sum of four draws halved (Opacus' defence against floating-point
            attacks, arXiv:2107.10138 section 5.1), from a generator seeded afresh from the
            operating system's entropy.
    """
    if std == 0:
        return torch.zeros_like(like)
    if not secure_mode:
        return torch.normal(0.0, std, like.shape, generator=generator, dtype=like.dtype,
                            device=like.device)  # fmt: skip
    seeded = torch.Generator(device=like.device)
    seeded.manual_seed(secrets.randbits(63))
    total = torch.zeros_like(like)
    for _ in range(4):
        total += torch.normal(0.0, std, like.shape, generator=seeded, dtype=like.dtype,
                              device=like.device)  # fmt: skip
    return total / 2


def _all_reduced(t: Tensor, op: Any = None) -> Tensor:
    """``t`` summed (or reduced by ``op``) over the process group, in place."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op)
    return t


class DPOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer for DP-SGD on the gradients a :func:`clip_per_sample` context left.

    ``step()`` replaces each parameter's gradient (the clipped sum of the ``k`` backward passes
    since the gradients were last zeroed) by ``(clipped sum + N(0, σ² C²)) /
    (expected_batch_size · k)`` (no division for ``loss_reduction="sum"``), steps the wrapped
    optimizer, and tells the accountant ``sample_rate · k``. ``σ`` is ``noise_multiplier`` and
    ``C`` the clipping threshold (per-parameter thresholds: their root sum of squares), both as
    in Opacus, so that the same settings give the same privacy.

    It refuses to step a gradient the clipping did not leave (a backward outside the context,
    a gradient changed after it), where the noise would not make it private, and loss scaling
    (``GradScaler``: the scaled per-sample gradients would be clipped). A parameter without a
    gradient (an empty Poisson batch: no backward) gets the noise alone.

    Example:
        >>> import torch, leanprop
        >>> model = torch.nn.Linear(3, 2)
        >>> clip = leanprop.clip_per_sample(model, max_grad_norm=1.0)
        >>> opt = leanprop.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), clip,
        ...                            noise_multiplier=1.0, expected_batch_size=5)
        >>> with clip:
        ...     model(torch.randn(5, 3)).square().mean().backward()
        >>> opt.step(); opt.zero_grad()

    Args:
        optimizer: any ``torch.optim`` optimizer over the model's parameters (not one that
            steps inside backward, such as :class:`leanprop.InBackward`).
        clip: the :func:`clip_per_sample` context the backward passes run in.
        noise_multiplier: ``σ``, the noise's standard deviation relative to ``C``.
        expected_batch_size: the batch size averaged by (Poisson sampling: ``sample_rate ·
            len(dataset)``, not each batch's size). Required for ``loss_reduction="mean"``,
            ignored for ``"sum"``.
        sample_rate: the probability of each example in a batch; required with an accountant.
        accountant: ``"rdp"``, ``"prv"``, ``"gdp"`` (Opacus' accountants), an object with
            ``step(noise_multiplier=, sample_rate=)`` and ``get_epsilon(delta)``, or None.
        generator: the noise's random generator (None: torch's default one).
        secure_mode: see :func:`gaussian_noise`. torch's generators are not cryptographic
            random number generators; this seeds one afresh from the OS for each step and
            sums four draws, which resists the known floating-point attacks, but it is not a
            certified secure RNG.
        distributed: data parallel over a process group, without DDP (whose all-reduce would
            add the unclipped gradients): each rank clips its own samples, ``step()`` adds
            the ranks' clipped sums and rank 0's noise (once), and every rank steps with the
            same result. ``expected_batch_size`` is then the batch over all ranks. The
            parameters are broadcast from rank 0 at construction.

    Raises:
        LeanpropValueError: a bad argument (at construction).
        UnsupportedModelError: at ``step()``, a gradient the clipping did not leave, or loss
            scaling.
    """

    _step_supports_amp_scaling = True  # (GradScaler then hands itself to step: refused)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        clip: PerSample,
        *,
        noise_multiplier: float,
        expected_batch_size: int | None = None,
        sample_rate: float | None = None,
        accountant: str | Any | None = None,
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        distributed: bool = False,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, InBackward):
            raise LeanpropValueError(
                f"DPOptimizer wraps a torch.optim optimizer that steps after backward; got "
                f"{type(optimizer).__name__}. (An optimizer stepping inside backward would step "
                "the clipped gradients without noise.)"
            )
        clipping = clip.clipping if isinstance(clip, PerSample) else None
        if clipping is None:
            raise LeanpropValueError(
                "DPOptimizer needs the context made by leanprop.clip_per_sample(model, "
                f"max_grad_norm) that the backward passes run in; got {type(clip).__name__}"
                f"{' without clipping' if isinstance(clip, PerSample) else ''}."
            )
        init_optimizer_hooks(self)
        self.optimizer, self.clip = optimizer, clip
        self.noise_multiplier = checked_number(
            "DPOptimizer", "noise_multiplier", noise_multiplier, zero_ok=True
        )
        self.expected_batch_size: int | None = None
        if clipping.reduction == "mean":
            if expected_batch_size is None:
                raise LeanpropValueError(
                    "DPOptimizer needs expected_batch_size for a mean-reduced loss: the batch "
                    "size averaged by (with Poisson sampling, sample_rate * len(dataset))."
                )
            batch = checked_number("DPOptimizer", "expected_batch_size", expected_batch_size,
                                   integer=True)  # fmt: skip
            self.expected_batch_size = int(batch)
        if isinstance(accountant, str):
            accountant = make_accountant(accountant)
        if accountant is not None:
            if sample_rate is None:
                raise LeanpropValueError(
                    "DPOptimizer got an accountant but no sample_rate; pass the probability of "
                    "each example in a batch (expected batch size / len(dataset))."
                )
            sample_rate = checked_number("DPOptimizer", "sample_rate", sample_rate, at_most=1.0)
        self.accountant, self.sample_rate = accountant, sample_rate
        if secure_mode and generator is not None:
            raise LeanpropValueError(
                "DPOptimizer got a generator with secure_mode=True; the secure mode seeds its "
                "own from the operating system for each step. Pass one or the other."
            )
        self.generator, self.secure_mode = generator, bool(secure_mode)
        if clipping.per_param is not None:
            self.max_grad_norm = math.sqrt(sum(c**2 for c in clipping.per_param.values()))
        else:
            self.max_grad_norm = float(clipping.max_norm)
        self._names = {p: k for k, p in clip.model.named_parameters()}
        in_group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if in_group and not distributed:
            raise LeanpropValueError(
                "DPOptimizer runs in a process group of several ranks: pass distributed=True, "
                "so that the clipped sums of all ranks are added and the noise is added once "
                "(each rank would otherwise step with its own noised gradients)."
            )
        if distributed and not in_group:
            raise LeanpropValueError(
                "DPOptimizer(distributed=True) needs an initialized process group of several "
                "ranks (torch.distributed.init_process_group)."
            )
        self.distributed = bool(distributed)
        if self.distributed:  # the replicas start equal (as DDP makes them)
            with torch.no_grad():
                for p in self._params():
                    dist.broadcast(p, src=0)

    # the wrapped optimizer's state is this one's (schedulers, state_dict, trainers)
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's, with the accountant's history (``"dp_accountant"``), so
        that a resumed run goes on spending from where it was."""
        state = self.optimizer.state_dict()
        if self.accountant is not None and hasattr(self.accountant, "state_dict"):
            state["dp_accountant"] = self.accountant.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        accountant = state_dict.pop("dp_accountant", None)
        if accountant is not None:
            if self.accountant is None or not hasattr(self.accountant, "load_state_dict"):
                raise LeanpropValueError(
                    "DPOptimizer.load_state_dict: the state holds an accountant's history, and "
                    "this optimizer has no accountant to load it into; pass the same accountant "
                    "as the run that saved it."
                )
            self.accountant.load_state_dict(accountant)
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Set the gradients to None (always: a gradient zeroed in place is not one the
        clipping left, and the next clipped backward would refuse it)."""
        self.optimizer.zero_grad(set_to_none=True)

    def __repr__(self) -> str:
        return f"DPOptimizer({self.optimizer!r})"

    def _params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _iterations(self) -> int:
        """``k``: the clipped backward passes the gradients add up (1 for none: an empty
        Poisson batch)."""
        return max([self.clip.clipped_backwards_in(p) for p in self._params()] + [1])

    def noise_and_average(self) -> int:
        """Replace each gradient by its noised average (what :meth:`step` does before the
        wrapped optimizer steps); returns ``k``."""
        params = self._params()
        held = self.clip.holds_clipped_grad
        unclipped = [self._names.get(p, "?") for p in params if p.grad is not None and not held(p)]
        if self.distributed and _all_reduced(torch.tensor(float(len(unclipped)))) and not unclipped:
            unclipped = ["(another rank's)"]  # every rank refuses, none waits for the others
        if unclipped:
            raise UnsupportedModelError(
                f"DPOptimizer: the gradients of {unclipped[:5]} were not left by per-sample "
                "clipping (a backward outside the clipping, or a gradient changed after it); "
                "adding noise would not make them private. Run each forward and backward with "
                "clipping on, and zero the gradients after each step."
            )
        k = self._iterations()
        if self.distributed:  # every rank averages by the same count
            k = int(_all_reduced(torch.tensor(float(k)), dist.ReduceOp.MAX))
        divisor = self.expected_batch_size * k if self.expected_batch_size else 1.0
        std = self.noise_multiplier * self.max_grad_norm
        noise_here = not self.distributed or dist.get_rank() == 0  # (noise once, not per rank)
        for p in params:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            # (the noise's own buffer takes the sum and the average: no temporaries, the same
            # values, addition is commutative; not where .grad has another memory layout)
            fresh = noise_here and grad.is_contiguous()
            if fresh:
                grad = gaussian_noise(std, grad, self.generator, self.secure_mode).add_(grad)
            elif noise_here:
                grad = grad + gaussian_noise(std, grad, self.generator, self.secure_mode)
            if self.distributed:  # the clipped sums of every rank's samples, and the noise
                grad = _all_reduced(grad)
            p.grad = grad.div_(divisor) if fresh else grad / divisor
        return k

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None
    ) -> Any:
        """Noise, average and step (``closure``: runs the forward and backward first)."""
        if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:
            raise UnsupportedModelError(
                "DPOptimizer: loss scaling (GradScaler) scales each sample's gradient before it "
                "is clipped, so clipping would bound the scaled gradients. Train in float32 or "
                "under bf16 autocast without a GradScaler."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        k = self.noise_and_average()
        self.optimizer.step()
        if self.accountant is not None:
            self.accountant.step(
                noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate * k
            )
        return loss

    def epsilon(self, delta: float) -> float:
        """The privacy spent so far at ``delta``, from the accountant."""
        if self.accountant is None:
            raise LeanpropValueError(
                "DPOptimizer has no accountant; pass accountant='rdp' (or 'prv', 'gdp') and "
                "sample_rate to track the privacy spent."
            )
        return float(self.accountant.get_epsilon(delta))
