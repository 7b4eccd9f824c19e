"""Products with the parameters' blocks of the Hessian (``HMP``), by second-order autograd.

While the forward's graph is whole, the loss's gradient with respect to each parameter is
formed once as a differentiable function (``create_graph=True``). ``H_pp v`` is then the
gradient of ``<grad_p, v>`` with respect to ``p``: one backward pass through that function per
vector, exact for any model autograd can differentiate twice (no table of layers, weight
sharing and attention included). Those passes run through the forward's own graph too: it must
not be freed before the products are taken (``loss.backward(retain_graph=True)``), and its
saved values must not change (a parameter stepped in place): autograd's own checks find both,
and the errors say so.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...errors import LeanpropValueError, UnsupportedModelError
from ..capture import PerSample


def gradient_functions(
    contexts: Sequence[PerSample], loss: Tensor, params: list[nn.Parameter]
) -> list[Tensor | None]:
    """Each parameter's gradient of ``loss`` as a differentiable function (None where the loss
    does not depend on it); the contexts compute nothing in this pass."""
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c.computing(frozenset()))
        with torch.enable_grad():
            return list(torch.autograd.grad(loss, params, create_graph=True, allow_unused=True))


def product_function(
    contexts: Sequence[PerSample], p: nn.Parameter, grad: Tensor, params: list[nn.Parameter]
) -> functools.partial:
    """``mat -> H_pp mat`` for ``p`` whose differentiable gradient is ``grad``, formed with
    ``params`` as they are now (the contexts, held weakly, compute nothing in its passes)."""
    refs = tuple(weakref.ref(c) for c in contexts)
    return functools.partial(hessian_matrix_product, refs, _Snapshot.of(params), p, grad)


@dataclass(frozen=True)
class _Snapshot:
    """What tells that parameters changed: their version counters (in-place ops), storages
    (``p.data = ...``) and sums (``p.data.add_(...)``, which neither of the others sees)."""

    params: tuple[nn.Parameter, ...]
    versions: tuple[int, ...]
    storages: tuple[int, ...]
    sums: Tensor  # [P] float64

    @staticmethod
    def of(params: Sequence[nn.Parameter]) -> _Snapshot:
        with torch.no_grad():
            sums = torch.stack([q.detach().double().sum().cpu() for q in params])
        return _Snapshot(
            tuple(params), tuple(q._version for q in params),
            tuple(q.data_ptr() for q in params), sums,
        )  # fmt: skip

    def changed(self) -> bool:
        if any(q._version != v for q, v in zip(self.params, self.versions, strict=True)):
            return True
        if any(q.data_ptr() != d for q, d in zip(self.params, self.storages, strict=True)):
            return True
        now = _Snapshot.of(self.params).sums
        return not torch.allclose(now, self.sums, rtol=0.0, atol=0.0, equal_nan=True)


def hessian_matrix_product(
    contexts: tuple[weakref.ref, ...], snapshot: _Snapshot, p: nn.Parameter, grad: Tensor,
    mat: Tensor,
) -> Tensor:  # fmt: skip
    """``H_pp mat`` ``[V, *p.shape]`` for ``mat`` ``[V, *p.shape]`` (V vectors).

    Raises:
        UnsupportedModelError: a parameter changed since the gradient was formed (layers
            read their weights when their backward runs, so autograd's own check of saved
            values does not see every change: the products would mix old and new values).
    """
    if snapshot.changed():
        raise _changed()
    if not isinstance(mat, Tensor) or mat.dim() != p.dim() + 1 or mat.shape[1:] != p.shape:
        shape = ", ".join(map(str, p.shape))
        got = tuple(mat.shape) if isinstance(mat, Tensor) else type(mat).__name__
        raise LeanpropValueError(
            f"hmp(mat): mat must be [V, *p.shape] = [V, {shape}] (V vectors), got {got}."
        )
    if not grad.requires_grad:  # the gradient does not depend on p: its block is zero
        return torch.zeros_like(mat)
    columns = []
    with ExitStack() as stack:
        for ref in contexts:
            c = ref()
            if c is not None and c.active:
                stack.enter_context(c.computing(frozenset()))
        for v in mat:
            try:
                (col,) = torch.autograd.grad(
                    grad, p, v.to(grad.dtype), retain_graph=True, allow_unused=True
                )
            except RuntimeError as e:
                raise _explained(e) from e
            columns.append(torch.zeros_like(p) if col is None else col)
    if not columns:
        return mat.new_zeros(mat.shape)
    return torch.stack(columns).to(mat.dtype)


def _explained(e: RuntimeError) -> BaseException:
    """autograd's refusal as what it means for ``hmp``; other errors as they are."""
    text = str(e)
    if "second time" in text or "already been freed" in text:
        return UnsupportedModelError(
            "hmp(mat): the forward's graph was freed by the backward after the Hessian's "
            "functions were formed (loss.backward() without retain_graph=True); the products "
            "differentiate through it. Call loss.backward(retain_graph=True) after "
            "ggn(..., HMP()), or take the products before backward."
        )
    if "derivative for" in text and "not implemented" in text:
        return UnsupportedModelError(
            f"hmp(mat): an op of the model has no second derivative in this torch ({text}); "
            "the products differentiate the model twice. For scaled_dot_product_attention, "
            "run the forward under torch.nn.attention.sdpa_kernel(SDPBackend.MATH)."
        )
    if "modified by an inplace operation" in text:
        return _changed()
    return e


def _changed() -> UnsupportedModelError:
    return UnsupportedModelError(
        "hmp(mat): a parameter or a value the forward saved changed since the forward (in "
        "place or through .data: an optimizer step?); the Hessian is that of the values "
        "then. Take the products before changing the parameters, or run the forward and HMP "
        "again."
    )
