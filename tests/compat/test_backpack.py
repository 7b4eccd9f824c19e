"""The BackPACK facade, its two documentation examples, and cross-checks against the real
BackPACK and Opacus (skipped where they are not installed)."""

from __future__ import annotations

import copy
import pathlib
import runpy

import pytest
import torch
from torch import nn

from leanprop import UnsupportedModelError
from leanprop.compat import backpack as facade
from leanprop.compat.backpack import (
    backpack,
    extend,
    extensions,
    unextend,
    weight_jac_t_save_memory,
)
from leanprop.testing import individual_gradients, quantities_from_individual

from ..cases import build
from ..helpers import assert_close

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"
ALL = (
    extensions.BatchGrad(),
    extensions.BatchL2Grad(),
    extensions.SumGradSquared(),
    extensions.Variance(),
)


@pytest.mark.parametrize(
    "script",
    [
        "backpack_save_memory.py",
        "backpack_gradient_of_variance.py",
        "backpack_diag_ggn_optimizer.py",
        "backpack_diag_hessian.py",
        "backpack_hmp.py",
    ],
)
def test_documentation_examples_run(script):
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")


@pytest.mark.parametrize("script", ["backpack_diag_hessian.py", "backpack_hmp.py"])
def test_the_curvature_examples_agree_with_autograd(script):
    error = runpy.run_path(str(EXAMPLES / script))["main"]()
    assert error < 1e-12


@pytest.mark.parametrize("name", ["mlp", "residual", "shared", "conv2d", "tied_lm", "attention"])
def test_facade_matches_oracle(name):
    case = build(name)
    model = extend(case.model)
    try:
        loss = case.loss(model(case.x), case.y, "mean")  # forward outside the block
        with backpack(*ALL):
            loss.backward()
        expected = individual_gradients(model, case.loss, case.x, case.y, "mean")
        for k, p in model.named_parameters():
            ref = quantities_from_individual(expected[k])
            for q in ALL:
                assert_close(getattr(p, q.attr), ref[q.attr], f"{k}.{q.attr}", 1e-9, 1e-12)
    finally:
        facade.unextend(model)


def test_nothing_computed_outside_backpack_and_hooks_removed():
    case = build("mlp")
    model = extend(case.model)
    assert extend(nn.CrossEntropyLoss()) is not None
    for n in (6, 2, 4):  # forwards of other batch sizes outside the block are fine
        case.loss(model(case.x[:n]), case.y[:n], "sum").backward()
    assert not hasattr(model[0].weight, "grad_batch")
    facade.unextend(model)
    assert not any(m._forward_hooks for m in model.modules())


def test_save_memory_switch_selects_the_conv_algorithm():
    model = extend(nn.Sequential(nn.Conv2d(1, 2, 3)))
    try:
        (capture,) = [c for c in facade._EXTENDED if c.model is model]
        with weight_jac_t_save_memory(save_memory=True), backpack(extensions.BatchGrad()):
            assert capture.conv_algorithm == "grouped"
            with weight_jac_t_save_memory(save_memory=False), backpack(extensions.BatchGrad()):
                assert capture.conv_algorithm == "unfold"
        assert not capture._kinds
    finally:
        facade.unextend(model)


def test_batchnorm_training_raises_only_when_quantities_are_asked():
    model = extend(build("batchnorm_eval").model.train())
    try:
        x, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 2, (4,))
        nn.functional.cross_entropy(model(x), y).backward()  # ordinary training: fine
        loss = nn.functional.cross_entropy(model(x), y)
        with pytest.raises(UnsupportedModelError, match="BatchNorm2d"), backpack(ALL[0]):
            loss.backward()
    finally:
        facade.unextend(model)


def test_bad_input():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        extend("model")


# ---------------------------------------------------------------- against BackPACK and Opacus

# their hooks trigger torch's note on full backward hooks when inputs need no gradient
third_party_hooks = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


