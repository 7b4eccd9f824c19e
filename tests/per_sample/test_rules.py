"""Contract of every layer rule (float64), called directly: the individual gradients add up to
autograd's gradient, a closed-form ``batch_l2`` equals the norms of the materialised individual
gradients, and a fusable rule's ordinary backward equals autograd's. A rule registered without
a case here fails the first test."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import leanprop
from leanprop.per_sample import registry
from leanprop.per_sample.registry import RuleOptions, rule_for
from leanprop.testing import individual_gradients

from ..helpers import assert_close


def _cases() -> dict[type[nn.Module], tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    n = 4
    return {
        # sequence input (T == N), wide enough for the Gram form of the weight's norms
        nn.Linear: (nn.Linear(20, 18), torch.randn(n, 4, 20)),
        nn.Conv1d: (nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2), torch.randn(n, 4, 9)),
        nn.Conv2d: (nn.Conv2d(2, 4, 3, dilation=2, padding=2), torch.randn(n, 2, 7, 6)),
        nn.Conv3d: (nn.Conv3d(1, 2, 2, stride=(1, 2, 1)), torch.randn(n, 1, 4, 5, 3)),
        nn.Embedding: (nn.Embedding(7, 3, padding_idx=0), torch.randint(0, 7, (n, 4))),
        nn.LayerNorm: (nn.LayerNorm(5), torch.randn(n, 4, 5)),
        nn.GroupNorm: (nn.GroupNorm(2, 4), torch.randn(n, 4, 3, 3)),
    }


def test_every_registered_rule_has_a_contract_case():
    rule_for(nn.Linear(1, 1))  # registers the built-in rules
    built_in = {t for t in registry._RULES if t.__module__.startswith(("torch.", "leanprop."))}
    assert built_in <= set(_cases()), built_in - set(_cases())  # (not the tests' own rules)


def _setup(kind: type[nn.Module]):
    module, x = _cases()[kind]
    module.double()
    if x.is_floating_point():
        x = x.double().requires_grad_()
    out = module(x)
    g = torch.randn_like(out)
    names = frozenset(k for k, _ in module.named_parameters())
    inputs = [x] if x.requires_grad else []
    keys = ["__input__"] * len(inputs) + [k for k, _ in module.named_parameters()]
    grads = torch.autograd.grad(out, [*inputs, *module.parameters()], g)
    expected = dict(zip(keys, grads, strict=True))
    return module, x.detach(), g, names, expected


def _one_at_a_time(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Each sample's gradients on its own (autograd on ``<module(x[n]), g[n]>``)."""
    params = dict(module.named_parameters())
    rows = [
        torch.autograd.grad(module(x[n : n + 1]), list(params.values()), g[n : n + 1])
        for n in range(x.shape[0])
    ]
    return {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(params)}


@pytest.mark.parametrize("recording", [False, True], ids=["no-grad", "create-graph"])
@pytest.mark.parametrize("algorithm", ["unfold", "grouped", "weight_backward"])
@pytest.mark.parametrize("kind", list(_cases()), ids=lambda k: k.__name__)
def test_individual_gradients_equal_one_sample_at_a_time(kind, algorithm, recording):
    """Each individual gradient is its sample's own (so they also add up to autograd's), in
    a plain backward (autograd not recording) and under create_graph (recording)."""
    module, x, g, names, expected = _setup(kind)
    rule = rule_for(module)
    with torch.set_grad_enabled(recording):
        batch = rule.batch_grads(module, (x,), g, names, RuleOptions(algorithm, 2**30))
    own = _one_at_a_time(module, x, g)
    for k in names:
        assert batch[k].shape == (x.shape[0], *expected[k].shape)
        assert_close(batch[k], own[k], f"{kind.__name__}.{k}", 1e-10, 1e-12)
        assert_close(batch[k].sum(0), expected[k], f"{kind.__name__}.{k} sum", 1e-10, 1e-12)


