"""An Opacus-style facade: run an Opacus training loop on leanprop with an import change.

    from leanprop.compat.opacus import PrivacyEngine

    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader,
        noise_multiplier=1.1, max_grad_norm=1.0,
    )
    for x, y in train_loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()   # clipped per sample, in this one backward
        optimizer.step()                    # noise, average, step, accounting
    privacy_engine.get_epsilon(delta=1e-5)

What differs from Opacus:

* ``make_private`` returns the module itself (hooked for clipping until it is garbage
  collected), not a ``GradSampleModule`` wrapper; no ``p.grad_sample`` is ever formed. Each
  backward through the model leaves the clipped sum in ``p.grad`` (Opacus keeps it in
  ``p.summed_grad``); ``optimizer.step()`` noises and averages it as Opacus does.
* Every ``grad_sample_mode`` computes the same (leanprop's one-backward clipping), except
  ``"ghost"``, whose changed API (a wrapped criterion, four return values) is not offered: drop
  the argument and the criterion.
* Clipping ``"flat"`` and ``"per_layer"`` (a list of thresholds, one per trainable parameter);
  not ``"adaptive"`` or ``"automatic"``. Data parallel as with Opacus' hooks: the model
  wrapped in ``DifferentiallyPrivateDistributedDataParallel`` (``DPDDP``, from here or from
  Opacus), whose ``data_loader.dataset`` is the whole dataset (each rank's loader takes its
  share, e.g. with a ``DistributedSampler``; Poisson sampling gives each rank its share of the
  indices); the optimizer adds the ranks' clipped sums and rank 0's noise once per step, and
  averages by the expected batch of all ranks. Torch's ``DistributedDataParallel`` is refused
  (its all-reduce would add the unclipped gradients; Opacus takes it only with ghost
  clipping). No ``secure_mode`` with torchcsprng (``secure_mode=True`` uses
  :func:`leanprop.privacy.gaussian_noise`'s secure mode for the noise; the Poisson sampling
  uses the data loader's generator).
* The model is checked when its backward runs (BatchNorm in training mode is refused then),
  not by Opacus' ``ModuleValidator`` up front; any model :func:`leanprop.per_sample` supports
  works (parameters of modules without a leanprop rule go through the ``torch.func``
  fallback, as in the BackPACK facade).
* Opacus' ``BatchMemoryManager`` works (it only calls ``optimizer.signal_skip_step``).
* Without leanprop's op interception (a facade's hooks stay on the model, so the scoped
  interception of :func:`leanprop.clip_per_sample` is not there), the batch is not followed
  op by op: a parameter broadcast over the batch (a position embedding looked up with ids of
  shape ``[1, T]``, as HF GPT-2 does) is refused, dropout inside a module that goes through
  the ``torch.func`` fallback is not replayed (refused by the sum check), and an op that mixes
  samples is not detected (as in Opacus). :func:`leanprop.clip_per_sample` has none of these
  limits.
* A forward of the model with autograd on between a loss's forward and its backward (a
  validation forward not under ``torch.no_grad()``) is refused at that backward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ...errors import LeanpropValueError
from ...per_sample.capture import PerSample
from ...privacy.accounting import make_accountant, noise_multiplier_for
from ...privacy.clip import clipping_of, refuse_distributed
from ...privacy.optimizer import DPOptimizer
from ...privacy.sampling import poisson_loader
from .distributed import DPDDP, DifferentiallyPrivateDistributedDataParallel, is_dpddp

__all__ = ["DPDDP", "DifferentiallyPrivateDistributedDataParallel", "PrivacyEngine"]

_DISTRIBUTED = (
    "Wrap the model on each rank in DifferentiallyPrivateDistributedDataParallel (from "
    "leanprop.compat.opacus, or Opacus' own) instead, as for Opacus' hooks: each rank clips its "
    "own samples and the optimizer adds the ranks' clipped sums and the noise once."
)

# module -> (its clipping context, the hook through which it owns it)
_MADE_PRIVATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_LOADER_OPTIONS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
    "multiprocessing_context", "prefetch_factor", "persistent_workers",
)  # fmt: skip


class FacadeOptimizer(DPOptimizer):
    """:class:`leanprop.DPOptimizer` with Opacus' optimizer interface: ``original_optimizer``,
    ``signal_skip_step`` (virtual steps: a skipped step keeps accumulating, and the
    ``zero_grad`` after it keeps the gradients), ``max_grad_norm``, ``expected_batch_size``,
    and Opacus' count of accumulated iterations: the backward passes since the last
    ``zero_grad`` (skipped steps' included), which Opacus averages and accounts by."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip_next = False
        self._last_skipped = False
        self._zeroed_at = self.clip.clipped_backwards

    def _iterations(self) -> int:
        # the backward passes since optimizer.zero_grad(), but no more than .grad holds (the
        # model's zero_grad() clears it as well)
        return max(1, min(self.clip.clipped_backwards - self._zeroed_at, super()._iterations()))

    @property
    def original_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """The next ``step()`` only accumulates (Opacus' virtual steps)."""
        self._skip_next = do_skip

    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        if self._skip_next and grad_scaler is None:
            if closure is not None:
                with torch.enable_grad():
                    closure()
            self._skip_next, self._last_skipped = False, True
            return None
        self._last_skipped = False
        return super().step(closure, grad_scaler)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zeroed_at = self.clip.clipped_backwards
        if not self._last_skipped:
            super().zero_grad(set_to_none)


class PrivacyEngine:
    """Opacus' ``PrivacyEngine`` on leanprop (see the module's docstring for the differences).

    Args:
        accountant: ``"prv"`` (Opacus' default), ``"rdp"`` or ``"gdp"`` (Opacus' accountants).
        secure_mode: noise by :func:`leanprop.privacy.gaussian_noise`'s secure mode.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False) -> None:
        self.accountant = make_accountant(accountant)
        self.secure_mode = bool(secure_mode)
        self._mechanism = accountant

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float | list[float],
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        **kwargs: Any,
    ) -> tuple[nn.Module, FacadeOptimizer, DataLoader]:
        """Return ``(module, optimizer, data_loader)`` for private training, as Opacus does:
        the module clips per sample in backward, the optimizer noises, averages by the
        expected batch size and accounts, the data loader samples batches by Poisson sampling
        (``poisson_sampling=True``) at ``1 / len(data_loader)``.

        Args:
            module: the model (returned itself, hooked for clipping for its life).
            optimizer: its optimizer (wrapped).
            data_loader: the training data (its dataset, batch count and worker options).
            noise_multiplier: the noise's standard deviation relative to ``max_grad_norm``.
            max_grad_norm: the clipping threshold, or a list of one per trainable parameter
                with ``clipping="per_layer"``.
            batch_first: whether inputs hold the batch in dimension 0 (else 1).
            loss_reduction: ``"mean"`` or ``"sum"``, how the loss reduces over the samples.
            poisson_sampling: replace the data loader by a Poisson-sampled one.
            clipping: ``"flat"`` or ``"per_layer"``.
            noise_generator: the noise's random generator.
            grad_sample_mode: accepted (every mode computes the same), except ``"ghost"``.

        Raises:
            LeanpropValueError: an option the facade does not offer.
            UnsupportedModelError: a DistributedDataParallel model, or a process group of
                several ranks without DPDDP.
        """
        if grad_sample_mode == "ghost" or "criterion" in kwargs:
            raise LeanpropValueError(
                "make_private(grad_sample_mode='ghost') returns a wrapped criterion in Opacus; "
                "leanprop clips in one backward pass for every model, so the ghost mode is not "
                "needed: drop grad_sample_mode and criterion (make_private returns three values)."
            )
        if kwargs:
            raise LeanpropValueError(
                f"make_private() got options the facade does not offer: {sorted(kwargs)}."
            )
        if clipping not in ("flat", "per_layer"):
            raise LeanpropValueError(
                f"make_private(clipping={clipping!r}): the facade offers 'flat' and 'per_layer'."
            )
        if (clipping == "per_layer") != isinstance(max_grad_norm, list | tuple):
            raise LeanpropValueError(
                "make_private: clipping='per_layer' takes a list of thresholds (one per "
                "trainable parameter) as max_grad_norm, and clipping='flat' one number; got "
                f"clipping={clipping!r}, max_grad_norm={max_grad_norm!r}."
            )
        if self.secure_mode and noise_generator is not None:
            raise LeanpropValueError(
                "make_private: noise_generator cannot be set with secure_mode=True."
            )
        wrapped = is_dpddp(module)  # (each rank clips its own samples)
        if not wrapped:
            refuse_distributed(module, "make_private()", fix=_DISTRIBUTED)
        distributed = wrapped and dist.is_initialized() and dist.get_world_size() > 1
        spec = clipping_of(module, max_grad_norm, loss_reduction)
        capture = PerSample(module, batch_dim=0 if batch_first else 1, fuse=False)
        capture.set_clipping(spec)
        previous = _MADE_PRIVATE.pop(module, None)
        if previous is not None:  # made private again: the new settings replace the old
            previous[1].remove()
            previous[0].__exit__(None, None, None)
        capture.__enter__()
        capture.reset_on_forward = True  # a forward without its backward leaves nothing
        _MADE_PRIVATE[module] = (capture, capture.owned_by_model())
        sample_rate = 1 / len(data_loader)
        if poisson_sampling:
            options = {k: getattr(data_loader, k) for k in _LOADER_OPTIONS}
            if not options["num_workers"]:
                options.pop("prefetch_factor")
            ranks, generator = {}, data_loader.generator
            if distributed:  # each rank samples its share of the dataset, with draws of its
                rank = dist.get_rank()  # own (ranks seeded alike would include the same
                ranks = {"rank": rank, "world_size": dist.get_world_size()}  # positions)
                seed = int(torch.randint(0, 2**62, (), generator=generator)) + 7919 * rank
                generator = torch.Generator().manual_seed(seed)
            data_loader = poisson_loader(
                data_loader.dataset, sample_rate, steps=len(data_loader),
                generator=generator, **ranks, **options,
            )  # fmt: skip
        expected_batch_size = int(len(data_loader.dataset) * sample_rate)
        optimizer = FacadeOptimizer(
            optimizer, capture, noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size if loss_reduction == "mean" else None,
            sample_rate=sample_rate, accountant=self.accountant, generator=noise_generator,
            secure_mode=self.secure_mode, distributed=distributed,
        )  # fmt: skip
        return module, optimizer, data_loader

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float | list[float],
        epsilon_tolerance: float = 0.01,
        **kwargs: Any,
    ) -> tuple[nn.Module, FacadeOptimizer, DataLoader]:
        """:meth:`make_private` with the noise multiplier that spends ``target_epsilon`` at
        ``target_delta`` in ``epochs`` epochs (Opacus' search, with this engine's accountant)."""
        sample_rate = 1 / len(data_loader)
        sigma = noise_multiplier_for(
            target_epsilon, target_delta, sample_rate, steps=epochs * len(data_loader),
            accountant=self._mechanism, epsilon_tolerance=epsilon_tolerance,
        )  # fmt: skip
        return self.make_private(
            module=module, optimizer=optimizer, data_loader=data_loader,
            noise_multiplier=sigma, max_grad_norm=max_grad_norm, **kwargs,
        )  # fmt: skip

    def get_epsilon(self, delta: float) -> float:
        """The privacy spent so far at ``delta``."""
        return float(self.accountant.get_epsilon(delta=delta))

    def save_checkpoint(
        self, *, path: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
        checkpoint_dict: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Save the module's and optimizer's state and the accountant's history (Opacus'
        ``save_checkpoint``)."""
        state = dict(checkpoint_dict or {})
        state["module_state_dict"] = module.state_dict()
        state["privacy_accountant_state_dict"] = self.accountant.state_dict()
        if optimizer is not None:
            state["optimizer_state_dict"] = optimizer.state_dict()
        torch.save(state, path)

    def load_checkpoint(
        self, *, path: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """Load what :meth:`save_checkpoint` saved into ``module``, ``optimizer`` and this
        engine's accountant; returns the rest of the checkpoint."""
        state = torch.load(path, weights_only=False)
        module.load_state_dict(state.pop("module_state_dict"))
        self.accountant.load_state_dict(state.pop("privacy_accountant_state_dict"))
        optimizer_state = state.pop("optimizer_state_dict", None)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        return state
