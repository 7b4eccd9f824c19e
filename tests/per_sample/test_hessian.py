"""DiagHessian and BatchDiagHessian (float64) against autograd's full Hessian, and what they
refuse: models whose Hessian has terms besides the GGN and the activations' own."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import leanprop
from leanprop import BatchGrad, UnsupportedModelError
from leanprop.testing import hessian_diagonals

from ..helpers import assert_close, assert_same_derivatives

ACTIVATIONS = {
    "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU,
    "gelu-tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU, "elu": nn.ELU,
    "selu": nn.SELU, "celu": nn.CELU, "softplus": lambda: nn.Softplus(beta=2.0),
    "logsigmoid": nn.LogSigmoid, "mish": nn.Mish, "relu": nn.ReLU,
    "elu-inplace": lambda: nn.ELU(alpha=0.7, inplace=True),
    "selu-inplace": lambda: nn.SELU(inplace=True),
    # (alpha 1: autograd's own second derivative of CELU, the oracle's, is 1e-8 off for
    # an alpha whose inverse float32 cannot hold, e.g. 0.8)
    "celu-inplace": lambda: nn.CELU(inplace=True),
}  # fmt: skip


def _check(model, x, loss_fn, y, **options):
    with leanprop.per_sample(model, **options) as ctx:
        out = model(x)
        leanprop.ggn(
            ctx, out, loss_fn, y, leanprop.DiagHessian(), leanprop.BatchDiagHessian(),
            leanprop.DiagGGNExact(),
        )  # fmt: skip
    ref = hessian_diagonals(model, x, loss_fn, y)
    for k, p in model.named_parameters():
        full, per = ref[k]
        assert_close(p.diag_h, full, f"{k}.diag_h", 1e-10, 1e-12)
        assert_close(p.diag_h_batch, per, f"{k}.diag_h_batch", 1e-10, 1e-12)
        assert p.diag_ggn_exact.shape == p.shape  # (the GGN's own, asked in the same call)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_mlp_against_autograd(activation):
    torch.manual_seed(0)
    act = ACTIVATIONS[activation]
    model = nn.Sequential(nn.Linear(3, 5), act(), nn.Linear(5, 4), act(), nn.Linear(4, 3))
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    _check(model.double(), x.double(), nn.CrossEntropyLoss(), y)


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(reduction="sum"),
        nn.MSELoss(),
        nn.MSELoss(reduction="sum"),
        nn.BCEWithLogitsLoss(),
    ],
    ids=["ce-sum", "mse-mean", "mse-sum", "bce"],
)
def test_cnn_against_autograd(loss_fn):
    """Convolutions, a curved activation before max-pooling, dropout-free; each loss."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Sigmoid(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 4),
        nn.Tanh(), nn.Linear(4, 3),
    ).double()  # fmt: skip
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        y = torch.randint(0, 3, (4,))
    else:
        y = torch.rand(4, 3, dtype=torch.float64)
    _check(model, x, loss_fn, y)


@pytest.mark.parametrize("d", [1, 3])
def test_1d_and_3d_convolutions_against_autograd(d):
    """Conv1d and Conv3d (padded) with a curved activation before pooling."""
    torch.manual_seed(0)
    conv, pool = {1: (nn.Conv1d, nn.MaxPool1d), 3: (nn.Conv3d, nn.AvgPool3d)}[d]
    model = nn.Sequential(
        conv(2, 3, 3, padding=1), nn.Tanh(), pool(2), nn.Flatten(), nn.Linear(3 * 2**d, 3)
    ).double()
    x = torch.randn(4, 2, *(4,) * d, dtype=torch.float64)
    _check(model, x, nn.CrossEntropyLoss(), torch.randint(0, 3, (4,)))