class Sequence(nn.Module):
    """Embedding + Linear on token sequences [N, T]."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.lin = nn.Linear(4, 3)

    def forward(self, tokens):
        return self.lin(self.emb(tokens)).mean(1)


def _models():
    torch.manual_seed(0)
    mlp = (nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), torch.randn(7, 6))
    cnn = (
        nn.Sequential(
            nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2),
            nn.ReLU(),
            nn.Conv2d(6, 3, 2, dilation=2),
            nn.Flatten(),
            nn.Linear(3 * 2 * 2, 3),
        ),
        torch.randn(5, 4, 8, 8),
    )
    seq = (Sequence(), torch.randint(0, 11, (6, 5)))
    return {"mlp": mlp, "cnn": cnn, "sequence": seq}


def _ours(model, x, y, quantities):
    model = extend(model)
    try:
        loss = nn.functional.cross_entropy(model(x), y)
        with backpack(*quantities):
            loss.backward()
        return {
            k: {q.attr: getattr(p, q.attr) for q in quantities} for k, p in model.named_parameters()
        }
    finally:
        facade.unextend(model)
        model.zero_grad()


# Where BackPACK disagrees with the per-sample loop, the loop wins. Known cases (BackPACK 1.7.1):
# BatchL2Grad of a grouped Conv2d (groups=2, stride=2, padding=1) is wrong, its BatchGrad right.
BACKPACK_WRONG = {("cnn", "0.weight", "batch_l2")}
# BackPACK's Embedding extension fails in float64 (it mixes in float32 tensors): float32 there
DTYPE = {"mlp": torch.float64, "cnn": torch.float64, "sequence": torch.float32}
TOL = {torch.float64: (1e-8, 1e-12), torch.float32: (1e-4, 1e-7)}


@pytest.mark.parametrize("name", ["mlp", "cnn", "sequence"])
@third_party_hooks
@pytest.mark.filterwarnings("ignore:Extension saving to")
def test_against_backpack(name):
    bp = pytest.importorskip("backpack")
    model, x = _models()[name]
    model.to(DTYPE[name])
    x = x.to(DTYPE[name]) if x.is_floating_point() else x
    y = torch.randint(0, 3, (x.shape[0],))
    rtol, atol = TOL[DTYPE[name]]

    def loss_fn(out, t, reduction):
        return nn.functional.cross_entropy(out, t, reduction=reduction)

    oracle = individual_gradients(model, loss_fn, x, y, "mean")
    ours = _ours(model, x, y, ALL)
    bp_model = bp.extend(model)
    loss = bp.extend(nn.CrossEntropyLoss())(bp_model(x), y)
    exts = [getattr(bp.extensions, type(q).__name__)() for q in ALL]
    with bp.backpack(*exts):
        loss.backward()
    compared, wrong = 0, set()
    for k, p in model.named_parameters():
        ref = quantities_from_individual(oracle[k])
        for q in ALL:
            assert_close(ours[k][q.attr], ref[q.attr], f"{name}: {k}.{q.attr} vs loop", rtol, atol)
            theirs = getattr(p, q.attr, None)
            if theirs is None:  # BackPACK does not support this layer for this quantity
                continue
            compared += 1
            if not torch.allclose(ours[k][q.attr], theirs, rtol=rtol, atol=atol):
                wrong.add((name, k, q.attr))
    assert compared >= 8
    assert wrong == {w for w in BACKPACK_WRONG if w[0] == name}


@pytest.mark.parametrize("name", ["mlp", "cnn", "sequence"])
@third_party_hooks
def test_against_opacus(name):
    opacus = pytest.importorskip("opacus")
    model, x = _models()[name]
    y = torch.randint(0, 3, (x.shape[0],))
    ours = _ours(model, x, y, (extensions.BatchGrad(),))
    gsm = opacus.GradSampleModule(model, batch_first=True, loss_reduction="mean")
    nn.functional.cross_entropy(gsm(x), y).backward()
    n = x.shape[0]
    for k, p in model.named_parameters():
        # Opacus gives the gradients of each sample's own loss: N times our contributions
        assert_close(n * ours[k]["grad_batch"], p.grad_sample, f"{name}: {k} vs Opacus", 1e-4, 1e-6)


@third_party_hooks
@pytest.mark.filterwarnings("ignore:Extension saving to")
def test_module_used_twice_backpack_wrong_ours_right():
    """BackPACK keeps only one call's individual gradients for a module called twice."""
    bp = pytest.importorskip("backpack")
    case = build("shared")
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "mean")["lin.weight"]
    bp_model = bp.extend(case.model)
    loss = case.loss(bp_model(case.x), case.y, "mean")
    try:
        with bp.backpack(bp.extensions.BatchGrad()):
            loss.backward()
        theirs = case.model.lin.weight.grad_batch
    except AttributeError:  # BackPACK 1.7.1 fails outright on the second call's output
        theirs = None
    if theirs is not None:
        assert not torch.allclose(theirs, expected, rtol=1e-3), "BackPACK got it right after all"
    case.model.zero_grad()
    ours = _ours(case.model, case.x, case.y, (extensions.BatchGrad(),))["lin.weight"]["grad_batch"]
    assert_close(ours, expected, "ours, module used twice", 1e-9, 1e-12)


def test_extend_every_iteration_frees_each_model_without_the_garbage_collector():
    """BackPACK's usage, extend(new model) per step: no reference cycles (memory grew
    until a gc.collect())."""
    import gc
    import weakref

    gc.disable()
    try:
        for _ in range(3):
            model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
            with backpack(extensions.BatchGrad()):
                model(torch.randn(5, 3)).sum().backward()
            assert model[0].weight.grad_batch.shape == (5, 4, 3)
            ref = weakref.ref(model)
            del model
            assert ref() is None
            # (nor its context: a cycle through the context outlived the model)
            assert all(c.model_alive for c in facade._EXTENDED)
    finally:
        gc.enable()


