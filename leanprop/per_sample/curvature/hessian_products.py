"""Products with the parameters' blocks of the Hessian (``HMP``) and of the positive-curvature
Hessian (``PCHMP``), by second-order autograd.

While the forward's graph is whole, the loss's gradient with respect to each parameter is
formed once as a differentiable function (``create_graph=True``). ``H_pp v`` is then the
gradient of ``<grad_p, v>`` with respect to ``p``: one backward pass through that function per
vector, exact for any model autograd can differentiate twice (no table of layers, weight
sharing and attention included). Those passes run through the forward's own graph too: it must
not be freed before the products are taken (``loss.backward(retain_graph=True)``). The
products are those of the parameters' values at the forward: a parameter changed through
``.data`` since (an optimizer stepping one parameter after another from its products, as
BackPACK's Newton-CG example does) has its forward-time values copied back into it for each
product and its new ones restored after (the functions of one ``ggn`` call share one copy of
the model's parameters, frozen ones included; products run one at a time, and nothing else
may change the parameters while one runs: another thread's step then would be undone). A
change autograd sees (in place under ``no_grad``, or ``p.data = ...``) is refused with what to
do instead, as is a product with ``create_graph=True`` after a change (its derivative would be
taken with the new values back).

The positive-curvature Hessian replaces each curved activation's residual ``r = δ ⊙ σ''(z)``
(``hessian.py``) by ``max(r, 0)`` or ``|r|``: its block is the Hessian's plus, for each such
activation, ``J_zᵀ diag(c r₋) J_z`` (``r₋ = max(-r, 0)``, ``c`` 1 or 2, ``J_z`` the Jacobian of
the activation's input), applied to a vector by a forward-mode product (the double-backward
trick) and one backward pass.

The functions hold the gradients' graph, which holds the parameters: a reference cycle through
autograd's graph that Python's collector cannot see (as ``backward(create_graph=True)``'s
``.grad``). Delete the attributes when done with them (``del p.hmp``); a later curvature call
on the parameters replaces them.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from ...errors import LeanpropValueError, UnsupportedModelError
from ..capture import PerSample
from .contexts import quiet
from .hessian import Curved, activation_gradients, residual


def gradient_functions(
    contexts: Sequence[PerSample], loss: Tensor, params: list[nn.Parameter]
) -> list[Tensor | None]:
    """Each parameter's gradient of ``loss`` as a differentiable function (None where the loss
    does not depend on it); no per_sample context computes anything in this pass."""
    with quiet(contexts), torch.enable_grad():
        return list(torch.autograd.grad(loss, params, create_graph=True, allow_unused=True))


def positive_curvature_terms(
    contexts: Sequence[PerSample], loss: Tensor, curved: list[Curved], modify: str,
    create_graph: bool = False,
) -> tuple[tuple[GradientEdge, Tensor], ...]:  # fmt: skip
    """What the positive-curvature Hessian adds to the Hessian: for each curved activation,
    its input's edge and ``c r₋`` (``r₋ = max(-r, 0)`` of its residual ``r``; ``c = 1`` for
    ``modify="clip"``, whose ``max(r, 0) = r + r₋``, and 2 for ``"abs"``, ``|r| = r + 2 r₋``;
    ``create_graph``: as a function of the parameters)."""
    with quiet(contexts):
        deltas = activation_gradients(loss, curved, create_graph)
    scale = 1.0 if modify == "clip" else 2.0
    terms = []
    for act, delta in zip(curved, deltas, strict=True):
        negative = scale * (-residual(act, delta, create_graph)).clamp(min=0)
        if negative.any():
            terms.append((act.z, negative if create_graph else negative.detach()))
    return tuple(terms)


def parameters_snapshot(contexts: Sequence[PerSample], params: Sequence[nn.Parameter]) -> Snapshot:
    """What the products are formed with: ``params`` and every other parameter of the
    contexts' models (frozen ones too: the graph reads them), as they are now; one snapshot
    for all of one ``ggn`` call's product quantities."""
    everything = dict.fromkeys(params)
    for c in contexts:
        if c.model_alive:
            everything.update(dict.fromkeys(c.model.parameters()))
    return Snapshot.of(list(everything), watched=len(dict.fromkeys(params)))