class _SequenceFirst(nn.Module):
    """``[T, N, D]`` inputs (``batch_dim=1``): the activations hold the samples in dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, N, 3] -> [N, 2]
        return self.out(torch.tanh(self.inp(x)).mean(0))


def test_activations_with_the_samples_in_another_dimension():
    """T == N: taking the activation's first dimension for the samples would be silently
    wrong; batch tracking says where they are."""
    torch.manual_seed(0)
    model = _SequenceFirst().double()
    x, y = torch.randn(4, 4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    _check(model, x, nn.CrossEntropyLoss(), y, batch_dim=1)


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class _Product(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * h


class _NormInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


class _Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.softmax(self.a(x), -1))


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (_Shared, "two operands"),
        (_Product, "two operands"),
        (_NormInside, "LayerNorm"),
        (_Softmax, "Softmax"),
    ],
    ids=["weight-used-twice", "product-of-activations", "layernorm", "softmax"],
)
def test_models_with_other_second_order_terms_are_refused(model, says):
    torch.manual_seed(0)
    m = model().double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    with leanprop.per_sample(m) as ctx:
        out = m(x)
        with pytest.raises(UnsupportedModelError, match=says) as err:
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.DiagHessian())
        assert "DiagGGNExact" in str(err.value)
        leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.DiagGGNExact())  # works
    assert not any(hasattr(p, "diag_h") for p in m.parameters())


class _NormFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.norm(x)))


def test_a_norm_layer_on_the_inputs_is_linear_in_its_parameters():
    torch.manual_seed(0)
    model = _NormFirst().double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    _check(model, x, nn.CrossEntropyLoss(), y)


class _Dense(nn.Module):
    """``tanh(W x)`` in one module with a rule of its own (hooked as a whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.nn.functional.linear(x, self.weight))


def _dense_batch_grads(module, inputs, g, names, options):
    x = inputs[0]
    a = torch.tanh(torch.nn.functional.linear(x, module.weight))
    return {"weight": torch.einsum("no,ni->noi", g * (1 - a * a), x)}


def test_an_activation_inside_a_module_hooked_as_a_whole_is_refused():
    """A pass from inside the module reaches its parameters without its rule firing: their
    values were read stale from the pass before (silently wrong), now refused."""
    leanprop.register_rule(_Dense)(_dense_batch_grads)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), _Dense(), nn.Linear(3, 3)).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    with leanprop.per_sample(model, BatchGrad()) as ctx:
        out = model(x)
        with pytest.raises(UnsupportedModelError, match="hooked as a whole"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.DiagHessian())
        nn.CrossEntropyLoss()(out, y).backward()  # (the block's first-order results still come)
    assert all(p.grad_batch.shape[0] == 5 for p in model.parameters())


def test_embeddings_and_op_level_layers_natively():
    """Parameters used in ops without a module rule (an embedding's lookup, a transposed
    convolution) are linear in them: covered."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6, 3)).double()
    ids, y = torch.randint(0, 7, (5, 2)), torch.randint(0, 3, (5,))
    _check(model, ids, nn.CrossEntropyLoss(), y)
    conv = nn.Sequential(
        nn.ConvTranspose2d(1, 2, 2), nn.Sigmoid(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)
    ).double()
    _check(conv, torch.randn(4, 1, 3, 3, dtype=torch.float64), nn.CrossEntropyLoss(), y[:4])


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool = False, chain: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.reentrant, self.chain = reentrant, chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chain:  # (an MLP: the curvature's columns all at once)
            block = lambda t: torch.tanh(self.b(t))  # noqa: E731
        else:
            block = lambda t: torch.tanh(self.b(torch.sigmoid(t)))  # noqa: E731
        return self.c(checkpoint(block, self.a(x), use_reentrant=self.reentrant))


@pytest.mark.parametrize(
    "reentrant, chain", [(False, False), (False, True), (True, False), (True, True)],
    ids=["non-reentrant", "non-reentrant-in-a-chain", "reentrant", "reentrant-in-a-chain"],
)  # fmt: skip
@pytest.mark.parametrize("quantity", [leanprop.DiagGGNExact(), leanprop.DiagHessian()])
def test_curvature_through_a_checkpoint_is_refused(quantity, reentrant, chain):
    """Non-reentrant checkpointing recomputes part of the forward in each pass: the GGN's
    diagonal was off by up to 0.18 and the block's next backward computed nothing, silently.
    In a chain of layers, the columns' pass raised a BatchError about a layer's output. With
    a reentrant one, DiagHessian's refusal named the checkpoint's node and pointed to
    DiagGGNExact, which silently skips a checkpoint of the first layers (the next test)."""
    torch.manual_seed(0)
    model = _Checkpointed(reentrant, chain).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    with leanprop.per_sample(model, BatchGrad()) as ctx:
        out = model(x)
        with pytest.raises(UnsupportedModelError, match="recomputed part of the forward"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, quantity)
        with pytest.raises(UnsupportedModelError, match="no per-sample quantities"):
            nn.CrossEntropyLoss()(out, y).backward()  # (says so, not silently nothing)
    assert not any(hasattr(p, quantity.attr) for p in model.parameters())


def test_curvature_through_a_reentrant_checkpoint_of_the_first_layers_is_refused():
    """The block's layers ran under no_grad and were never recorded: the GGN's columns went
    around them, and its parameters silently got no quantity (the others did)."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4).double(), nn.Linear(4, 3).double()
    model = nn.ModuleDict({"a": a, "b": b})
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0, 1])
    with leanprop.per_sample(model, BatchGrad()) as ctx:
        out = b(checkpoint(lambda t: torch.tanh(a(t)), x, use_reentrant=True))
        with pytest.raises(UnsupportedModelError, match="recomputed part of the forward"):
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, leanprop.DiagGGNExact())
    assert not any(hasattr(p, "diag_ggn_exact") for p in model.parameters())


