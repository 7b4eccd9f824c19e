"""Per-sample quantities against the per-sample loop oracle, in float64."""

from __future__ import annotations

import pytest
import torch

import leanprop
from leanprop import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance
from leanprop.testing import individual_gradients, quantities_from_individual

from ..cases import CASES, build
from ..helpers import assert_close

ALL = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad())
CONV_CASES = [name for name in CASES if build(name).convs]


def run(case, quantities, reduction, **kwargs):
    with leanprop.per_sample(case.model, *quantities, **kwargs):
        case.loss(case.model(case.x), case.y, reduction).backward()


def reference(case, reduction):
    return individual_gradients(case.model, case.loss, case.x, case.y, reduction)


def check_against_oracle(case, reduction, quantities=ALL, **kwargs):
    expected = reference(case, reduction)
    plain = {k: g.sum(0) for k, g in expected.items()}
    run(case, quantities, reduction, **kwargs)
    for name, p in case.model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "grad_batch") and not hasattr(p, "variance"), name
            continue
        assert_close(p.grad, plain[name], f"{name}.grad", 1e-10, 1e-12)
        ref = quantities_from_individual(expected[name])
        for q in quantities:
            assert_close(getattr(p, q.attr), ref[q.attr], f"{name}.{q.attr}", 1e-9, 1e-12)
        asked = {q.attr for q in quantities}
        for q in ALL:  # nothing else is written (BatchDotGrad's individual gradients)
            assert hasattr(p, q.attr) == (q.attr in asked), f"{name}.{q.attr}"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_all_quantities_match_oracle(name, reduction):
    check_against_oracle(build(name), reduction)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["unfold", "grouped", "weight_backward"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_all_quantities_match_oracle_on_cuda(name, algorithm):
    case = build(name)
    case.model.cuda()
    case.x, case.y = case.x.cuda(), case.y.cuda()
    check_against_oracle(case, "mean", conv_algorithm=algorithm)


@pytest.mark.parametrize("quantity", ALL, ids=lambda q: type(q).__name__)
@pytest.mark.parametrize(
    "name", ["mlp", "tied_lm", "sequence", "conv2d", "conv_late", "attention", "shared"]
)
def test_each_quantity_alone(name, quantity):
    check_against_oracle(build(name), "mean", (quantity,))


@pytest.mark.parametrize("algorithm", ["unfold", "grouped", "weight_backward", "auto"])
@pytest.mark.parametrize("name", CONV_CASES)
def test_conv_algorithms(name, algorithm):
    check_against_oracle(build(name), "sum", conv_algorithm=algorithm)


@pytest.mark.parametrize("name", ["conv2d", "tied_lm", "sequence", "attention"])
def test_chunked_streaming_matches(name):
    """A tiny workspace forces one sample per chunk: streaming statistics must agree."""
    check_against_oracle(build(name), "mean", ALL[1:], max_workspace_mib=1e-6)


@pytest.mark.parametrize("name", ["conv1d", "conv2d", "conv3d", "shared"])
def test_chunked_batch_grad(name):
    """BatchGrad over one-sample chunks, written into one buffer (im2col writes in place)."""
    check_against_oracle(build(name), "sum", ALL, conv_algorithm="unfold", max_workspace_mib=1e-6)


def test_sequence_l2_uses_gram_when_cheaper():
    """Wide Linear on short sequences: the Gram form is chosen and must be exact."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    x, y = torch.randn(3, 2, 16, dtype=torch.float64), torch.randn(3, 2, 16, dtype=torch.float64)
    model.double()
    from ..cases import Case, mse

    check_against_oracle(Case(model, x, y, mse), "sum", (BatchL2Grad(),))


def test_conv_l2_from_gram_matrices_in_chunks():
    """A late convolution's norms from its patches' Gram matrices, one sample per chunk."""
    check_against_oracle(build("conv_late"), "sum", (BatchL2Grad(),), max_workspace_mib=1e-6)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular"])
def test_conv_l2_from_gram_matrices_with_string_padding(padding_mode):
    """The Gram form's summed gradient (for the sum check) of a convolution with
    ``padding="same"`` or another padding mode: the ordinary weight gradient was given the
    padding string and raised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(16, 24, 3, padding="same", padding_mode=padding_mode),
        torch.nn.Flatten(),
        torch.nn.Linear(96, 3),
    ).double()
    x, y = torch.randn(4, 16, 2, 2, dtype=torch.float64), torch.randint(0, 3, (4,))
    from ..cases import Case, ce

    check_against_oracle(Case(model, x, y, ce), "mean", (BatchL2Grad(),))


def test_float32_within_documented_tolerance():
    case = build("conv2d", torch.float32)
    expected = reference(case, "mean")
    run(case, ALL, "mean")
    for name, p in case.model.named_parameters():
        ref = quantities_from_individual(expected[name])
        for q in ALL:
            assert_close(getattr(p, q.attr), ref[q.attr], f"{name}.{q.attr}", 1e-4, 1e-6)