@pytest.mark.parametrize("kind", list(_cases()), ids=lambda k: k.__name__)
def test_closed_form_norms_equal_materialised_ones(kind):
    module, x, g, names, _ = _setup(kind)
    rule = rule_for(module)
    if rule.batch_l2 is None:
        pytest.skip(f"{kind.__name__} has no closed-form norms")
    opts = RuleOptions("auto", 2**30)
    batch = rule.batch_grads(module, (x,), g, names, opts)
    closed = rule.batch_l2(module, (x,), g, names, opts)
    if not closed and kind is not nn.Linear:  # (convolutions: test_conv_gram_norms_...)
        pytest.skip(f"{kind.__name__}: no closed form is cheaper for this case's shapes")
    assert closed, f"{kind.__name__}: no closed form chosen"
    for k, v in closed.items():
        ref = batch[k].flatten(1).square().sum(1)
        assert_close(v, ref, f"{kind.__name__}.{k} batch_l2", 1e-10, 1e-12)


@pytest.mark.parametrize("recording", [False, True], ids=["no-grad", "create-graph"])
@pytest.mark.parametrize("kind", list(_cases()), ids=lambda k: k.__name__)
def test_ordinary_backward_of_a_fused_rule_equals_autograds(kind, recording):
    """In a plain backward (autograd not recording) and under create_graph (recording: the
    norms then differentiate the op recomputed, torch's group-norm kernel has no derivative)."""
    module, x, g, names, expected = _setup(kind)
    rule = rule_for(module)
    if rule.input_grad is None or (rule.can_fuse is not None and not rule.can_fuse(module)):
        pytest.skip(f"{kind.__name__} is not fused")
    with torch.set_grad_enabled(recording):
        grad_x = rule.input_grad(module, x, g)
        sums = rule.param_grads(module, x, g, names)
    assert_close(grad_x, expected["__input__"], "input grad", 1e-10, 1e-12)
    assert set(sums) == names
    for k, v in sums.items():
        assert_close(v, expected[k], f"{kind.__name__}.{k}", 1e-10, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", list(_cases()), ids=lambda k: k.__name__)
def test_input_gradient_given_with_the_individual_ones_is_the_ordinary_one(kind, dtype):
    """A rule that gives the input's gradient with the individual gradients (``INPUT``
    asked for) gives the ordinary one bit for bit (the backward is unchanged by it), and the
    individual gradients as without it; where autograd records it gives none."""
    module, x, g, names, _ = _setup(kind)
    rule = rule_for(module)
    if not rule.input_grad_too:
        pytest.skip(f"{kind.__name__} gives no input gradient")
    module, x, g = module.to(dtype), x.to(dtype), g.to(dtype)
    opts = RuleOptions("auto", 2**30)
    with torch.no_grad():  # (as in backward)
        both = rule.batch_grads(module, (x,), g, names | {registry.INPUT}, opts)
        alone = rule.batch_grads(module, (x,), g, names, opts)
        assert torch.equal(both.pop(registry.INPUT), rule.input_grad(module, x, g))
    assert both.keys() == alone.keys() == names
    for k in names:
        assert torch.equal(both[k], alone[k]), k
    with torch.enable_grad():
        recorded = rule.batch_grads(module, (x,), g, names | {registry.INPUT}, opts)
    assert registry.INPUT not in recorded


def test_group_norm_backward_takes_the_input_gradient_from_its_individual_gradients(
    monkeypatch,
):
    """A GroupNorm replaced in a per_sample backward gets its input gradient from the call
    that gives the individual gradients: the separate input-gradient call does not run."""
    calls = []
    monkeypatch.setattr(registry, "_RULES", {**registry._RULES, nn.GroupNorm: _counting(calls)})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Flatten()).double()
    x = torch.randn(5, 2, 5, 5, dtype=torch.float64)
    y = torch.zeros(5, 36, dtype=torch.float64)

    def loss(out, y, reduction):
        return nn.functional.mse_loss(out, y, reduction=reduction)

    expected = individual_gradients(model, loss, x, y, "sum")
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        loss(model(x), y, "sum").backward()
    assert calls == []  # (the rule's input_grad not called)
    for k, p in model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


def _counting(calls):
    import dataclasses

    rule = registry._RULES[nn.GroupNorm]

    def input_grad(*args):
        calls.append(1)
        return rule.input_grad(*args)

    return dataclasses.replace(rule, input_grad=input_grad)


