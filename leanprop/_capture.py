"""Scoped capture of per-sample quantities during one backward pass.

How it works (all state lives on the :class:`PerSample` object, never on user modules):

1. On entry, the model is split into *sites*: modules with a closed-form rule (exact type in
   the registry) own their direct trainable parameters; any other module with direct trainable
   parameters becomes a *fallback root* handled by ``torch.func`` (see ``rules/_fallback.py``).
2. A forward hook on every site records the call's inputs and registers tensor hooks on its
   outputs. When an output's gradient arrives during backward, the site's individual gradients
   are computed over chunks of samples (bounding scratch memory) and reduced at once into the
   requested quantities, so at most one layer's individual gradients exist at a time.
3. A parameter used by several calls (weight sharing) accumulates its individual gradients
   over the calls; its quantities are formed when the backward pass ends.
4. At the end of the backward pass (an autograd engine callback) the quantities are written to
   the parameters and checked: the individual gradients must sum to the gradient autograd
   computed for this backward, otherwise a use of the parameter escaped the hooks and an error
   says so (nothing silently wrong).
5. On exit every hook is removed and every captured tensor released, also on exceptions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from ._registry import Rule, RuleOptions, rule_for
from .errors import BatchError, LeanpropValueError, UnsupportedModelError
from .quantities import (
    BatchGrad,
    BatchL2Grad,
    Quantity,
    SumGradSquared,
    Variance,
    validate_quantities,
)
from .rules._fallback import batch_dim_of, fallback_batch_grads

ConvAlgorithm = Literal["auto", "unfold", "grouped"]
CONV_ALGORITHMS: tuple[str, ...] = ("auto", "unfold", "grouped")
_ALL_ATTRS = tuple(q.attr for q in (BatchGrad, BatchL2Grad, SumGradSquared, Variance))


@dataclass(eq=False)
class _Site:
    """A module whose parameters are tracked: a rule module or a fallback root."""

    name: str
    module: nn.Module
    rule: Rule | None
    direct: dict[str, nn.Parameter]  # names within the module -> parameter
    inner: list[_Site] = field(default_factory=list)  # rule sites below a fallback root
    calls: int = 0  # calls seen in the current forward/backward cycle
    calls_before: list[int] = field(default_factory=list)  # inner sites' calls at entry


@dataclass(eq=False)
class _Call:
    """One call of a site during forward, waiting for its output gradients."""

    site: _Site
    params: dict[str, nn.Parameter]
    args: tuple[Any, ...] | None
    kwargs: dict[str, Any] | None
    n: int
    grads: list[Tensor | None]
    pending: int
    closed: bool = False


@dataclass(eq=False)
class _ParamState:
    name: str
    param: nn.Parameter
    uses: int = 0
    batch: Tensor | None = None  # accumulated individual gradients (weight sharing)
    total: Tensor | None = None  # sum of the individual gradients, for the final check
    autograd_grad: Tensor | None = None  # what autograd computed for it in this backward
    results: dict[str, Tensor] = field(default_factory=dict)


class _Reducer:
    """Streams chunks of individual gradients ``[n_chunk, *shape]`` into the quantities."""

    def __init__(self, kinds: frozenset[type[Quantity]], like: Tensor) -> None:
        self.kinds, self.like = kinds, like
        self.parts: list[Tensor] = []
        self.l2: list[Tensor] = []
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None
        self.sgs: Tensor | None = None

    def add(self, b: Tensor) -> None:
        if BatchGrad in self.kinds:
            self.parts.append(b)
            return
        k = b.shape[0]
        if BatchL2Grad in self.kinds:
            self.l2.append(_sq_norms(b))
        if SumGradSquared in self.kinds:
            s = b.pow(2).sum(0)
            self.sgs = s if self.sgs is None else self.sgs + s
        # running mean and centred sum of squares, combined across chunks (Chan et al.)
        mean_c = b.mean(0)
        m2_c = (b - mean_c).pow(2).sum(0) if Variance in self.kinds else None
        if self.mean is None:
            self.mean, self.m2 = mean_c, m2_c
        else:
            total = self.count + k
            delta = mean_c - self.mean
            self.mean = self.mean + delta * (k / total)
            if m2_c is not None:
                self.m2 = self.m2 + m2_c + delta.pow(2) * (self.count * k / total)
        self.count += k

    def result(self) -> tuple[dict[str, Tensor], Tensor | None]:
        """The quantities and the sum of the individual gradients (None if nothing was added)."""
        if BatchGrad in self.kinds:
            if not self.parts:
                return quantities_from_batch(self.like.new_zeros(0, *self.like.shape), self.kinds)
            b = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
            return quantities_from_batch(b, self.kinds)
        if self.mean is None:
            return quantities_from_batch(self.like.new_zeros(0, *self.like.shape), self.kinds)
        out: dict[str, Tensor] = {}
        if BatchL2Grad in self.kinds:
            out[BatchL2Grad.attr] = torch.cat(self.l2)
        if SumGradSquared in self.kinds:
            out[SumGradSquared.attr] = self.sgs
        if Variance in self.kinds:
            out[Variance.attr] = self.m2 / self.count
        return out, self.mean * self.count


def quantities_from_batch(
    b: Tensor, kinds: frozenset[type[Quantity]]
) -> tuple[dict[str, Tensor], Tensor]:
    """Quantities from materialised individual gradients ``b: [N, *shape]``, and their sum."""
    out: dict[str, Tensor] = {}
    if BatchGrad in kinds:
        out[BatchGrad.attr] = b
    if BatchL2Grad in kinds:
        out[BatchL2Grad.attr] = _sq_norms(b)  # [N]
    if SumGradSquared in kinds:
        out[SumGradSquared.attr] = b.pow(2).sum(0)
    if Variance in kinds:
        out[Variance.attr] = (b - b.mean(0)).pow(2).mean(0)  # centred; NaN for N = 0
    return out, b.sum(0)


def _sq_norms(b: Tensor) -> Tensor:
    """Squared L2 norm of each row ``b[n]`` without a squared temporary: ``[N]``."""
    return torch.linalg.vector_norm(b.flatten(1), dim=1).square()


def _slice_batch(x: Any, start: int, stop: int, n: int, dim: int) -> Any:
    if isinstance(x, Tensor) and x.dim() > dim and x.shape[dim] == n:
        return x.narrow(dim, start, stop - start)
    return x


class PerSample:
    """Context manager computing per-sample quantities during ``backward``; see
    :func:`leanprop.per_sample`."""

    def __init__(
        self,
        model: nn.Module,
        *quantities: Quantity,
        conv_algorithm: ConvAlgorithm = "auto",
        max_workspace_mib: float = 256.0,
        check: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise LeanpropValueError(
                f"per_sample() needs an nn.Module as first argument, got {type(model).__name__}; "
                "call per_sample(model, BatchGrad(), ...)."
            )
        self._kinds = validate_quantities(quantities)
        if conv_algorithm not in CONV_ALGORITHMS:
            raise LeanpropValueError(
                f"per_sample() got conv_algorithm={conv_algorithm!r}; allowed: "
                f"{', '.join(map(repr, CONV_ALGORITHMS))}."
            )
        if not max_workspace_mib > 0:
            raise LeanpropValueError(
                f"per_sample() got max_workspace_mib={max_workspace_mib!r}; it must be a "
                "positive number of MiB (scratch memory per layer, e.g. 256)."
            )
        self.model = model
        self.quantities = quantities
        self.conv_algorithm = conv_algorithm
        self._budget = int(max_workspace_mib * 2**20)
        self._check = check
        self._handles: list[RemovableHandle] = []
        self._tensor_handles: list[RemovableHandle] = []
        self._sites: list[_Site] = []
        self._states: dict[nn.Parameter, _ParamState] = {}
        self._calls: list[_Call] = []
        self._n: int | None = None
        self._active = False
        self._computing = False
        self._cycle_open = False
        self._grad_mode = False

    # ------------------------------------------------------------------ set-up / tear-down
    def __enter__(self) -> PerSample:
        if self._active:
            raise LeanpropValueError(
                "this per_sample context is already active; use one `with` block at a time."
            )
        try:
            self._plan(self.model, "", None)
            if not self._states:
                raise LeanpropValueError(
                    f"per_sample() found no trainable parameter in {type(self.model).__name__}; "
                    "nothing to compute (are all parameters frozen?)."
                )
            self._clear_attrs()
            for m_name, m in self.model.named_modules():
                if isinstance(m, _BatchNorm):
                    self._handles.append(m.register_forward_pre_hook(self._bn_check(m_name)))
            for site in self._sites:
                self._handles.append(
                    site.module.register_forward_hook(self._on_forward(site), with_kwargs=True)
                )
                if site.rule is None:
                    self._handles.append(
                        site.module.register_forward_pre_hook(self._on_fallback_enter(site))
                    )
            for state in self._states.values():
                self._handles.append(state.param.register_hook(self._on_param_grad(state)))
            self._active = True
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._teardown()

    def _teardown(self) -> None:
        self._active = False
        for h in self._handles + self._tensor_handles:
            h.remove()
        self._handles.clear()
        self._tensor_handles.clear()
        self._calls.clear()
        self._sites.clear()
        self._states.clear()
        self._n = None
        self._cycle_open = False

    def _plan(self, module: nn.Module, prefix: str, root: _Site | None) -> None:
        direct = {k: p for k, p in module._parameters.items() if p is not None and p.requires_grad}
        rule = rule_for(module)
        if direct and (rule is not None or root is None):
            site = _Site(prefix or type(module).__name__, module, rule, direct)
            self._sites.append(site)
            if root is not None:
                root.inner.append(site)
            if rule is None:  # fallback root: owns its whole sub-tree unless children are called
                root = site
            for k, p in direct.items():
                self._state(p, f"{prefix}.{k}" if prefix else k)
        elif direct and root is not None:
            for k, p in direct.items():
                self._state(p, f"{prefix}.{k}")
        for child_name, child in module._modules.items():
            if child is not None:
                self._plan(child, f"{prefix}.{child_name}" if prefix else child_name, root)

    def _state(self, p: nn.Parameter, name: str) -> None:
        if p not in self._states:
            self._states[p] = _ParamState(name, p)

    def _clear_attrs(self) -> None:
        for p in self._states:
            for attr in _ALL_ATTRS:
                if hasattr(p, attr):
                    delattr(p, attr)

    # ------------------------------------------------------------------ forward
    def _bn_check(self, name: str):
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._computing or not torch.is_grad_enabled():
                return
            if module.training or module.running_mean is None:
                raise UnsupportedModelError(
                    f"per_sample: {type(module).__name__} '{name}' normalises with statistics "
                    "of the whole batch (training mode), so each sample's gradient depends on "
                    "the other samples and per-sample quantities are undefined. Put it in eval "
                    "mode (module.eval(), uses running statistics), or replace it with "
                    "GroupNorm/LayerNorm."
                )

        return hook

    def _on_fallback_enter(self, site: _Site):
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not self._computing:
                site.calls_before = [s.calls for s in site.inner]

        return hook

    def _site_params(self, site: _Site) -> dict[str, nn.Parameter]:
        """Parameters a call of ``site`` is responsible for (names within the module)."""
        if site.rule is not None:
            return dict(site.direct)
        before = site.calls_before or [0] * len(site.inner)
        called = {id(s.module) for s, c in zip(site.inner, before, strict=True) if s.calls > c}
        skip = {f"{n}." for n, m in site.module.named_modules() if n and id(m) in called}
        return {
            k: p
            for k, p in site.module.named_parameters()
            if p in self._states and not any(k.startswith(s) for s in skip)
        }

    def _on_forward(self, site: _Site):
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any):
            if self._computing or not torch.is_grad_enabled():
                return None
            n = self._batch_size(site, args, kwargs)
            site.calls += 1
            params = self._site_params(site)
            leaves, _ = tree_flatten(out)
            call = _Call(site, params, args, kwargs, n, [None] * len(leaves), 0)
            for i, t in enumerate(leaves):
                if isinstance(t, Tensor) and t.requires_grad:
                    call.pending += 1
                    self._tensor_handles.append(t.register_hook(self._on_output_grad(call, i)))
            if call.pending and params:
                for p in params.values():
                    self._states[p].uses += 1
                self._calls.append(call)
            return None

        return hook

    def _batch_size(self, site: _Site, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        if site.rule is not None:
            problem = site.rule.check_input(site.module, args) if site.rule.check_input else None
            if problem is not None:
                raise BatchError(
                    f"per_sample: {type(site.module).__name__} '{site.name}' {problem}. "
                    "Per-sample quantities need a leading batch dimension N."
                )
            n = args[0].shape[0]
        else:
            bd = batch_dim_of(site.module)
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            if not tensors or tensors[0].dim() <= bd:
                shapes = [tuple(t.shape) for t in tensors]
                raise BatchError(
                    f"per_sample: {type(site.module).__name__} '{site.name}' got inputs of shapes "
                    f"{shapes}; expected a batch dimension at dim {bd}."
                )
            n = tensors[0].shape[bd]
        if self._n is None:
            self._n = n
        elif n != self._n:
            raise BatchError(
                f"per_sample: {type(site.module).__name__} '{site.name}' got a batch of {n} "
                f"samples, but earlier modules in this forward got {self._n}. Every tracked "
                "module must see the same batch (batch first); run backward before a forward "
                "with another batch size."
            )
        return n

    # ------------------------------------------------------------------ backward
    def _open_cycle(self) -> None:
        if self._cycle_open:
            return
        self._cycle_open = True
        self._grad_mode = torch.is_grad_enabled()
        self._clear_attrs()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _on_param_grad(self, state: _ParamState):
        def hook(grad: Tensor) -> None:
            if self._active and self._cycle_open:
                state.autograd_grad = grad

        return hook

    def _on_output_grad(self, call: _Call, index: int):
        def hook(grad: Tensor) -> None:
            if not self._active or call.closed:
                return
            self._open_cycle()
            call.grads[index] = grad
            call.pending -= 1
            if call.pending == 0:
                self._process(call)

        return hook

    def _process(self, call: _Call) -> None:
        call.closed = True
        try:
            self._computing = True
            self._compute(call)
        finally:
            self._computing = False
            call.args = call.kwargs = None
            call.grads = []

    def _options(self) -> RuleOptions:
        algo = "unfold" if self.conv_algorithm == "auto" else self.conv_algorithm
        return RuleOptions(conv_algorithm=algo)

    def _compute(self, call: _Call) -> None:
        site, kinds, opts = call.site, self._kinds, self._options()
        multi = frozenset(k for k, p in call.params.items() if self._states[p].uses > 1)
        single = frozenset(call.params) - multi
        if call.n == 0:
            for k, p in call.params.items():
                self._store(p, k in multi, quantities_from_batch(p.new_zeros(0, *p.shape), kinds))
            return
        closed: dict[str, Tensor] = {}
        l2_only = kinds == frozenset({BatchL2Grad})
        if single and l2_only and site.rule is not None and site.rule.batch_l2 is not None:
            g = call.grads[0]
            closed = site.rule.batch_l2(site.module, call.args, g, single, opts)
            for k, v in closed.items():
                self._states[call.params[k]].results[BatchL2Grad.attr] = v
        names = (single - closed.keys()) | multi
        if not names:
            return
        reducers = {
            k: _Reducer(kinds if k in single else frozenset({BatchGrad}), call.params[k])
            for k in names
        }
        for chunk in self._chunks(call, names, opts):
            for k, b in chunk.items():
                reducers[k].add(b)
        for k, r in reducers.items():
            self._store(call.params[k], k in multi, r.result())

    def _store(self, p: nn.Parameter, multi: bool, result: tuple[dict, Tensor | None]) -> None:
        state = self._states[p]
        values, total = result
        if multi:
            b = values[BatchGrad.attr]
            state.batch = b if state.batch is None else state.batch + b
            return
        state.results.update(values)
        state.total = total

    def _chunks(self, call: _Call, names: frozenset[str], opts: RuleOptions) -> Iterator[dict]:
        site, n = call.site, call.n
        if site.rule is not None:
            g = call.grads[0]
            per_sample = (
                site.rule.workspace(site.module, call.args, g, opts)
                if site.rule.workspace is not None
                else sum(call.params[k].numel() for k in names) * g.element_size()
            )
            dim = 0
        else:
            per_sample = 2 * sum(call.params[k].numel() for k in names) * 4
            dim = batch_dim_of(site.module)
        size = max(1, self._budget // max(per_sample, 1))
        for start in range(0, n, size):
            stop = min(n, start + size)

            def cut(x: Any, start: int = start, stop: int = stop, dim: int = dim) -> Any:
                return _slice_batch(x, start, stop, n, dim)

            if site.rule is not None:
                args = tuple(cut(a) for a in call.args)
                yield site.rule.batch_grads(site.module, args, cut(call.grads[0]), names, opts)
            else:
                args = tuple(cut(a) for a in call.args)
                kwargs = {k: cut(v) for k, v in call.kwargs.items()}
                grads = [None if g is None else cut(g) for g in call.grads]
                yield fallback_batch_grads(site.module, args, kwargs, grads, names, stop - start)

    def _finish(self) -> None:
        """End of the backward pass: complete partial calls, write and check the results."""
        try:
            with torch.set_grad_enabled(self._grad_mode):
                for call in self._calls:  # outputs that got no gradient count as zero
                    if not call.closed and any(g is not None for g in call.grads):
                        self._process(call)
                for state in self._states.values():
                    if state.batch is not None:
                        state.results, state.total = quantities_from_batch(state.batch, self._kinds)
                    for attr, value in state.results.items():
                        setattr(state.param, attr, value)
                if self._check:
                    self._verify()
        finally:
            self._computing = False
            for h in self._tensor_handles:
                h.remove()
            self._tensor_handles.clear()
            self._calls.clear()
            for site in self._sites:
                site.calls = 0
            for state in self._states.values():
                state.uses, state.batch, state.total = 0, None, None
                state.results, state.autograd_grad = {}, None
            self._n = None
            self._cycle_open = False

    def _verify(self) -> None:
        """The individual gradients must add up to what autograd computed in this backward."""
        pairs = [
            (s, s.total.detach(), s.autograd_grad.detach())
            for s in self._states.values()
            if s.total is not None and s.autograd_grad is not None and not s.autograd_grad.is_sparse
        ]
        if not pairs:
            return
        rel = torch.stack(
            [
                (t - r).norm().double() / (r.norm().double() + t.norm().double() + 1e-30)
                for _, t, r in pairs
            ]
        ).tolist()  # one host synchronisation per backward
        bad = [
            f"'{s.name}' (relative error {e:.2e})"
            for (s, _, r), e in zip(pairs, rel, strict=True)
            if e > (1e-10 if r.dtype == torch.float64 else 1e-3)
        ]
        if bad:
            raise UnsupportedModelError(
                "per_sample: the individual gradients do not add up to the batch gradient for "
                f"{', '.join(bad)}. Some use of these parameters happened outside the module "
                "that owns them (e.g. `F.linear(h, self.emb.weight)` in a parent's forward), "
                "or the model mixes samples. Call the owning module instead, or wrap the use "
                "in a small nn.Module so it gets its own rule."
            )