def test_empty_batch():
    case = build("mlp")
    case.x, case.y = case.x[:0], case.y[:0]
    run(case, ALL, "sum")
    for p in case.model.parameters():
        assert p.grad_batch.shape == (0, *p.shape)
        assert p.batch_l2.shape == (0,)
        assert torch.equal(p.sum_grad_squared, torch.zeros_like(p))
        assert p.variance.isnan().all()


def test_auto_conv_algorithm_follows_the_workspace_budget():
    from torch import nn

    from leanprop.per_sample.registry import RuleOptions
    from leanprop.per_sample.rules.conv import ALGORITHMS, candidates

    conv, g = nn.Conv2d(2, 3, 3), torch.zeros(1, 3, 5, 5)
    assert candidates(conv, g, RuleOptions("auto", 10**9)) == ALGORITHMS
    assert candidates(conv, g, RuleOptions("auto", 10)) == ("grouped",)  # none fits: no patches
    assert candidates(conv, g, RuleOptions("unfold", 10)) == ("unfold",)


def test_auto_conv_algorithm_is_chosen_once_per_shape(monkeypatch):
    """``"auto"`` tries the algorithms in turn on a layer shape's first calls, then keeps the
    fastest for that shape; every call, tried or chosen, is exact."""
    from leanprop.per_sample.rules import conv

    monkeypatch.setattr(conv, "_FASTEST", {})
    monkeypatch.setattr(conv, "_TIMES", {})
    monkeypatch.setattr(conv, "_TRIES", 1)
    for _ in range(len(conv.ALGORITHMS)):  # the trials
        check_against_oracle(build("conv2d"), "sum", conv_algorithm="auto")
    assert conv._FASTEST and set(conv._FASTEST.values()) <= set(conv.ALGORITHMS)
    assert not conv._TIMES
    for key in list(conv._FASTEST):  # each other choice is exact too
        for algorithm in conv.ALGORITHMS:
            conv._FASTEST[key] = algorithm
        check_against_oracle(build("conv2d"), "sum", conv_algorithm="auto")


def test_auto_conv_algorithm_times_each_in_use_and_keeps_the_fastest(monkeypatch):
    """Each trial's result is the call's result, written into the caller's buffer whatever
    the algorithm; a clearly slower algorithm is tried once only, and not kept."""
    import time

    from torch import nn

    from leanprop.per_sample.rules import conv

    monkeypatch.setattr(conv, "_FASTEST", {})
    monkeypatch.setattr(conv, "_TIMES", {})
    ran: list[str] = []

    def timed(name):
        f = getattr(conv, name)

        def wrapped(*args):
            ran.append(name)
            if name == "_weight_backward":
                time.sleep(0.02)  # the slow one
            return f(*args)

        return wrapped

    for name in ("_unfold", "_grouped", "_weight_backward"):
        monkeypatch.setattr(conv, name, timed(name))
    torch.manual_seed(0)
    m = nn.Conv2d(4, 6, 3, padding=1, stride=2).double()
    x, g = torch.randn(5, 4, 7, 7, dtype=torch.float64), torch.randn(5, 6, 4, 4).double()
    want = torch.stack([
        torch.autograd.grad(conv_out, m.weight, g[i : i + 1])[0]
        for i in range(5)
        for conv_out in [m(x[i : i + 1])]
    ])  # fmt: skip
    chosen_after = None  # calls until the fastest was kept
    with torch.no_grad():
        for i in range(20):
            out = torch.full_like(want, float("nan"))
            res = conv._weight_grads(m, x, g, conv.ALGORITHMS, out)
            assert res.data_ptr() == out.data_ptr()
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
            if conv._FASTEST and chosen_after is None:
                chosen_after = i + 1
    (kept,) = conv._FASTEST.values()
    assert set(ran[:3]) == {"_unfold", "_grouped", "_weight_backward"}  # one each first
    assert ran.count("_weight_backward") == 1  # 20 ms slower: not tried again
    assert kept != "weight_backward" and not conv._TIMES
    assert chosen_after <= 3 * conv._TRIES and ran[chosen_after:] == ["_" + kept] * (
        20 - chosen_after
    )


def test_auto_conv_algorithm_chosen_by_several_threads_at_once(monkeypatch):
    """Backward passes on two threads (one model each) choosing for the same shape: each
    result exact, no error (the shared choice raised a KeyError)."""
    import threading

    from torch import nn

    from leanprop.per_sample.rules import conv

    monkeypatch.setattr(conv, "_FASTEST", {})
    monkeypatch.setattr(conv, "_TIMES", {})
    torch.manual_seed(0)
    m = nn.Conv2d(3, 4, 3, padding=1).double()
    x, g = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randn(4, 4, 6, 6).double()
    want = conv._unfold(m, x, g, None)
    errors: list[BaseException] = []

    def work():
        try:
            with torch.no_grad():
                for _ in range(30):
                    got = conv._weight_grads(m, x, g, conv.ALGORITHMS, None)
                    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        except BaseException as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert conv._FASTEST and not conv._TIMES
