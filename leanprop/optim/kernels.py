"""A bucket step that calls torch's functional optimizer kernels directly.

``Optimizer.step()`` on a bucket rebuilds each group's lists of parameters, gradients and
state by scanning every parameter of the group, and runs the step hooks and profiling around.
For SGD, Adam and AdamW, :class:`DirectKernels` instead keeps, per bucket (the same
parameters in the same order, as backward produces them from the second step on), the
parameters split by group and their state dicts, and calls the functional kernel torch's own
``step()`` calls (``torch.optim.sgd.sgd``, ``torch.optim.adam.adam``) with the same
arguments: same kernel family (the group's ``foreach``/``fused``), bit-identical results.

Whatever it does not know to be the same goes through the optimizer's own ``step()`` instead:
each bucket's first step (it creates the state and checks devices and dtypes for fused
kernels), another optimizer class, options it does not pass (a newer torch's), step hooks, a
parameter whose state is not created yet, sparse gradients, a tensor ``lr``,
``differentiable`` or ``capturable`` groups, an AMP ``grad_scale``.
"""

from __future__ import annotations

import inspect
import itertools
import operator as op
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._torch_compat import optimizer_step_hooked

_ADAM_OPTIONS = frozenset(
    {
        "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
        "differentiable", "fused", "decoupled_weight_decay",
    }
)  # fmt: skip
_SGD_OPTIONS = frozenset(
    {
        "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
        "differentiable", "fused",
    }
)  # fmt: skip


def _accepts(fn: Callable[..., Any], names: Sequence[str]) -> bool:
    params = inspect.signature(fn).parameters
    return all(n in params for n in names)


_EXP_AVG, _EXP_AVG_SQ = op.itemgetter("exp_avg"), op.itemgetter("exp_avg_sq")
_MOMENTUM_BUFFER = op.itemgetter("momentum_buffer")
_MAX_EXP_AVG_SQ, _STEP = op.itemgetter("max_exp_avg_sq"), op.itemgetter("step")


def _adam_args(group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
               states: list[dict[str, Any]]) -> tuple[tuple, dict[str, Any]]:  # fmt: skip
    """What ``Adam.step`` passes to ``torch.optim.adam.adam`` for these parameters."""
    amsgrad = group["amsgrad"]
    beta1, beta2 = group["betas"]
    lists = (
        params, grads, list(map(_EXP_AVG, states)), list(map(_EXP_AVG_SQ, states)),
        list(map(_MAX_EXP_AVG_SQ, states)) if amsgrad else [], list(map(_STEP, states)),
    )  # fmt: skip
    kwargs = dict(
        amsgrad=amsgrad, has_complex=any(map(Tensor.is_complex, params)), beta1=beta1,
        beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
        maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
        differentiable=group["differentiable"], fused=group["fused"], grad_scale=None,
        found_inf=None, decoupled_weight_decay=group["decoupled_weight_decay"],
    )  # fmt: skip
    return lists, kwargs


def _sgd_args(group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
              states: list[dict[str, Any]]) -> tuple[tuple, dict[str, Any]]:  # fmt: skip
    """What ``SGD.step`` passes to ``torch.optim.sgd.sgd`` for these parameters (their
    momentum buffers exist: the kernel updates them in place)."""
    buffers = list(map(_MOMENTUM_BUFFER, states)) if group["momentum"] != 0 else []
    if any(map(op.is_, buffers, itertools.repeat(None))):
        raise KeyError("momentum_buffer")
    kwargs = dict(
        weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
        dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
        has_sparse_grad=False, foreach=group["foreach"], fused=group["fused"],
        grad_scale=None, found_inf=None,
    )  # fmt: skip
    return (params, grads, buffers), kwargs


@dataclass(frozen=True)
class _Kernel:
    options: frozenset[str]
    fn: Callable[..., None]
    args: Callable[..., tuple[tuple, dict[str, Any]]]


def _kernel_for(optimizer: torch.optim.Optimizer) -> _Kernel | None:
    """The functional kernel ``optimizer.step()`` calls, if it is one this module passes the
    arguments of (the exact class, the options and signature of the torch it was written
    for)."""
    from torch.optim import adam, sgd

    kind = type(optimizer)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        kernel = _Kernel(_ADAM_OPTIONS, adam.adam, _adam_args)
        names = ("has_complex", "decoupled_weight_decay", "grad_scale", "found_inf")
    elif kind is torch.optim.SGD:
        kernel = _Kernel(_SGD_OPTIONS, sgd.sgd, _sgd_args)
        names = ("has_sparse_grad", "fused", "grad_scale", "found_inf")
    else:
        return None
    if set(optimizer.defaults) != kernel.options or not _accepts(kernel.fn, names):
        return None
    return kernel