def test_the_facade_refuses_activations_whose_samples_it_cannot_place():
    """Without batch tracking, an activation on ``[T, N, H]`` with T == N looked batch-first:
    silently wrong; now refused (the native API follows the samples)."""
    from leanprop.compat.backpack import backpack, extend, extensions, unextend

    class SequenceFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, 3]
            return self.b(torch.tanh(self.a(x).transpose(0, 1)).mean(0))

    torch.manual_seed(0)
    model = extend(SequenceFirst().double())
    loss_fn = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(4, 4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    try:
        refused = pytest.raises(UnsupportedModelError, match="without batch tracking")
        with refused, backpack(extensions.DiagHessian()):
            loss_fn(model(x), y).backward()
    finally:
        unextend(model)
        unextend(loss_fn)


_FACADE_MODELS = {
    "linear": lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Dropout(0.0), nn.Linear(4, 3)),
    "linear-no-bias": lambda: nn.Sequential(nn.Linear(3, 4, bias=False), nn.Sigmoid(),
                                            nn.Linear(4, 3)),
    "conv-pool": lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.MaxPool2d(2), nn.Sigmoid(),
                                       nn.Flatten(), nn.Linear(4, 3)),
    "linear-on-sequences": lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Flatten(),
                                                 nn.Linear(8, 3)),
}  # fmt: skip
_FACADE_INPUTS = {"conv-pool": (4, 1, 4, 4), "linear-on-sequences": (4, 2, 3)}