def product_functions(
    contexts: Sequence[PerSample], params: list[nn.Parameter], grads: list[Tensor | None],
    snapshot: Snapshot, terms: tuple[tuple[GradientEdge, Tensor], ...] = (),
    create_graph: bool = False,
) -> dict[int, functools.partial]:  # fmt: skip
    """``{i: mat -> H_pp mat}`` for each ``params[i]`` whose differentiable gradient
    ``grads[i]`` exists, of the parameters' values in ``snapshot`` (the contexts, held weakly,
    compute nothing in its passes); with ``terms`` (:func:`positive_curvature_terms`), the
    positive-curvature Hessian's block instead; ``create_graph``: products that are functions
    of the parameters (one more order of differentiation)."""
    refs = tuple(weakref.ref(c) for c in contexts)
    return {
        i: functools.partial(hessian_matrix_product, refs, snapshot, p, g, terms, create_graph)
        for i, (p, g) in enumerate(zip(params, grads, strict=True))
        if g is not None
    }


# products change parameters' values while they run (Snapshot.as_formed): one at a time, so
# that no other thread reads (or keeps) the values another put in
_PRODUCTS = threading.RLock()


@dataclass(frozen=True)
class Snapshot:
    """The parameters as the products were formed: the values of all (``p.data.add_(...)``
    changes nothing else), and the version counters (in-place ops) and storages (``p.data =
    ...``) of the first ``watched``, those the products are for (the others, frozen ones, may
    change in place where the graph does not hold them: an EMA teacher's step)."""

    params: tuple[nn.Parameter, ...]
    versions: tuple[int, ...]
    storages: tuple[int, ...]
    values: tuple[Tensor, ...]

    @staticmethod
    def of(params: Sequence[nn.Parameter], watched: int | None = None) -> Snapshot:
        watched = len(params) if watched is None else watched
        with torch.no_grad():
            return Snapshot(
                tuple(params), tuple(q._version for q in params[:watched]),
                tuple(q.data_ptr() for q in params[:watched]),
                tuple(q.detach().clone() for q in params),
            )  # fmt: skip

    def moved(self) -> bool:
        """Whether a watched parameter changed in a way autograd sees (version, storage)."""
        if any(q._version != v for q, v in zip(self.params, self.versions, strict=False)):
            return True
        return any(q.data_ptr() != d for q, d in zip(self.params, self.storages, strict=False))

    def changed_values(self) -> list[int]:
        """The positions of the parameters whose values differ from the snapshot's (NaNs
        count as changed: copied back, the same)."""
        with torch.no_grad():
            return [
                i for i, (q, old) in enumerate(zip(self.params, self.values, strict=True))
                if not torch.equal(q.detach(), old)
            ]  # fmt: skip

    @contextmanager
    def as_formed(self, create_graph: bool) -> Iterator[None]:
        """The parameters' values as at the snapshot while inside (those changed through
        ``.data`` since: all their new values kept first, then the old ones copied in, and
        the new ones put back in reverse order on exit, so that parameters sharing memory
        end as they were). ``create_graph``: products that autograd differentiates later,
        when the new values are back: refused if any changed."""
        with _PRODUCTS:
            changed = self.changed_values()
            if changed and create_graph:
                raise UnsupportedModelError(
                    "hmp(mat) with create_graph=True: a parameter was changed (through "
                    ".data) since the forward; the product's derivative would read its new "
                    "values. Take the products before changing the parameters, or run the "
                    "forward and HMP again."
                )
            with torch.no_grad():
                now = [(i, self.params[i].detach().clone()) for i in changed]
            try:
                with torch.no_grad():
                    for i in changed:
                        self.params[i].data.copy_(self.values[i])  # (.data: no version bump)
                yield
            finally:
                with torch.no_grad():
                    for i, value in reversed(now):
                        self.params[i].data.copy_(value)