def test_linear_gram_norms_equal_materialised_ones():
    """A layer wide for its sequence (T == N) gets weight norms from Gram matrices."""
    torch.manual_seed(0)
    module = nn.Linear(32, 24).double()
    x = torch.randn(4, 4, 32, dtype=torch.float64)
    g = torch.randn(4, 4, 24, dtype=torch.float64)
    rule, names, opts = rule_for(module), frozenset({"weight", "bias"}), RuleOptions("auto", 2**30)
    closed = rule.batch_l2(module, (x,), g, names, opts)
    assert set(closed) == {"weight"}  # (the bias's individual gradients are cheaper)
    batch = rule.batch_grads(module, (x,), g, names, opts)
    ref = batch["weight"].flatten(1).square().sum(1)
    assert_close(closed["weight"], ref, "Linear.weight batch_l2", 1e-10, 1e-12)


_CHANNELS_LAST = {3: torch.contiguous_format, 4: torch.channels_last, 5: torch.channels_last_3d}


@pytest.mark.parametrize(
    "module, x",
    [
        (nn.Conv2d(16, 24, 3, padding=1), (4, 16, 2, 2)),  # stride 1, zero padding
        (nn.Conv2d(16, 32, 2, stride=2, dilation=(1, 2), groups=2), (3, 16, 4, 6)),
        (nn.Conv1d(12, 20, 3, padding="same", padding_mode="reflect", groups=2), (4, 12, 3)),
        (nn.Conv3d(6, 10, (1, 2, 2), padding=(0, 1, 0), padding_mode="circular"), (2, 6, 1, 2, 2)),
        (nn.Conv2d(256, 256, 1, groups=4), (3, 256, 3, 3)),
        (nn.Conv2d(64, 64, 3, stride=(1, 2), padding=(2, 1), dilation=(2, 1)), (3, 64, 3, 4)),
    ],
    ids=[
        "2d",
        "2d-groups-strided-dilated",
        "1d-same-reflect",
        "3d-circular",
        "2d-1x1-groups",
        "2d-padded-strided-dilated",
    ],
)
@pytest.mark.parametrize("workspace", [2**30, 1], ids=["one-chunk", "per-sample-chunks"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("form", ["patches", "pixels"])
def test_conv_gram_norms_equal_materialised_ones(module, x, workspace, channels_last, form,
                                                 monkeypatch):  # fmt: skip
    """A convolution with few output positions for its channels (a CNN's late layers) gets
    weight norms from Gram matrices of its patches, in chunks of samples; the patches' Gram
    from the patches or from the padded input's pixel Gram (each form on every layout)."""
    conv = importlib.import_module("leanprop.per_sample.rules.conv")
    monkeypatch.setattr(conv, "_pixel_gram_is_cheaper", lambda *a: form == "pixels")
    torch.manual_seed(0)
    module = module.double()
    x = torch.randn(x, dtype=torch.float64)
    if channels_last:  # (a 1x1 grouped layer's patches are then a view the Gram form reshapes)
        x = x.contiguous(memory_format=_CHANNELS_LAST[x.dim()])
    g = torch.randn_like(module(x))
    rule, names = rule_for(module), frozenset({"weight", "bias"})
    opts = RuleOptions("unfold", workspace)
    closed = rule.batch_l2(module, (x,), g, names, opts)
    assert set(closed) == {"weight"}  # the Gram form was chosen for the weight
    batch = rule.batch_grads(module, (x,), g, names, RuleOptions("unfold", 2**30))
    ref = batch["weight"].flatten(1).square().sum(1)
    assert_close(closed["weight"], ref, f"{type(module).__name__}.weight batch_l2", 1e-10, 1e-12)


class _Scale(nn.Module):
    """A user's module: its weight meets the batch in an elementwise product."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, dtype=torch.float64))

    def forward(self, x):
        return x * self.weight


def test_a_registered_rule_owns_its_parameters_uses():
    """A rule registered for a module whose parameter is used elementwise (a use leanprop would
    otherwise capture op by op) computes that parameter's quantities, once (it was counted
    twice: refused by the sum check)."""
    calls = []

    @leanprop.register_rule(_Scale)
    def scale_batch_grads(module, inputs, g, names, options):
        calls.append(1)
        x = inputs[0]
        return {"weight": (g * x).reshape(x.shape[0], -1, x.shape[-1]).sum(1)}

    for shape in ((6, 3), (6, 5, 3)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), _Scale(4)).double()
        x = torch.randn(*shape, dtype=torch.float64)
        with leanprop.per_sample(model, leanprop.BatchGrad()):
            model(x).square().sum().backward()
        ref = individual_gradients(
            model, lambda o, t, r: o.square().sum(), x, torch.zeros(6), "sum"
        )
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad_batch, ref[k], rtol=1e-10, atol=1e-12, msg=k)
    assert len(calls) == 2


class _TanhThenScale(nn.Module):
    """A user's module whose forward does more than one op with its weight."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d, dtype=torch.float64))

    def forward(self, x):
        return nn.functional.linear(torch.tanh(x), self.weight)


def test_a_registered_rule_gets_the_modules_input_and_output_gradient():
    """A user rule is given the module's input and output gradient (the module hooked as a
    whole), never an inner op's: ``linear(tanh(x), W)`` was handed ``tanh(x)``'s op and its
    sums replaced autograd's gradient (wrong ``.grad``, not caught by the check)."""

    @leanprop.register_rule(_TanhThenScale)
    def tanh_then_scale(module, inputs, g, names, options):
        return {"weight": torch.einsum("no,ni->noi", g, torch.tanh(inputs[0]))}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _TanhThenScale(4)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    plain = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        model(x).square().sum().backward()
    ref = individual_gradients(model, lambda o, t, r: o.square().sum(), x, torch.zeros(6), "sum")
    for (k, p), g in zip(model.named_parameters(), plain, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14, msg=k)
        torch.testing.assert_close(p.grad_batch, ref[k], rtol=1e-10, atol=1e-12, msg=k)


def test_user_forward_hooks_on_built_in_modules_are_followed():
    """A forward hook registered before the block that uses the module's own parameter
    (``out + bias``) is captured op by op, also after a forward that raised inside a rule
    site."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[2].register_forward_hook(lambda m, a, o: o * m.bias)
    x = torch.randn(5, 3, dtype=torch.float64)
    ref = individual_gradients(model, lambda o, t, r: o.square().sum(), x, torch.zeros(5), "sum")
    with leanprop.per_sample(model, leanprop.BatchGrad(), check=False):
        with pytest.raises(RuntimeError):
            model(torch.randn(5, 7, dtype=torch.float64))  # raises inside the first Linear
        model(x).square().sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[k], rtol=1e-10, atol=1e-12, msg=k)


class _ScaleView(_Scale):
    """The weight used through a view inside the module."""

    def forward(self, x):
        return x * self.weight.view(1, -1)


def test_a_registered_rule_owns_derived_uses_inside_its_module():
    @leanprop.register_rule(_ScaleView)
    def scale_view_batch_grads(module, inputs, g, names, options):
        return {"weight": g * inputs[0]}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _ScaleView(4)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    with leanprop.per_sample(model, leanprop.BatchGrad(), check=False):
        model(x).square().sum().backward()
    ref = individual_gradients(model, lambda o, t, r: o.square().sum(), x, torch.zeros(6), "sum")
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[k], rtol=1e-10, atol=1e-12, msg=k)


def test_conv_pixel_gram_norms_in_float16_neither_overflow_nor_underflow():
    """16-bit inputs: the Grams in float32, as the patches' form does (in float16 the pixel
    form gave inf for output gradients near 1 and 0 for ones near 1e-5)."""
    torch.manual_seed(0)
    module = nn.Conv2d(128, 128, 3, padding=1)
    x = torch.randn(2, 128, 6, 6)
    for scale in (1.0, 1e-5):
        g = torch.randn(2, 128, 6, 6) * scale
        exact = rule_for(module).batch_grads(
            module.double(), (x.double(),), g.double(), frozenset({"weight"}), RuleOptions()
        )["weight"].flatten(1).square().sum(1)  # fmt: skip
        module.half()
        opts = RuleOptions("auto", 2**30)
        conv = importlib.import_module("leanprop.per_sample.rules.conv")
        assert conv._pixel_gram_is_cheaper(module, x.half(), g.half())
        got = rule_for(module).batch_l2(module, (x.half(),), g.half(), frozenset({"weight"}), opts)
        assert got["weight"].dtype == torch.float32
        assert_close(got["weight"].double(), exact, f"scale {scale}", 2e-2, 0)
        module.float()