@pytest.mark.parametrize("input_requires_grad", [False, True], ids=["", "input-requires-grad"])
@pytest.mark.parametrize("name", list(_FACADE_MODELS))
def test_the_facade_places_activations_of_layers_as_big_as_the_batch(name, input_requires_grad):
    """A hidden size (or channel count) equal to the batch size is placed: the activation
    takes a layer's output (batch first) through ops that keep it first; an input that
    requires grad is data, not a parameter."""
    from leanprop.compat.backpack import backpack, extend, extensions, unextend

    torch.manual_seed(0)
    model = _FACADE_MODELS[name]().double()
    x = torch.randn(*_FACADE_INPUTS.get(name, (4, 3)), dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    ref = hessian_diagonals(model, x, nn.CrossEntropyLoss(), y)
    model, loss_fn = extend(model), extend(nn.CrossEntropyLoss())
    try:
        with backpack(extensions.DiagHessian(), extensions.BatchDiagHessian()):
            loss_fn(model(x.requires_grad_(input_requires_grad)), y).backward()
        for k, p in model.named_parameters():
            assert_close(p.diag_h, ref[k][0], f"{k}.diag_h", 1e-10, 1e-12)
            assert_close(p.diag_h_batch, ref[k][1], f"{k}.diag_h_batch", 1e-10, 1e-12)
    finally:
        unextend(model)
        unextend(loss_fn)


def test_an_activation_of_a_layer_fed_the_data_takes_no_passes(monkeypatch):
    """``tanh(W x + b)`` with ``x`` the data: its term for ``W`` and ``b`` is the layer's own
    weight gradient of ``x²`` and ``r`` (closed form), where the passes took 2 per unit."""
    ggn_module = importlib.import_module("leanprop.per_sample.curvature.ggn")
    columns = []
    real = ggn_module.residual_columns
    monkeypatch.setattr(
        ggn_module, "residual_columns", lambda *a: (columns.append(c) or c for c in real(*a))
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(27, 3)).double()
    x, y = torch.randn(4, 1, 4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    _check(model, x, nn.CrossEntropyLoss(), y)
    assert not columns


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Sigmoid(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 4),
        nn.Tanh(), nn.Linear(4, 3),
    )  # fmt: skip


def _mlp(first: str, second: str) -> nn.Module:
    a, b = ACTIVATIONS[first], ACTIVATIONS[second]
    return nn.Sequential(nn.Linear(3, 5), a(), nn.Linear(5, 4), b(), nn.Linear(4, 3))


_GRAPH_CASES = {
    # (the first activation's term: closed form, its layer takes the data; the second's: the
    # passes, as each has a graph now)
    "mlp-tanh-gelu": (lambda: _mlp("tanh", "gelu"), (6, 3)),
    "mlp-elu-inplace-sigmoid": (lambda: _mlp("elu-inplace", "sigmoid"), (6, 3)),
    "mlp-silu-celu-inplace": (lambda: _mlp("silu", "celu-inplace"), (6, 3)),
    "cnn": (_cnn, (4, 1, 6, 6)),
}


@pytest.mark.parametrize(
    "loss_fn",
    [nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum"), nn.BCEWithLogitsLoss()],
    ids=["ce", "mse-sum", "bce"],
)
@pytest.mark.parametrize("name", list(_GRAPH_CASES))
def test_create_graph_diag_hessian_and_its_derivatives_against_autograd(name, loss_fn):
    """``ggn(DiagHessian(), BatchDiagHessian(), create_graph=True)`` (BackPACK's are
    differentiable): the values, and the gradients of a random linear functional of them,
    equal autograd's Hessian diagonals differentiated by autograd (float64): the residual
    terms' ``δ`` and ``σ''(z)`` carry their graphs."""
    torch.manual_seed(0)
    build, shape = _GRAPH_CASES[name]
    model = build().double()
    x = torch.randn(*shape, dtype=torch.float64)
    _check_graph(model, x, loss_fn)


@pytest.mark.parametrize("alone", [False, True], ids=["with-batch", "diag-alone"])
@pytest.mark.parametrize("zero", ["delta", "z"])
def test_create_graph_diag_hessian_derivatives_where_the_residual_is_zero(zero, alone):
    """Where ``r = δ σ''(z)`` is 0 but its derivative is not (``δ = 0``: a layer after the
    activation initialised to zero; ``σ''(z) = 0``: zero biases and a zero (padding) sample
    before tanh), the square roots of its parts lost the term's derivative: wrong, silently
    (0.47 off on a derivative of size 0.35). Each unit's column, weighted by ``r``, is
    smooth."""
    torch.manual_seed(0)
    model = _mlp("tanh", "tanh").double()
    x = torch.randn(6, 3, dtype=torch.float64)
    with torch.no_grad():
        if zero == "delta":
            model[4].weight.zero_()
        else:
            for m in (model[0], model[2]):
                m.bias.zero_()
            x[0] = 0.0
    _check_graph(model, x, nn.CrossEntropyLoss(), per_sample=not alone)


def _check_graph(model, x, loss_fn, per_sample=True):
    """DiagHessian (and BatchDiagHessian, ``per_sample``) under create_graph against the
    oracle: values, and the gradients of a random linear functional of them."""
    n = x.shape[0]
    if isinstance(loss_fn, nn.CrossEntropyLoss):
        y = torch.randint(0, 3, (n,))
    else:
        y = torch.rand(n, 3, dtype=torch.float64)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    weights = {
        k: (
            torch.randn(p.shape, generator=gen, dtype=torch.float64),
            torch.randn(n, *p.shape, generator=gen, dtype=torch.float64),
        )
        for k, p in params.items()
    }
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        qs = [leanprop.DiagHessian()] + [leanprop.BatchDiagHessian()] * per_sample
        leanprop.ggn(ctx, out, loss_fn, y, *qs, create_graph=True)
    ref = hessian_diagonals(model, x, loss_fn, y, differentiable=True)
    ours = theirs = 0
    for k, p in params.items():
        full, per = ref[k]
        r, rb = weights[k]
        assert_close(p.diag_h, full, f"{k}.diag_h", 1e-10, 1e-12)
        ours, theirs = ours + (p.diag_h * r).sum(), theirs + (full * r).sum()
        if per_sample:
            assert_close(p.diag_h_batch, per, f"{k}.diag_h_batch", 1e-10, 1e-12)
            ours, theirs = ours + (p.diag_h_batch * rb).sum(), theirs + (per * rb).sum()
    assert_same_derivatives(ours, theirs, params)