def hessian_matrix_product(
    contexts: tuple[weakref.ref, ...], snapshot: Snapshot, p: nn.Parameter, grad: Tensor,
    terms: tuple[tuple[GradientEdge, Tensor], ...], create_graph: bool, mat: Tensor,
) -> Tensor:  # fmt: skip
    """``H_pp mat`` ``[V, *p.shape]`` for ``mat`` ``[V, *p.shape]`` (V vectors), in the
    promoted dtype of ``mat`` and the gradient (an integer basis gives floating products);
    plus ``J_zᵀ (s ⊙ J_z mat)`` for each ``(z, s)`` of ``terms`` (``J_z``: the Jacobian of the
    activation input ``z`` with respect to ``p``, each sample's); ``create_graph``: as a
    function of the parameters.

    Parameters changed through ``.data`` since the functions were formed are put back to
    their values then for the product (``Snapshot.as_formed``): products of the forward's
    values, whatever was stepped in between.

    Raises:
        UnsupportedModelError: a parameter changed in place or was given a new storage since
            the gradient was formed (autograd refuses its saved values, or would read the
            new storage where layers read their weights when their backward runs).
    """
    if not isinstance(mat, Tensor) or mat.dim() != p.dim() + 1 or mat.shape[1:] != p.shape:
        shape = ", ".join(map(str, p.shape))
        got = tuple(mat.shape) if isinstance(mat, Tensor) else type(mat).__name__
        raise LeanpropValueError(
            f"hmp(mat): mat must be [V, *p.shape] = [V, {shape}] (V vectors), got {got}."
        )
    if snapshot.moved():
        raise _changed()
    dtype = torch.promote_types(mat.dtype, grad.dtype)
    if not grad.requires_grad:  # the gradient does not depend on p: its block is zero
        return torch.zeros(mat.shape, dtype=dtype, device=mat.device)
    columns = []
    alive = [c for c in (ref() for ref in contexts) if c is not None]
    with quiet(alive), snapshot.as_formed(create_graph):
        for v in mat:
            v = v.to(grad.dtype)
            try:
                (col,) = torch.autograd.grad(
                    grad, p, v, retain_graph=True, create_graph=create_graph,
                    allow_unused=True,
                )  # fmt: skip
                col = torch.zeros_like(p) if col is None else col
                for z, s in terms:
                    col = col + _sandwich(z, s, p, v, create_graph)
            except RuntimeError as e:
                raise _explained(e) from e
            columns.append(col)
    if not columns:
        return torch.zeros(mat.shape, dtype=dtype, device=mat.device)
    return torch.stack(columns).to(dtype)


def _sandwich(
    z: GradientEdge, s: Tensor, p: nn.Parameter, v: Tensor, create_graph: bool = False
) -> Tensor:
    """``J_zᵀ (s ⊙ J_z v)`` for ``z`` (an edge of the graph) and ``p``: ``J_z v`` by the
    double-backward trick (``J_zᵀ w`` is linear in ``w``: its gradient along ``v`` is
    ``J_z v``), then one backward pass (``create_graph``: as a function of the parameters)."""
    w = torch.zeros_like(s.detach(), requires_grad=True)
    with torch.enable_grad():
        (jtw,) = torch.autograd.grad(z, p, w, create_graph=True, allow_unused=True)
    if jtw is None or not jtw.requires_grad:  # z does not depend on p
        return torch.zeros_like(p)
    (jv,) = torch.autograd.grad(jtw, w, v, create_graph=create_graph, allow_unused=True)
    if jv is None:
        return torch.zeros_like(p)
    (back,) = torch.autograd.grad(z, p, s * jv, retain_graph=True, create_graph=create_graph)
    return back


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
        "hmp(mat): a parameter or a value the forward saved was changed in place (or given "
        "a new tensor with p.data = ...) since the forward; the Hessian is that of the values "
        "then. Step the parameters through p.data (p.data.add_(...): the products put the "
        "forward's values back while they run), take the products before changing them, or "
        "run the forward and HMP again."
    )