@dataclass(frozen=True)
class _GroupCall:
    """One kernel call of a bucket: its parameters of one group (the group's dict and the
    parameters' state are read at each call: they may be replaced at any time)."""

    group: int
    params: list[Tensor]


class DirectKernels:
    """Steps buckets of an optimizer's parameters by direct kernel calls where that is the
    same as its ``step()`` on them (see the module docstring).

    Args:
        optimizer: the plain optimizer whose state and groups are used.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.kernel = _kernel_for(optimizer)
        self._plans: dict[tuple[int, ...], list[_GroupCall]] = {}
        self._seen: set[tuple[int, ...]] = set()  # buckets step() has stepped once
        self._built_for: tuple[object, ...] = ()

    def clear(self) -> None:
        """Forget the prebuilt buckets (the groups or the state were replaced)."""
        self._plans.clear()
        self._seen.clear()

    def step(self, params: list[Tensor], where: dict[int, tuple[int, int]]) -> bool:
        """Step ``params`` (each with its ``.grad``) by direct kernel calls.

        Args:
            params: the bucket.
            where: ``id(p) -> (group index, position)`` for the optimizer's groups as they
                are now (a new map object whenever the groups changed).

        Returns:
            False, having done nothing, where ``optimizer.step()`` on the bucket must run.
        """
        kernel, opt = self.kernel, self.optimizer
        if (
            kernel is None
            or optimizer_step_hooked(opt)
            or getattr(opt, "grad_scale", None) is not None
            or getattr(opt, "found_inf", None) is not None
        ):
            return False
        built_for = (where, opt.param_groups)
        if len(self._built_for) != 2 or any(map(op.is_not, self._built_for, built_for)):
            self._plans.clear()  # groups replaced since (load_state_dict, add_param_group, ...)
            self._seen.clear()
            self._built_for = built_for
        key = tuple(map(id, params))
        if key not in self._seen:  # its first step is step()'s: state, checks of fused kernels
            self._seen.add(key)
            return False
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(params, where)
            if len(self._plans) >= 256:  # backward order keeps changing: keep the recent
                self._plans.clear()
                self._seen = {key}
            self._plans[key] = plan
        try:
            calls = [self._arguments(kernel, opt, c) for c in plan]
        except KeyError:  # state not created yet (step() creates it): built again next time
            del self._plans[key]
            return False  # (nothing ran yet)
        except _NotSame:
            return False
        if torch.is_grad_enabled():  # (stepping in backward: off already, and costs nothing)
            with torch.no_grad():
                for lists, kwargs in calls:
                    kernel.fn(*lists, **kwargs)
        else:
            for lists, kwargs in calls:
                kernel.fn(*lists, **kwargs)
        return True

    def bare_call(self, params: list[Tensor]) -> Callable[[], None]:
        """The kernel call of ``params`` (one group, state created) on lists built now, with
        no checks: the floor a bucket step is measured against (benchmarks)."""
        if self.kernel is None:
            raise ValueError(f"no direct kernel for {type(self.optimizer).__name__}")
        where = {id(p): (0, i) for i, p in enumerate(params)}
        (call,) = self._plan(params, where)
        lists, kwargs = self._arguments(self.kernel, self.optimizer, call)
        fn = self.kernel.fn
        return lambda: fn(*lists, **kwargs)

    def _plan(self, params: list[Tensor], where: dict[int, tuple[int, int]]) -> list[_GroupCall]:
        by_group: dict[int, list[Tensor]] = {}
        for p in sorted(params, key=lambda p: where[id(p)]):  # each group's own order
            by_group.setdefault(where[id(p)][0], []).append(p)
        return [_GroupCall(gi, ps) for gi, ps in by_group.items()]

    @staticmethod
    def _arguments(
        kernel: _Kernel, opt: torch.optim.Optimizer, call: _GroupCall
    ) -> tuple[tuple, dict[str, Any]]:
        group = opt.param_groups[call.group]
        if group["differentiable"] or group.get("capturable") or isinstance(group["lr"], Tensor):
            raise _NotSame
        grads = list(map(_GRAD, call.params))
        try:  # (None has no is_sparse)
            if any(map(_IS_SPARSE, grads)):
                raise _NotSame
        except AttributeError:
            raise _NotSame from None
        # (a parameter without state stands in with {}: a kernel that needs it finds none)
        states = list(map(opt.state.get, call.params, itertools.repeat(_NO_STATE)))
        return kernel.args(group, call.params, grads, states)


_NO_STATE: dict[str, Any] = {}
_GRAD, _IS_SPARSE = op.attrgetter("grad"), op.attrgetter("is_sparse")


class _NotSame(Exception):
    """This call is not one the direct path makes as ``step()`` would."""