def test_two_forwards_before_one_backward_name_the_cause():
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x = torch.randn(6, 3)
    loss = model(x[:3]).square().sum() + model(x[3:]).square().sum()
    with (
        pytest.raises(UnsupportedModelError, match="ran forward more than once before"),
        backpack(extensions.BatchGrad()),
    ):
        loss.backward()
    unextend(model)


@pytest.mark.parametrize("between", [5, 6], ids=["same-size", "other-size"])
@pytest.mark.parametrize("quantity", [extensions.BatchGrad(), extensions.BatchL2Grad()])
def test_a_forward_between_the_loss_and_its_backward_is_refused(between, quantity):
    """Another grad-enabled forward (a logging or validation forward) between the loss's
    forward and its backward dropped the loss's records: the backward computed nothing and
    left the previous step's quantities on the parameters, silently stale."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    loss_fn = extend(nn.CrossEntropyLoss())
    loss_fn(model(torch.randn(5, 3)), torch.randint(0, 2, (5,))).backward()  # outside a block
    with backpack(quantity):  # a step with its own quantities
        loss_fn(model(torch.randn(5, 3)), torch.randint(0, 2, (5,))).backward()
    loss = loss_fn(model(torch.randn(5, 3)), torch.randint(0, 2, (5,)))
    model(torch.randn(between, 3))  # the forward in between, with autograd on
    with (
        pytest.raises(UnsupportedModelError, match="another forward ran after it with autograd on"),
        backpack(quantity),
    ):
        loss.backward()
    assert not any(hasattr(p, quantity.attr) for p in model.parameters())  # none stale
    # under torch.no_grad() the forward in between leaves the loss's records alone: exact
    model.zero_grad()
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    loss = loss_fn(model(x), y)
    with torch.no_grad():
        model(torch.randn(between, 3))
    with backpack(quantity):
        loss.backward()
    expected = quantities_from_individual(
        individual_gradients(model, lambda o, t, r: loss_fn(o, t), x, y, "mean")["0.weight"]
    )[quantity.attr]
    assert_close(getattr(model[0].weight, quantity.attr), expected, "after no_grad", 1e-6, 1e-7)
    unextend(model)


class _Recurrent(nn.Module):
    def __init__(self, kind: str, batch_first: bool, explicit: bool) -> None:
        super().__init__()
        self.kind, self.batch_first, self.explicit = kind, batch_first, explicit
        self.rnn = getattr(nn, kind)(3, 4, num_layers=2, batch_first=batch_first)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0] if self.batch_first else x.shape[1]
        hx = None
        if self.explicit:  # zeros [layers, N, H]: its batch is in dimension 1
            h0 = torch.zeros(2, n, 4, dtype=x.dtype)
            hx = (h0, torch.zeros_like(h0)) if self.kind == "LSTM" else h0
        o = self.rnn(x, hx)[0]
        return self.out(o[:, -1] if self.batch_first else o[-1])


@pytest.mark.parametrize("explicit", [True, False], ids=["hx", "no-hx"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_batch_grad_of_rnns_with_an_initial_state(kind, batch_first, explicit):
    """An RNN given its initial state hx: the facade sliced hx along its first dimension (the
    layers) like the input and raised a raw shape error. Exact against a per-sample loop."""
    torch.manual_seed(0)
    model = _Recurrent(kind, batch_first, explicit).double()
    oracle = copy.deepcopy(model)
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    y = torch.randint(0, 2, (5,))
    extend(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    with backpack(extensions.BatchGrad()):
        loss_fn(model(x), y).backward()
    for (k, p), q in zip(model.named_parameters(), oracle.parameters(), strict=True):
        expected = []
        for i in range(5):
            xi = x[i : i + 1] if batch_first else x[:, i : i + 1]
            loss = nn.functional.cross_entropy(oracle(xi), y[i : i + 1]) / 5  # the mean's share
            expected.append(torch.autograd.grad(loss, q)[0])
        torch.testing.assert_close(p.grad_batch, torch.stack(expected), msg=k)


def test_a_model_extended_inside_an_open_block_gets_its_quantities():
    """It got curvature (computed at backward) but none of the block's first-order quantities,
    with no error."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with backpack(extensions.BatchGrad(), extensions.BatchL2Grad()):
        model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
        nn.functional.cross_entropy(model(x), y).backward()
    expected = individual_gradients(
        model, lambda o, t, r: nn.functional.cross_entropy(o, t, reduction=r), x, y, "mean"
    )
    for k, p in model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-5, 1e-7)
        assert p.batch_l2.shape == (5,)
    model.zero_grad()
    for p in model.parameters():
        del p.grad_batch, p.batch_l2
    model(x).sum().backward()  # after the block: idle again
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())
    unextend(model)
