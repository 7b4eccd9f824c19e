"""create_graph, clean-up, and every error of per_sample."""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leanprop
from leanprop import (
    BatchError,
    BatchGrad,
    BatchL2Grad,
    LeanpropValueError,
    UnsupportedModelError,
    Variance,
)
from leanprop.testing import individual_gradients, individual_gradients_of_losses

from ..cases import CASES, build
from ..helpers import assert_close


# attention is left out: torch has no double backward for CPU flash attention
@pytest.mark.parametrize(
    "name", ["mlp", "conv2d", "tied_lm", "shared", "own_parameter", "derived_use"]
)
def test_gradient_of_total_variance_matches_double_backward(name):
    case = build(name)
    params = [p for p in case.model.parameters() if p.requires_grad]
    with leanprop.per_sample(case.model, Variance()):
        loss = case.loss(case.model(case.x), case.y, "mean")
        loss.backward(create_graph=True)
        total = sum(p.variance.sum() for p in params)
        got = torch.autograd.grad(total, params)
    for p in params:
        p.grad = None  # break the create_graph reference cycle

    grads = individual_gradients(case.model, case.loss, case.x, case.y, "mean", create_graph=True)
    ref_total = sum(g.var(0, unbiased=False).sum() for g in grads.values())
    expected = torch.autograd.grad(ref_total, params)
    assert_close(total.detach(), ref_total.detach(), "total variance", 1e-10, 1e-14)
    for (k, _), a, b in zip(case.model.named_parameters(), got, expected, strict=False):
        assert_close(a, b, f"d total variance / d {k}", 1e-8, 1e-12)


def test_hooks_removed_and_tensors_released_on_exit():
    case = build("mlp")
    model = case.model
    with leanprop.per_sample(model, BatchGrad()):
        out = model(case.x)  # forward without backward
        ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None, "a captured tensor outlived the context"
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    for p in model.parameters():
        assert not p._backward_hooks


def test_hooks_removed_on_exception():
    case = build("mlp")
    with pytest.raises(RuntimeError, match=r"boom"), leanprop.per_sample(case.model, BatchGrad()):
        case.model(case.x)
        raise RuntimeError("boom")
    for m in case.model.modules():
        assert not m._forward_hooks
    assert all(not p._backward_hooks for p in case.model.parameters())


def test_backward_outside_context_computes_nothing():
    case = build("mlp")
    with leanprop.per_sample(case.model, BatchGrad()):
        loss = case.loss(case.model(case.x), case.y, "mean")
    loss.backward()
    assert all(not hasattr(p, "grad_batch") for p in case.model.parameters())


def test_each_backward_replaces_results():
    case = build("mlp")
    with leanprop.per_sample(case.model, BatchGrad()):
        for n in (6, 3):
            case.loss(case.model(case.x[:n]), case.y[:n], "sum").backward()
            assert case.model[0].weight.grad_batch.shape[0] == n


@pytest.mark.parametrize(
    "name", ["mlp", "sequence", "tied_lm", "conv3d", "own_parameter", "attention", "batchnorm_eval"]
)
def test_each_backward_through_a_retained_graph_has_its_own_results(name):
    """BackPACK's pattern: one backward per output (a batched Jacobian), one forward."""
    case = build(name)
    width = case.model(case.x).reshape(case.x.shape[0], -1).shape[1]
    outputs = (0, width - 1)
    expected = {
        c: individual_gradients(
            case.model,
            lambda o, y, r, c=c: o.reshape(o.shape[0], -1)[:, c].sum(),
            case.x,
            case.y,
            "sum",
        )
        for c in outputs
    }
    with leanprop.per_sample(case.model, BatchGrad(), Variance()):
        flat = case.model(case.x).reshape(case.x.shape[0], -1)
        for c in outputs:
            case.model.zero_grad()
            flat[:, c].sum().backward(retain_graph=True)
            for k, p in case.model.named_parameters():
                assert_close(p.grad_batch, expected[c][k], f"output {c}: {k}", 1e-9, 1e-12)


def test_second_backward_through_a_module_hooked_as_a_whole_is_an_error():
    case = build("recurrent")
    with leanprop.per_sample(case.model, BatchGrad()):
        out = case.model(case.x)
        out[:, 0].sum().backward(retain_graph=True)
        with pytest.raises(
            UnsupportedModelError, match=r"second backward.*LSTM 'lstm'.*Run the forward again"
        ):
            out[:, 1].sum().backward()


def test_unknown_quantity_and_class_instead_of_instance():
    model = nn.Linear(2, 2)
    with pytest.raises(LeanpropValueError, match=r"unknown quantity 'grad'.*allowed: BatchGrad"):
        leanprop.per_sample(model, "grad")
    with pytest.raises(LeanpropValueError, match=r"pass an instance: BatchGrad\(\)"):
        leanprop.per_sample(model, BatchGrad)
    # no quantity: the forward is recorded for ggn, backward computes nothing extra
    with leanprop.per_sample(model) as ctx:
        out = model(torch.randn(3, 2))
        leanprop.ggn(ctx, out, nn.MSELoss(), torch.zeros(3, 2), leanprop.DiagGGNExact())
        out.square().sum().backward()
    assert model.weight.diag_ggn_exact.shape == (2, 2)
    assert not any(hasattr(model.weight, a) for a in ("grad_batch", "sum_grad_squared"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_quantity_backward_is_the_plain_one(name):
    """``per_sample(model)`` with no quantity (the forward recorded for ``ggn``): a backward
    gives the plain ``.grad`` and no per-sample attributes. Parameters used at the op level
    (a tied embedding, a LayerNorm's weight, an own parameter) handed contributions anyway,
    and the end of backward then said they had none (a false error on GPT-2)."""
    case = build(name)
    case.loss(case.model(case.x), case.y, "mean").backward()
    plain = {k: p.grad.clone() for k, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    with leanprop.per_sample(case.model):
        case.loss(case.model(case.x), case.y, "mean").backward()
    for k, p in case.model.named_parameters():
        if k in plain:
            assert_close(p.grad, plain[k], k, rtol=1e-12, atol=1e-14)
        assert not any(hasattr(p, a) for a in ("grad_batch", "batch_l2", "variance"))


def test_bad_options():
    model = nn.Linear(2, 2)
    with pytest.raises(LeanpropValueError, match=r"conv_algorithm='fast'.*'unfold'"):
        leanprop.per_sample(model, BatchGrad(), conv_algorithm="fast")
    with pytest.raises(LeanpropValueError, match=r"max_workspace_mib=0"):
        leanprop.per_sample(model, BatchGrad(), max_workspace_mib=0)
    with pytest.raises(LeanpropValueError, match=r"needs an nn.Module"):
        leanprop.per_sample(torch.zeros(2), BatchGrad())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with (
        pytest.raises(LeanpropValueError, match=r"no trainable parameter"),
        leanprop.per_sample(frozen, BatchGrad()),
    ):
        pass


@pytest.mark.parametrize(
    ("module", "x"),
    [(nn.Linear(3, 2), torch.randn(3)), (nn.Conv2d(1, 2, 3), torch.randn(1, 5, 5))],
    ids=["linear", "conv2d"],
)
def test_no_batch_dimension(module, x):
    with (
        pytest.raises(BatchError, match=r"got an input of shape .*batch"),
        leanprop.per_sample(module, BatchGrad()),
    ):
        module(x)


def test_forwards_without_backward_then_another_batch_size():
    """Validation forwards under grad (no backward), then a smaller last batch: no spurious
    batch-size error, and the results are the last forward's."""
    case = build("mlp")
    with leanprop.per_sample(case.model, BatchGrad()):
        for _ in range(3):
            case.model(case.x)
        x, y = case.x[:4], case.y[:4]
        case.loss(case.model(x), y, "sum").backward()
    expected = individual_gradients(case.model, case.loss, x, y, "sum")
    for k, p in case.model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


def test_mismatched_batch_sizes():
    model = build("residual").model
    with (
        pytest.raises(BatchError, match=r"batch of 3 samples, but earlier modules.* got 5"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model.inp(torch.randn(5, 4).double())
        model.head(torch.randn(3, 6).double())


def test_batchnorm_in_training_mode():
    model = build("batchnorm_eval").model.train()
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    with (
        pytest.raises(UnsupportedModelError, match=r"BatchNorm2d '1'.*eval"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(x)


def test_embedding_scale_grad_by_freq():
    emb = nn.Embedding(5, 2, scale_grad_by_freq=True)
    with (
        pytest.raises(BatchError, match=r"scale_grad_by_freq"),
        leanprop.per_sample(emb, BatchGrad()),
    ):
        emb(torch.tensor([[1, 2]]))


class EscapingUse(nn.Module):
    """Uses a child's weight directly in its own forward (a tied output layer written as
    ``F.linear``): captured at that op, since the child's hooks cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3)

    def forward(self, tokens):
        return F.linear(self.emb(tokens), self.emb.weight)


def test_use_outside_owning_module_is_exact():
    model = EscapingUse().double()
    tokens = torch.randint(0, 6, (4, 4))  # T == N
    loss = lambda out, y, r: out.square().sum()  # noqa: E731
    expected = individual_gradients(model, loss, tokens, tokens, "sum")
    with leanprop.per_sample(model, BatchGrad(), leanprop.BatchL2Grad()):
        loss(model(tokens), None, "sum").backward()
    assert_close(model.emb.weight.grad_batch, expected["emb.weight"], "emb.weight", 1e-10, 1e-12)


class InPlaceUse(nn.Module):
    """Uses a child's weight in an in-place matrix product outside the child: an op leanprop
    leaves alone (it cannot split an in-place result's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        return h + torch.zeros_like(h).addmm_(x, self.lin.weight.t())


def test_escaped_use_is_caught_by_the_sum_check():
    model = InPlaceUse().double()
    with (
        pytest.raises(UnsupportedModelError, match=r"do not add up.*'lin.weight'"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(torch.randn(4, 3, dtype=torch.float64)).square().sum().backward()
    assert not model.lin._forward_hooks


@pytest.mark.parametrize("name", ["mlp", "conv2d", "tied_lm"])
def test_bf16_autocast(name):
    """Under autocast the layers compute in bfloat16; the results must still add up to the
    batch gradient (within bfloat16 rounding) and match the float32 oracle loosely."""
    case = build(name, torch.float32)
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "mean")
    with leanprop.per_sample(case.model, BatchGrad(), Variance()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = case.loss(case.model(case.x), case.y, "mean")
        loss.backward()
    for k, p in case.model.named_parameters():
        got, ref = p.grad_batch.float(), expected[k]
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 5e-2, f"{k}: relative error {rel:.2e} against the float32 oracle"


def test_error_during_backward_leaves_the_context_usable(monkeypatch):
    from leanprop.per_sample import stats as _stats

    case = build("mlp")
    add = _stats.Reducer.add
    failures = [RuntimeError("reduction failed")]

    def fail_once(self, b):
        if failures:
            raise failures.pop()
        add(self, b)

    monkeypatch.setattr(_stats.Reducer, "add", fail_once)
    with leanprop.per_sample(case.model, BatchGrad()):
        with pytest.raises(RuntimeError, match="reduction failed"):
            case.loss(case.model(case.x), case.y, "sum").backward()
        case.model.zero_grad()
        case.loss(case.model(case.x), case.y, "sum").backward()
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "sum")
    for k, p in case.model.named_parameters():
        assert_close(p.grad_batch, expected[k], f"{k} after an error", 1e-9, 1e-12)


class SumsOverBatch(nn.Module):
    """Owns a parameter and returns one number for the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        return (x * self.w).sum()


def test_parameter_of_a_module_without_rule_summed_over_the_batch_is_exact():
    model, x = SumsOverBatch(), torch.randn(4, 3, dtype=torch.float64)
    with leanprop.per_sample(model, BatchGrad()):
        model(x).backward()
    assert_close(model.w.grad_batch, x, "w.grad_batch", 1e-12, 1e-14)


class BlockDiag(nn.Module):
    """A parameter in an op whose output leanprop cannot split by sample."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, 2))

    def forward(self, x):
        return torch.block_diag(x, self.w)


def test_op_output_without_batch_dimension():
    model = BlockDiag()
    with (
        pytest.raises(UnsupportedModelError, match=r"'block_diag' uses parameters.*cannot tell"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(torch.randn(4, 3)).sum().backward()


class Kron(nn.Module):
    """A parameter in a Kronecker product with the samples (each row of ``x`` its own rows of
    the output: the batch as the outer factor)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 2))

    def forward(self, x):
        return torch.kron(x, self.w).tanh()


def test_a_parameter_in_a_kronecker_product_with_the_samples_is_exact():
    """It was refused as an op whose output leanprop cannot split by sample."""
    torch.manual_seed(0)
    model = Kron().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    with leanprop.per_sample(model, BatchGrad()):
        model(x).square().sum().backward()
    loop = [torch.autograd.grad(model(x[n : n + 1]).square().sum(), model.w)[0] for n in range(4)]
    torch.testing.assert_close(model.w.grad_batch, torch.stack(loop), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", [BatchGrad, Variance])
def test_scratch_memory_stays_within_the_workspace_budget(kind, budget_mib=0.25):
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(32, 8, 16, 16)  # im2col patches of the whole batch: 2.25 MiB

    def backward_peak(quantities):
        with contextlib.ExitStack() as stack:
            if quantities:
                stack.enter_context(
                    leanprop.per_sample(conv, *quantities, max_workspace_mib=budget_mib)
                )
            out = conv(x).square().sum()
            with leanprop.track_memory(existing=[conv, x, out]) as mem:
                out.backward()
        conv.zero_grad(set_to_none=True)
        return mem.peak_bytes

    extra = backward_peak([kind()]) - backward_peak([])
    results = conv.weight.numel() * 4 * (32 if kind is BatchGrad else 2)  # + mean, variance
    assert extra <= results + budget_mib * 2**20 + 16 * 1024, (extra, results)


@pytest.mark.parametrize("uses", [1, 2], ids=["once", "twice"])
def test_embedding_individual_gradients_take_one_buffer(uses):
    """An embedding's individual gradients are scattered into the zeros made for them (they
    took a second [N, num, dim] buffer), and a second lookup's are added into them."""
    torch.manual_seed(0)
    emb = nn.Embedding(2000, 32)
    tokens = torch.randint(0, 2000, (16, 8))

    def backward_peak(quantities):
        with contextlib.ExitStack() as stack:
            if quantities:
                stack.enter_context(leanprop.per_sample(emb, *quantities))
            out = sum(emb(tokens).square().sum() for _ in range(uses))
            with leanprop.track_memory(existing=[emb, tokens, out]) as mem:
                out.backward()
        emb.zero_grad(set_to_none=True)
        return mem.peak_bytes

    extra = backward_peak([BatchGrad()]) - backward_peak([])
    results = emb.weight.numel() * 4 * 16  # 3.9 MiB
    assert extra <= 1.1 * results, (extra, results)


def test_exception_caught_inside_the_block_leaves_the_context_usable():
    """A hook raising mid-backward (as anomaly detection does on a NaN) must not leave the
    cycle open: the next iteration's backward computes and writes its own results."""
    case = build("mlp")
    with leanprop.per_sample(case.model, BatchGrad()):
        out = case.model(case.x)
        out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("bad gradient")))
        hidden = case.model[0](case.x)  # reaches the first layer's output hook first
        with pytest.raises(RuntimeError, match="bad gradient"):
            (case.loss(out, case.y, "sum") + hidden.sum()).backward()
        case.model.zero_grad()
        case.loss(case.model(case.x), case.y, "sum").backward()
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "sum")
    for k, p in case.model.named_parameters():
        assert_close(p.grad_batch, expected[k], f"{k} after a failed backward", 1e-9, 1e-12)


def test_forward_that_raised_then_retried_with_a_smaller_batch():
    case = build("mlp")
    calls = []

    def fail_first(module, args):
        if not calls:
            calls.append(1)
            raise MemoryError("out of memory")

    with leanprop.per_sample(case.model, BatchGrad()):
        handle = case.model[2].register_forward_pre_hook(fail_first)
        with pytest.raises(MemoryError):
            case.model(case.x)
        handle.remove()
        x, y = case.x[:3], case.y[:3]
        case.loss(case.model(x), y, "sum").backward()
    expected = individual_gradients(case.model, case.loss, x, y, "sum")
    for k, p in case.model.named_parameters():
        assert_close(p.grad_batch, expected[k], f"{k} after a failed forward", 1e-9, 1e-12)


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"max_workspace_mib": "16"}, r"max_workspace_mib='16'.*finite number"),
        ({"max_workspace_mib": float("inf")}, r"max_workspace_mib=inf"),
        ({"max_workspace_mib": True}, r"max_workspace_mib=True"),
        ({"batch_dim": -1}, r"batch_dim=-1.*non-negative int"),
        ({"batch_dim": "1"}, r"batch_dim='1'"),
        ({"batch_dims": [0]}, r"batch_dims=\[0\].*dict"),
        ({"batch_dims": {"mask": 1.5}}, r"batch_dims\['mask'\]=1.5"),
    ],
)
def test_bad_option_values_are_refused_up_front(option, match):
    with pytest.raises(LeanpropValueError, match=match):
        leanprop.per_sample(nn.Linear(2, 2), BatchGrad(), **option)


class ScaledLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, scale):
        return self.lin(x) * scale


def test_input_without_the_batch_dimension_names_the_input():
    model = ScaledLinear()
    with (
        pytest.raises(BatchError, match=r"input 1 has shape \(2,\).*batch_dims=\{1: None\}"),
        leanprop.per_sample(model, BatchGrad(), batch_dim=1),
    ):
        model(torch.randn(5, 4, 3), torch.randn(2))


def test_layer_that_needs_the_batch_first_refuses_it_elsewhere():
    conv = nn.Conv1d(2, 3, 3)
    with (
        pytest.raises(BatchError, match=r"Conv1d.*batch in dimension 1; it needs the batch first"),
        leanprop.per_sample(conv, BatchGrad(), batch_dim=1),
    ):
        conv(torch.randn(2, 2, 5))


def test_zero_dim_parameter_with_batch_l2():
    """A learnable temperature: a 0-dim parameter (its individual gradients are [N])."""

    class Temperature(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.t = nn.Linear(3, 2), nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.lin(x) / self.t

    model = Temperature().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with leanprop.per_sample(model, leanprop.BatchL2Grad(), BatchGrad()):
        model(x).square().sum().backward()
    rows = [torch.autograd.grad(model(x[i : i + 1]).square().sum(), model.t)[0] for i in range(5)]
    assert_close(model.t.batch_l2, torch.stack(rows).square(), "t.batch_l2", 1e-10, 1e-12)


@pytest.mark.parametrize("inner_on", ["model", "submodule", "rnn"])
def test_nested_contexts_each_compute_theirs(inner_on):
    """Each context computes its own quantities; one's per-sample recomputations (an RNN's
    loop) are not the model's forward to the other (the inner one on an RNN raised)."""
    case = build("recurrent" if inner_on == "rnn" else "residual")
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "sum")
    inner_model = {"model": case.model, "submodule": case.model.head}.get(inner_on)
    inner_model = case.model.gru if inner_model is None else inner_model
    with (
        leanprop.per_sample(case.model, BatchGrad()),
        leanprop.per_sample(inner_model, Variance()),
    ):
        case.loss(case.model(case.x), case.y, "sum").backward()
    for k, p in case.model.named_parameters():
        assert_close(p.grad_batch, expected[k], f"{k}.grad_batch", 1e-10, 1e-12)
    for k, p in inner_model.named_parameters():
        key = k if inner_on == "model" else f"{'head' if inner_on == 'submodule' else 'gru'}.{k}"
        ref = expected[key].var(0, unbiased=False)
        assert_close(p.variance, ref, f"{key}.variance", 1e-10, 1e-12)
    for m in case.model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_rnn_dropout_between_layers_is_refused_not_wrong():
    """The masks of an RNN's inter-layer dropout cannot be replayed: refused at forward (with
    check=False the results were silently off before)."""
    lstm = nn.LSTM(3, 4, num_layers=2, dropout=0.5)
    x = torch.randn(5, 5, 3)
    with (
        pytest.raises(UnsupportedModelError, match=r"LSTM 'lstm' .*dropout=0.5.*eval mode"),
        leanprop.per_sample(nn.ModuleDict({"lstm": lstm}), BatchGrad(), check=False) as ctx,
    ):
        del ctx
        lstm(x)
    lstm.eval()
    with leanprop.per_sample(lstm, BatchGrad(), batch_dim=1):
        lstm(x)[0].sum().backward()
    assert lstm.weight_ih_l0.grad_batch.shape == (5, 16, 3)


class _LinearOnPackedData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.rnn = nn.GRU(3, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, mix: bool) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        if mix:  # a PackedSequence of other data (rows mixed), same layout
            data = packed.data.flip(0)
            packed = nn.utils.rnn.PackedSequence(
                data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices
            )
            return self.rnn(packed)[1].sum()
        return self.proj(packed.data).sum()


@pytest.mark.parametrize("mix", [False, True], ids=["linear-on-rows", "rows-mixed"])
def test_packed_rows_outside_an_rnn_are_a_clear_error(mix):
    model = _LinearOnPackedData()
    x, lengths = torch.randn(5, 5, 3), torch.tensor([5, 2, 3, 1, 4])
    match = r"GRU 'rnn' got a PackedSequence.*flip" if mix else r"Linear 'proj'.*PackedSequence"
    with (
        pytest.raises(BatchError, match=match),
        leanprop.per_sample(model, BatchGrad(), batch_dims={0: 1}),
    ):
        model(x, lengths, mix).backward()


class _PackedStates(nn.Module):
    """A GRU over a packed batch, with an initial state from an encoder (optionally permuted),
    called twice (its second call starts from the first call's final state)."""

    def __init__(self, permute_hx: bool) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 4)
        self.rnn = nn.GRU(3, 4)
        self.permute_hx = permute_hx

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        h0 = torch.tanh(self.enc(x[0]))[None]  # [1, N, 4]
        if self.permute_hx:
            h0 = h0.index_select(1, torch.tensor([1, 0, 2, 3, 4]))
        _, h1 = self.rnn(packed, h0)
        _, h2 = self.rnn(packed, h1)
        return h2[0].square().sum(1)


def test_packed_rnn_state_chained_and_differentiable():
    """hx from the same RNN, and backward(create_graph=True): exact (were an autograd error,
    and doubled values with check=False)."""
    torch.manual_seed(0)
    model = _PackedStates(permute_hx=False).double()
    x, lengths = torch.randn(5, 5, 3, dtype=torch.float64), torch.tensor([3, 5, 1, 5, 2])
    params = dict(model.named_parameters())
    for create_graph in (False, True):
        with leanprop.per_sample(model, BatchGrad(), batch_dims={0: 1}, check=False):
            losses = model(x, lengths)
            losses.sum().backward(retain_graph=True, create_graph=create_graph)
        expected = individual_gradients_of_losses(losses, params)
        for k, p in params.items():
            assert_close(p.grad_batch, expected[k], f"{k} create_graph={create_graph}", 1e-9, 1e-12)


def test_rnn_loop_under_create_graph_is_exact():
    torch.manual_seed(0)
    rnn = nn.GRU(3, 4).double()
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    params = dict(rnn.named_parameters())
    with leanprop.per_sample(rnn, BatchGrad(), batch_dim=1, check=False):
        losses = rnn(x)[1][0].square().sum(1)
        losses.sum().backward(create_graph=True, retain_graph=True)
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        assert_close(p.grad_batch, expected[k], k, 1e-9, 1e-12)


def test_packed_rnn_refuses_what_it_cannot_match():
    """An initial state in another order, packed data that is not the packed batch, packed
    input without batch tracking: errors (were silently wrong or crashes)."""
    x, lengths = torch.randn(5, 5, 3), torch.tensor([3, 5, 1, 5, 2])
    model = _PackedStates(permute_hx=True)
    with (
        pytest.raises(BatchError, match=r"GRU 'rnn' got an initial state hx.*another order"),
        leanprop.per_sample(model, BatchGrad(), batch_dims={0: 1}),
    ):
        model(x, lengths)
    gru = nn.GRU(3, 4)
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)

    class Rows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = gru

        def forward(self, data: torch.Tensor) -> torch.Tensor:
            return self.gru(packed._replace(data=data))[1]

    rows = Rows()
    with (
        pytest.raises(BatchError, match=r"rows are not the packed samples"),
        leanprop.per_sample(rows, BatchGrad()),
    ):
        rows(packed.data.clone())
    from leanprop.compat.backpack import extend

    extend(gru)  # the BackPACK facade: no batch tracking
    with pytest.raises(UnsupportedModelError, match=r"batch tracking is off"):
        gru(packed)


@pytest.mark.parametrize("lengths", [[4, 4, 4, 4], [4, 3, 4, 2]], ids=["equal", "unequal"])
def test_a_list_of_tensors_as_input_needs_batch_dims(lengths):
    """A list input may hold the samples themselves (sequences to pack) or one batch per
    element: refused unless batch_dims says (with all lengths == N it was silently wrong)."""

    class Pack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(3, 3)
            self.gru = nn.GRU(3, 2)

        def forward(self, seqs: list[torch.Tensor]) -> torch.Tensor:
            packed = nn.utils.rnn.pack_sequence([self.pre(s) for s in seqs], enforce_sorted=False)
            return self.gru(packed)[1].sum()

    model = Pack()
    seqs = [torch.randn(k, 3) for k in lengths]
    with (
        pytest.raises(BatchError, match=r"input 0 is a list of tensors.*pack_sequence"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(seqs)


def test_gradient_penalty_is_refused_not_wrong():
    """The inner autograd.grad (with respect to the input) computes nothing per sample; the
    loss's gradient through the model's own gradients cannot be split, and the check says so."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with (
        pytest.raises(UnsupportedModelError, match=r"do not add up.*gradient penalty"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        out = model(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.square().sum() + g.square().sum()).backward()


class FilledWithParameter(nn.Module):
    """A learned fill value (0-d) in masked_fill, and a clamp at zero with torch.max."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.fill = nn.Linear(4, 4), nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        h = self.lin(x)
        return torch.max(h.masked_fill(h > 0.3, self.fill), torch.zeros_like(h))


@pytest.mark.parametrize("weight_norm", [False, True], ids=["masked-fill", "weight-norm"])
def test_less_common_parameter_uses_are_exact(weight_norm):
    torch.manual_seed(0)
    if weight_norm:  # the old API: a Linear whose parameters are weight_g and weight_v
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = nn.Sequential(nn.utils.weight_norm(nn.Linear(3, 4)), nn.Tanh()).double()
        x = torch.randn(4, 3, dtype=torch.float64)
    else:
        model, x = FilledWithParameter().double(), torch.randn(4, 4, dtype=torch.float64)
    loss = lambda out, y, r: out.square().sum()  # noqa: E731
    expected = individual_gradients(model, loss, x, x, "sum")
    with leanprop.per_sample(model, BatchGrad()):
        loss(model(x), None, "sum").backward()
    for k, p in model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


def test_failed_sum_check_leaves_no_results():
    model = InPlaceUse().double()
    with pytest.raises(UnsupportedModelError), leanprop.per_sample(model, BatchGrad()):
        model(torch.randn(4, 3, dtype=torch.float64)).square().sum().backward()
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


def test_leaving_with_another_mode_still_active_is_an_error_not_a_stolen_mode():
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    class Theirs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    theirs = Theirs()
    model = nn.Linear(2, 2)
    ps = leanprop.per_sample(model, BatchGrad())
    ps.__enter__()
    theirs.__enter__()
    try:
        with pytest.raises(leanprop.LeanpropError, match=r"TorchFunctionMode entered inside"):
            ps.__exit__(None, None, None)
        assert _get_current_function_mode_stack()[-1] is theirs  # theirs was not popped
        assert not model._forward_hooks
    finally:
        theirs.__exit__(None, None, None)
        while _get_current_function_mode_stack():  # ours, left passing ops through
            _get_current_function_mode_stack()[-1].__exit__(None, None, None)


@pytest.mark.parametrize("how", ["grad", "backward"])
@pytest.mark.parametrize("first", ["grad", "backward"])
def test_each_backward_after_a_create_graph_pass_computes_its_own(first, how):
    """A create_graph pass computes this forward's quantities; a later backward through the
    same forward (from its outputs: not differentiating those quantities) computes its own
    (they were left out, or the first pass's were left as this one's: stale, silently)."""
    case = build("mlp")
    params = list(case.model.parameters())
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "sum")
    with leanprop.per_sample(case.model, BatchGrad()):
        loss = case.loss(case.model(case.x), case.y, "sum")
        if first == "grad":
            torch.autograd.grad(loss, params, create_graph=True, retain_graph=True)
        else:
            loss.backward(create_graph=True, retain_graph=True)
        for k, p in case.model.named_parameters():
            assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)
            p.grad = None  # (breaks the create_graph cycle)
        for scale in (3.0, -2.0):  # (each later one too)
            if how == "grad":
                torch.autograd.grad(scale * loss, params, retain_graph=True)
            else:
                (scale * loss).backward(retain_graph=True)
            for k, p in case.model.named_parameters():
                assert_close(p.grad_batch, scale * expected[k], k, 1e-10, 1e-12)
                p.grad = None


@pytest.mark.parametrize("thread", ["main", "worker"])
@pytest.mark.parametrize("how", ["grad", "backward"])
def test_a_backward_differentiating_results_is_told_by_its_graph_not_by_node_order(how, thread):
    """Loss plus a penalty on one head's gradient from a create_graph pass: differentiating
    results, told from the backward's graph. The pass's nodes may be numbered below the
    forward's (CUDA runs that backward on its device thread; here a worker thread), so that the
    other head's nodes run first: they computed (an LSTM head then raised a misleading error),
    and autograd.grad's results were removed."""
    import threading

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head1 = nn.Linear(3, 4), nn.Linear(4, 2)
            self.head2 = nn.LSTM(4, 2, batch_first=True)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return self.head1(h), self.head2(h[:, None])[0][:, -1]

    torch.manual_seed(0)
    model = TwoHeads().double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    params = list(model.parameters())
    with leanprop.per_sample(model, BatchL2Grad()):
        o1, o2 = model(x)
        loss = F.cross_entropy(o1, y, reduction="sum") + F.cross_entropy(o2, y, reduction="sum")
        found = {}

        def first():
            found["g"] = torch.autograd.grad(loss, params, create_graph=True, retain_graph=True)

        if thread == "main":
            first()
        else:
            worker = threading.Thread(target=first)
            worker.start()
            worker.join()
        norms = [p.batch_l2 for p in params]
        at = next(i for i, p in enumerate(params) if p is model.head1.weight)
        root = loss + found["g"][at].square().sum()
        if how == "backward":
            root.backward()
            assert not any(hasattr(p, "batch_l2") for p in params)
        else:
            torch.autograd.grad(root, params)
            assert all(p.batch_l2 is n for p, n in zip(params, norms, strict=True))
    for p in params:
        p.grad = None


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_second_backward_through_a_non_reentrant_checkpoint_computes_its_own(create_graph):
    """The checkpoint recomputes its module in the second backward through a retained
    forward: not a new forward (that dropped every record: no quantities, silently)."""
    from torch.utils.checkpoint import checkpoint

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.h = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)
            self.ckpt = True

        def forward(self, x):
            h = torch.tanh(self.a(x))
            f = lambda t: torch.tanh(self.b(t))  # noqa: E731
            return self.h(checkpoint(f, h, use_reentrant=False) if self.ckpt else f(h))

    def loss_fn(out, y, reduction):
        return F.cross_entropy(out, y, reduction=reduction)

    torch.manual_seed(0)
    model = M().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    model.ckpt = False
    expected = individual_gradients(model, loss_fn, x, y, "sum")
    model.ckpt = True
    params = list(model.parameters())
    with leanprop.per_sample(model, BatchGrad()):
        loss = loss_fn(model(x), y, "sum")
        loss.backward(create_graph=create_graph, retain_graph=True)
        for p in params:
            p.grad = None
        (3 * loss).backward(retain_graph=True)
        for k, p in model.named_parameters():
            assert_close(p.grad_batch, 3 * expected[k], k, 1e-10, 1e-12)
            p.grad = None


def test_a_loss_backward_after_a_create_graph_vector_jacobian_product_computes_its_own():
    """A create_graph VJP with the residual as grad_outputs (a Gauss-Newton or meta step),
    then the loss's own backward: the last bias's individual gradients of the VJP are the
    residual itself, a node of the forward; the loss's backward reaches it without
    differentiating the VJP's results. It was taken for that: the VJP's results stayed as the
    loss's (silently wrong)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    params = list(model.parameters())

    def loss_fn(out, y, reduction):
        return F.mse_loss(out, y, reduction=reduction)

    expected = individual_gradients(model, loss_fn, x, y, "sum")
    with leanprop.per_sample(model, BatchGrad()):
        out = model(x)
        r = out - y
        torch.autograd.grad(out, params, grad_outputs=r, create_graph=True, retain_graph=True)
        torch.autograd.grad((r**2).sum(), params)
        for k, p in model.named_parameters():
            assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_second_backward_through_a_checkpointed_model_computes_its_own(reentrant):
    """The whole model under checkpoint: its recomputation in a second backward through the
    retained forward is not a new forward (every quantity was missing, silently)."""
    from torch.utils.checkpoint import checkpoint

    case = build("mlp")
    params = list(case.model.parameters())
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "sum")
    with leanprop.per_sample(case.model, BatchGrad()):
        out = checkpoint(case.model, case.x.requires_grad_(), use_reentrant=reentrant)
        loss = case.loss(out, case.y, "sum")
        loss.backward(retain_graph=True)
        for p in params:
            p.grad = None
        loss.backward()
        for k, p in case.model.named_parameters():
            assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


@pytest.mark.parametrize("keep", [False, True], ids=["freed", "graph-kept"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_steps_of_modules_called_directly_each_start_anew(reentrant, keep):
    """Modules called directly (not the root) inside a checkpoint, steps of 5, 5 and 7
    samples: a reentrant checkpoint's forward runs under no_grad, so each step is recorded
    first in its backward; it must not be taken for a recomputation of the step before (a
    BatchError about 7 vs 5 samples), also where the step before kept its graph."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Sequential(nn.Linear(3, 4), nn.Tanh())}).double()
    model["head"] = nn.Linear(4, 2).double()

    def forward(t):
        return model["head"](model["body"](t))

    def loss_fn(out, y, reduction):
        return F.cross_entropy(out, y, reduction=reduction)

    class Whole(nn.Module):  # (the oracle's model)
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, t):
            return forward(t)

    steps = []
    for n in (5, 5, 7):
        x = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
        y = torch.randint(0, 2, (n,))
        steps.append((x, y, individual_gradients(Whole(), loss_fn, x.detach(), y, "sum")))
    with leanprop.per_sample(model, BatchGrad()):
        for x, y, expected in steps:
            out = checkpoint(forward, x, use_reentrant=reentrant)
            loss_fn(out, y, "sum").backward(retain_graph=keep)
            for k, p in model.named_parameters():
                assert_close(p.grad_batch, expected[f"m.{k}"], k, 1e-10, 1e-12)
                p.grad = None


@pytest.mark.parametrize("whole", [True, False], ids=["model", "modules"])
def test_input_gradient_then_backward_through_a_non_reentrant_checkpoint(whole):
    """An input-gradient pass (an adversarial step) keeps the graph, then the loss's
    backward recomputes the checkpoint: not a new forward (every quantity was missing)."""
    from torch.utils.checkpoint import checkpoint

    case = build("mlp")
    model = case.model
    expected = individual_gradients(model, case.loss, case.x, case.y, "sum")
    with leanprop.per_sample(model, BatchGrad()):
        for _ in range(2):
            x = case.x.clone().requires_grad_()
            if whole:
                out = checkpoint(model, x, use_reentrant=False)
            else:
                out = checkpoint(lambda t: model[2](model[1](model[0](t))), x, use_reentrant=False)
            loss = case.loss(out, case.y, "sum")
            torch.autograd.grad(loss, x, retain_graph=True)
            loss.backward()
            for k, p in model.named_parameters():
                assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)
                p.grad = None


@pytest.mark.parametrize("how", ["grad", "backward"])
def test_a_backward_through_a_forward_replaced_by_a_later_one_leaves_no_stale_results(how):
    """Forward A, its backward, forward B, then another backward through A: it computes
    nothing (B's records replaced A's) and must not show A's first results as its own."""
    case = build("mlp")
    params = list(case.model.parameters())
    with leanprop.per_sample(case.model, BatchGrad()):
        loss_a = case.loss(case.model(case.x), case.y, "sum")
        loss_a.backward(retain_graph=True)
        case.model(case.x)  # forward B
        if how == "grad":
            torch.autograd.grad(3 * loss_a, params)
        else:
            (3 * loss_a).backward()
    assert not any(hasattr(p, "grad_batch") for p in params)


@pytest.mark.parametrize("how", ["grad", "backward"])
def test_differentiating_create_graph_quantities_computes_nothing_per_sample(how):
    """A backward of a function of a create_graph pass's quantities (a penalty on the
    individual gradients' norms) differentiates them: it is not a backward of the model's
    loss, computes no per-sample quantities, and leaves the pass's as they are (autograd.grad)
    or none (backward, into .grad); with the loss added (a gradient penalty), none either."""
    case = build("mlp")
    params = list(case.model.parameters())
    with leanprop.per_sample(case.model, BatchL2Grad()):
        loss = case.loss(case.model(case.x), case.y, "sum")
        grads = torch.autograd.grad(loss, params, create_graph=True)
        norms = [p.batch_l2 for p in params]
        penalty = sum(n.sum() for n in norms)
        if how == "grad":
            got = torch.autograd.grad(penalty, params, retain_graph=True)
            assert all(p.batch_l2 is n for p, n in zip(params, norms, strict=True))
        else:
            penalty.backward(retain_graph=True)
            got = [p.grad for p in params]
            assert not any(hasattr(p, "batch_l2") for p in params)
        expected = torch.autograd.grad(
            sum(individual_gradients(case.model, case.loss, case.x, case.y, "sum",
                                     create_graph=True)[k].square().sum()
                for k, _ in case.model.named_parameters()),
            params,
        )  # fmt: skip
        for a, b in zip(got, expected, strict=True):
            assert_close(a, b, "d penalty", 1e-9, 1e-12)
        for p in params:
            p.grad = None
        (loss + sum(g.square().sum() for g in grads)).backward()  # the loss and a penalty
        assert not any(hasattr(p, "batch_l2") for p in params)
    for p in params:
        p.grad = None


@pytest.mark.parametrize("how", ["grad", "backward-inputs"])
def test_gradient_with_respect_to_inputs_only_computes_nothing_per_sample(how):
    """An adversarial step or input gradient before the real backward (same forward)."""
    case = build("mlp")
    x = case.x.clone().requires_grad_()
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "sum")
    with leanprop.per_sample(case.model, BatchGrad()):
        loss = case.loss(case.model(x), case.y, "sum")
        if how == "grad":
            torch.autograd.grad(loss, x, retain_graph=True)
        else:
            loss.backward(inputs=[x], retain_graph=True)
        assert not any(hasattr(p, "grad_batch") for p in case.model.parameters())
        loss.backward(inputs=list(case.model.parameters()))
    for k, p in case.model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


def test_backward_inputs_given_as_a_generator_as_torch_does():
    case = build("mlp")
    with leanprop.per_sample(case.model, BatchGrad()):
        loss = case.loss(case.model(case.x), case.y, "sum")
        loss.backward(inputs=(p for p in case.model[2].parameters()))
    assert case.model[0].weight.grad is None and case.model[2].weight.grad is not None


@pytest.mark.parametrize("model_kind", ["modules", "functional"])
def test_two_forwards_in_one_backward_are_refused_not_merged(model_kind):
    """f(model(x[:3])) + f(model(x[3:])): each row of grad_batch was the sum of two samples'
    gradients (the batch sizes coincide); now an error. A forward whose outputs get no
    gradient (a validation pass) does not count."""
    torch.manual_seed(0)
    if model_kind == "modules":
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    else:
        model = _FunctionalMLP()
    x = torch.randn(6, 3)
    from torch.utils.checkpoint import checkpoint

    for run in (
        model,
        lambda h: checkpoint(model, h, use_reentrant=False),
        lambda h: checkpoint(model, h.requires_grad_(), use_reentrant=True),
    ):
        with (
            pytest.raises(UnsupportedModelError, match="two forward passes"),
            leanprop.per_sample(model, BatchGrad()),
        ):
            (run(x[:3].clone()).square().sum() + run(x[3:].clone()).square().sum()).backward()
        x = x.detach()
    params = dict(model.named_parameters())
    with leanprop.per_sample(model, BatchGrad()):
        model(x[3:]).sum()  # not backpropagated
        losses = model(x[:3]).square().sum(1)
        losses.sum().backward(retain_graph=True)
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        assert_close(p.grad_batch, expected[k], k, 1e-5, 1e-6)


class _FunctionalMLP(nn.Module):
    """Parameters used directly in ops (captured at the op level)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.v = nn.Parameter(torch.randn(2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(x, self.w)), self.v)


def test_forwards_on_the_same_samples_are_one_example_each():
    """The model applied to its own output (unrolled), or twice to the same input (R-Drop):
    the same samples, so their contributions add up per sample (exact, not refused)."""
    torch.manual_seed(0)
    cell = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Dropout(0.3))
    x = torch.randn(4, 3)
    params = dict(cell.named_parameters())
    with leanprop.per_sample(cell, BatchGrad()):
        h = cell(cell(cell(x)))
        losses = h.square().sum(1) + (cell(x) - cell(x)).square().sum(1)
        losses.sum().backward(retain_graph=True)
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        assert_close(p.grad_batch, expected[k], k, 1e-5, 1e-6)


def test_a_model_with_hooks_can_be_deep_copied():
    """An EMA / best-model snapshot inside the block (was: cannot pickle 'WeakMethod')."""
    import copy

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with leanprop.per_sample(model, BatchGrad()):
        snapshot = copy.deepcopy(model)
        model(torch.randn(5, 3)).sum().backward()
    assert model[0].weight.grad_batch.shape == (5, 4, 3)
    snapshot(torch.randn(2, 3)).sum().backward()  # an ordinary model afterwards


@pytest.mark.parametrize("other", ["fewer-samples", "same-input"])
def test_a_forward_under_no_grad_between_forward_and_backward_changes_nothing(other):
    """An evaluation forward (torch.no_grad) between a forward and its backward has no
    backward: the first forward's quantities are exact (were silently missing)."""
    case = build("residual")
    expected = individual_gradients(case.model, case.loss, case.x, case.y, "sum")
    with leanprop.per_sample(case.model, BatchGrad()):
        loss = case.loss(case.model(case.x), case.y, "sum")
        with torch.no_grad():
            case.model(case.x[:2] if other == "fewer-samples" else case.x)
        loss.backward()
    for k, p in case.model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


def test_backward_passes_after_a_dropped_forward():
    """A, B (same batch size), then C of another size: A's and B's backward are refused, C's
    is exact, and a backward through parameters alone (a penalty) afterwards is fine."""
    case = build("mlp")
    x3, y3 = case.x[:3], case.y[:3]
    expected = individual_gradients(case.model, case.loss, x3, y3, "sum")
    with leanprop.per_sample(case.model, BatchGrad()):
        a = case.loss(case.model(case.x), case.y, "sum")
        b = case.loss(case.model(case.x + 1), case.y, "sum")
        c = case.loss(case.model(x3), y3, "sum")
        c.backward()
        for k, p in case.model.named_parameters():
            assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)
        for dropped in (a, b):
            with pytest.raises(UnsupportedModelError, match="records were dropped"):
                dropped.backward()
        sum(p.square().sum() for p in case.model.parameters()).backward()


def test_a_backward_through_a_dropped_forward_is_refused():
    """Forward, then a forward of another batch size under grad (its records replace the
    first's), then the first forward's backward: an error (was silently no quantities); the
    second forward's backward is exact."""
    case = build("mlp")
    x2, y2 = case.x[:2], case.y[:2]
    expected = individual_gradients(case.model, case.loss, x2, y2, "sum")
    with leanprop.per_sample(case.model, BatchGrad()):
        first = case.loss(case.model(case.x), case.y, "sum")
        second = case.loss(case.model(x2), y2, "sum")
        with pytest.raises(UnsupportedModelError, match="records were dropped"):
            first.backward()
        case.model.zero_grad()
        second.backward()
    for k, p in case.model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


def test_a_forward_under_no_grad_between_leaves_checkpointing_exact():
    """Non-reentrant checkpoint recomputes its block in backward, after an evaluation forward
    under torch.no_grad ran: exact (was no quantities)."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            h = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False)
            return self.b(h)

    torch.manual_seed(0)
    model = Checkpointed().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    names, params = zip(*model.named_parameters(), strict=True)
    rows = [torch.autograd.grad(model(x[i : i + 1]).square().sum(), params) for i in range(5)]
    expected = {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(names)}
    with leanprop.per_sample(model, BatchGrad()):
        loss = model(x).square().sum()
        with torch.no_grad():
            model(x[:2])
        loss.backward()
    for k, p in model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


def test_nested_contexts_with_parameters_broadcast_over_the_batch():
    """A position table and a learned scale (broadcast over the batch) under two contexts on
    the same model: each exact (one's batched VJPs ran through the other's captures: a raw
    vmap error, or with check=False a dead batched tensor as the result)."""

    class Broadcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
            self.pos, self.scale = nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(4))

        def forward(self, x):
            return self.head((self.tok(x) + self.pos) * self.scale)

    torch.manual_seed(0)
    model = Broadcast().double()
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    params = list(model.parameters())
    rows = [torch.autograd.grad(model(x[i : i + 1]).square().sum(), params) for i in range(3)]
    with leanprop.per_sample(model, BatchGrad()), leanprop.per_sample(model, Variance()):
        model(x).square().sum().backward()
    for j, (k, p) in enumerate(model.named_parameters()):
        ref = torch.stack([r[j] for r in rows])
        assert_close(p.grad_batch, ref, f"{k}.grad_batch", 1e-10, 1e-12)
        assert_close(p.variance, ref.var(0, unbiased=False), f"{k}.variance", 1e-10, 1e-12)


def test_backward_through_a_forward_outside_the_block_is_refused():
    """A forward run before the block, its backward inside: the parameters got gradients and
    no quantities, and nothing said so."""
    model = nn.Linear(3, 2)
    out = model(torch.randn(4, 3))
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        with pytest.raises(leanprop.UnsupportedModelError, match=r"outside the `with` block"):
            out.sum().backward()
        model(torch.randn(4, 3)).sum().backward()  # usable afterwards
    assert model.weight.grad_batch.shape == (4, 2, 3)


@pytest.mark.parametrize("n_later", [2, 6])  # 6: the sequence length of the dropped forward
def test_backward_through_a_dropped_forward_of_an_rnn_is_refused(n_later):
    """An RNN (its only tracked module is a fallback root): a later forward of another batch
    size dropped the first forward's records; a backward through the first one wrote no
    quantities and raised nothing (the refusal covered captured ops only)."""
    torch.manual_seed(0)
    model = nn.LSTM(3, 4, batch_first=True)
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        first = model(torch.randn(5, 6, 3))[0]
        model(torch.randn(n_later, 6, 3))
        with pytest.raises(leanprop.UnsupportedModelError, match=r"forward of 5 samples"):
            first.sum().backward()


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize(
    "make, x",
    [
        (lambda: nn.Linear(3, 2), lambda: torch.randn(4, 3)),
        (lambda: nn.Conv1d(2, 3, 3), lambda: torch.randn(4, 2, 5)),
        (lambda: nn.LayerNorm(3), lambda: torch.randn(4, 3)),
        (lambda: nn.Embedding(7, 3), lambda: torch.randint(0, 7, (4, 5))),
    ],
    ids=["linear", "conv", "layernorm", "embedding"],
)
def test_a_bare_layer_as_the_model_over_several_steps(make, x, check):
    """The model is one layer with a rule: from the second step in one context on, its
    individual gradients were doubled (check=False: silently; check=True: a sum-check error),
    because the model's new-forward hook ran after its own layer hook and reset it."""
    torch.manual_seed(0)
    model = make().double()
    with leanprop.per_sample(model, leanprop.BatchGrad(), check=check):
        for _ in range(3):
            batch = x()
            batch = batch.double() if batch.is_floating_point() else batch
            model(batch).square().sum().backward()
            oracle = copy.deepcopy(model)  # (not tracked: its forward passes are its own)
            for (k, p), q in zip(model.named_parameters(), oracle.parameters(), strict=True):
                expected = []
                for b in batch:
                    (g,) = torch.autograd.grad(oracle(b[None]).square().sum(), q)
                    expected.append(g)
                torch.testing.assert_close(p.grad_batch, torch.stack(expected), msg=k)
            model.zero_grad()


def test_a_deep_copy_made_inside_the_block_is_not_tracked():
    """A lookahead/inner-loop copy made inside the block shared the context's hooks: its
    forward and backward overwrote the original's quantities, even with the sum check on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        model(x).square().sum().backward()
        before = {k: p.grad_batch.clone() for k, p in model.named_parameters()}
        inner = copy.deepcopy(model)
        inner(torch.randn(3, 3, dtype=torch.float64)).square().sum().backward()
        assert not hasattr(inner[0].weight, "grad_batch")
    for k, p in model.named_parameters():
        assert torch.equal(p.grad_batch, before[k]), k


@pytest.mark.parametrize("check", [True, False])
def test_a_submodule_called_on_its_own_with_a_tied_weight_is_refused(check):
    """The context on a parent, a child with an embedding tied to its head called directly:
    the tied weight got only the head's share (check=False: silently). Quantities of a
    forward that calls modules on their own are now always checked."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e, self.o = nn.Embedding(7, 3), nn.Linear(3, 7, bias=False)
            self.o.weight = self.e.weight

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.o(torch.tanh(self.e(t)))

    torch.manual_seed(0)
    parent = nn.ModuleDict({"lm": Tied(), "other": nn.Linear(2, 2)})
    context = leanprop.per_sample(parent, leanprop.BatchGrad(), check=check)
    with context, pytest.raises(leanprop.UnsupportedModelError, match=r"called on its own"):
        parent["lm"](torch.randint(0, 7, (4, 5))).square().sum().backward()


def test_an_empty_batch_through_a_reshape():
    """N=0 (a Poisson-sampled batch can be empty): a reshape of a batched tensor raised
    ZeroDivisionError in the batch tracker."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Flatten(0, -1), nn.Unflatten(0, (-1, 4)),
                          nn.Linear(4, 2))  # fmt: skip
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        for n in (5, 0):
            model(torch.randn(n, 3)).flatten(1).square().sum().backward()
            assert model[0].weight.grad_batch.shape == (n, 4, 3)


def test_a_direct_call_after_a_step_is_exact():
    """A module called on its own after an ordinary step, its output fed to the model: the
    model's new-forward hook dropped the call's records and the "checked" mark (silently
    wrong with check=False); then refused. The lookup's rows, computed from the weight alone
    before the forward, now stay known as such: batch-shaped, they meet the batch as the
    model's input, row n sample n's, and the result is exact."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e, self.o = nn.Embedding(7, 3), nn.Linear(3, 7, bias=False)
            self.o.weight = self.e.weight

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.o(torch.tanh(h))

    torch.manual_seed(0)
    model = Tied().double()
    tokens = torch.randint(0, 7, (4, 5))
    with leanprop.per_sample(model, leanprop.BatchGrad(), check=False):
        model(torch.randn(4, 5, 3, dtype=torch.float64)).square().sum().backward()
        model.zero_grad()
        model(model.e(tokens)).square().sum().backward()
    expected = individual_gradients(
        nn.Sequential(model.e, model), lambda o, y, r: o.square().sum(), tokens, tokens, "sum"
    )
    assert_close(model.e.weight.grad_batch, expected["0.weight"], "tied weight", 1e-12, 1e-14)


def test_a_penalty_on_the_weights_before_the_loss_backward():
    """A backward of a weight penalty before the loss's backward (both after one forward):
    the penalty's gradient reached the parameters first and was refused as a forward outside
    the block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        out = model(torch.randn(5, 3))
        sum(p.square().sum() for p in model.parameters()).mul(1e-3).backward()
        out.square().sum().backward()
    assert model[0].weight.grad_batch.shape == (5, 4, 3)


@pytest.mark.parametrize("quantity", [leanprop.BatchGrad(), leanprop.BatchL2Grad()])
def test_an_empty_batch_through_an_op_level_linear_on_sequences(quantity):
    """N=0 through F.linear on [N, T, D] (GPT-2's Conv1D path): a reshape of zero samples."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.w)

    model = Functional()
    with leanprop.per_sample(model, quantity):
        model(torch.randn(0, 5, 3)).square().sum().backward()
    assert getattr(model.w, quantity.attr).shape[0] == 0


def test_modules_called_on_their_own_over_several_steps():
    """Two modules of the model called on their own, several steps in one block: exact (the
    first call of a new forward starts it, before the module marks itself as running)."""
    torch.manual_seed(0)
    parent = nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Linear(4, 2)}).double()
    oracle = copy.deepcopy(parent)
    with leanprop.per_sample(parent, leanprop.BatchGrad(), check=False):
        for _ in range(3):
            x = torch.randn(5, 3, dtype=torch.float64)
            parent["b"](torch.tanh(parent["a"](x))).square().sum().backward()

            def loss(xi: torch.Tensor) -> torch.Tensor:
                return oracle["b"](torch.tanh(oracle["a"](xi[None]))).square().sum()

            for (k, p), q in zip(parent.named_parameters(), oracle.parameters(), strict=True):
                expected = [torch.autograd.grad(loss(xi), q)[0] for xi in x]
                torch.testing.assert_close(p.grad_batch, torch.stack(expected), msg=k)
            parent.zero_grad()


def test_a_layer_norm_over_the_batch_dimension_is_refused():
    """``batch_dim=1`` and a LayerNorm normalising ``[N, D]``: it mixes the samples (T == N
    silently gave a wrong ``.grad``, T != N a raw error from inside the rule)."""
    for t in (4, 3):
        model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm((4, 5)), nn.Linear(5, 2)).double()
        x = torch.randn(t, 4, 3, dtype=torch.float64)
        ctx = leanprop.per_sample(model, BatchGrad(), batch_dim=1)
        with ctx, pytest.raises(BatchError, match="LayerNorm '1' mixes the samples"):
            model(x)
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        model(x).sum().backward()  # (nothing left behind)


@pytest.mark.parametrize("layer", ["linear", "conv", "layer_norm"])
def test_weight_changed_between_forward_and_backward_is_refused_as_torch_does(layer):
    """The replaced ops read the module's weight in backward (for the input's gradient): one
    changed in place since the forward (an optimizer stepping early) is refused as the plain
    op's backward refuses it, never used silently."""
    first, x = {
        "linear": (nn.Linear(3, 4), torch.randn(5, 3)),
        "conv": (nn.Conv1d(3, 4, 3, padding=1), torch.randn(5, 3, 6)),
        "layer_norm": (nn.LayerNorm(3), torch.randn(5, 3)),
    }[layer]
    x.requires_grad_()  # (else neither needs the weight in backward)
    model = nn.Sequential(first, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2))
    model(x)  # (the lazy layer's shape)
    for wrapped in (False, True):
        out = None
        with contextlib.ExitStack() as stack:
            if wrapped:
                stack.enter_context(leanprop.per_sample(model, leanprop.BatchGrad()))
            out = model(x)
            with torch.no_grad():
                first.weight.mul_(2.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
        model.zero_grad()


@pytest.mark.parametrize("quantity", ["BatchGrad", "BatchL2Grad"])
def test_a_layer_registered_twice_and_called_at_both_places(quantity):
    """``nn.Sequential(shared, act, shared)``: one layer object at two places of the model
    (the sum check refused it before: each place got a site of its own, and each call was
    recorded twice)."""
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)

    def loss(out, target, reduction):
        return F.mse_loss(out, target, reduction=reduction)

    expected = individual_gradients(copy.deepcopy(model), loss, x, y, "sum")
    with leanprop.per_sample(model, getattr(leanprop, quantity)()):
        loss(model(x), y, "sum").backward()
    for k, p in model.named_parameters():
        if quantity == "BatchGrad":
            assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)
        else:
            norms = expected[k].flatten(1).square().sum(1)
            assert_close(p.batch_l2, norms, k, 1e-10, 1e-12)


def _mean_square(out, y, reduction):
    """``out.square().mean()`` over samples and outputs, as the oracle's loss."""
    per_sample = out.square().mean(1)
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


def _penalised(lam: float, dtype: torch.dtype, where: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(dtype)
    x = torch.randn(5, 4, dtype=dtype)

    def loss():
        if where == "penalty-first":  # computed before the forward
            penalty = lam * sum(p.square().sum() for p in model.parameters())
            return penalty + model(x).square().mean()
        out = model(x).square()
        if where == "penalty":  # weight decay written into the loss
            return out.mean() + lam * sum(p.square().sum() for p in model.parameters())
        return out.mean() * (1 + lam * model[2].bias.sum())  # scaled after the mean

    return model, x, loss


@pytest.mark.parametrize("where", ["penalty", "penalty-first", "scale"])
@pytest.mark.parametrize(
    ("lam", "dtype"),
    [(1e-1, torch.float64), (1e-12, torch.float32)],
    ids=["large", "below-float32-tolerance"],
)
def test_parameters_reaching_the_loss_after_the_samples_are_refused_at_any_size(lam, dtype, where):
    """A penalty on the parameters added to the mean loss (or the mean loss scaled by a
    parameter) is no sample's: the sum check refused it only where it was large, a small one
    in float32 passed silently (the per-sample quantities leaving it out). Now refused by
    structure, at any size."""
    model, _, loss = _penalised(lam, dtype, where)
    with (
        pytest.raises(UnsupportedModelError, match=r"reach the loss after the samples were comb"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        loss().backward()


def test_a_penalty_not_in_the_loss_or_backpropagated_apart_is_no_error():
    """Only a backward that reaches the parameters through the combined values counts: a
    penalty computed for logging, or given its own backward after the block, is fine."""
    model, x, _ = _penalised(0.1, torch.float64, "penalty")
    with leanprop.per_sample(model, BatchGrad()):
        out = model(x).square().mean()
        logged = (out + 0.1 * model[0].weight.square().sum()).detach()  # noqa: F841
        out.backward()
    expected = individual_gradients(model, _mean_square, x, torch.zeros(5), "mean")
    for k, p in model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)
    (0.1 * model[0].weight.square().sum()).backward()  # the penalty's own backward


def test_check_false_gives_the_per_sample_part_of_a_penalised_loss():
    model, x, loss = _penalised(0.1, torch.float64, "penalty")
    with leanprop.per_sample(model, BatchGrad(), check=False):
        loss().backward()
    expected = individual_gradients(model, _mean_square, x, torch.zeros(5), "mean")
    for k, p in model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


class FunctionalBatchNorm(nn.Module):
    def __init__(self, training: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))
        self.training_stats = training

    def forward(self, x):
        h = self.lin(x)
        return F.batch_norm(h, self.mean, self.var, training=self.training_stats).square()


def test_functional_batch_norm_in_training_mode_is_refused():
    """F.batch_norm(training=True) in a module's forward (not an nn.BatchNorm) mixed the
    samples silently; in eval form (running statistics) it is exact."""
    x = torch.randn(5, 4, dtype=torch.float64)
    model = FunctionalBatchNorm(training=True).double()
    with (
        pytest.raises(UnsupportedModelError, match=r"'batch_norm' \(a functional batch norm\)"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(x).sum().backward()
    model = FunctionalBatchNorm(training=False).double()  # the eval form: exact
    with leanprop.per_sample(model, BatchGrad()):
        model(x).sum().backward()
    expected = individual_gradients(model, lambda o, y, r: o.sum(), x, torch.zeros(5), "sum")
    for k, p in model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


def _mlp_with_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    model.s = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    return model, torch.randn(5, 4, dtype=torch.float64)


def _exact(model, x, scale):
    expected = individual_gradients(model, lambda o, y, r: _mean_square(o, y, r) * scale, x,
                                    torch.zeros(5), "mean")  # fmt: skip
    for k, p in model.named_parameters():
        if k != "s":
            assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


@pytest.mark.parametrize("how", ["detached", "no_grad", "earlier-step", "zero-times"])
def test_parameter_values_without_a_gradient_through_the_loss_are_no_escape(how):
    """A parameter's value that gives it no gradient there (detached, computed under
    torch.no_grad(), possibly a step earlier; or DDP's idiom `loss + 0.0 * sum(p.sum())`) was
    refused as reaching the loss after the samples were combined."""
    model, x = _mlp_with_scale()
    with torch.no_grad():
        norm = model[0].weight.norm()  # (computed before the block: an earlier step's)
    with leanprop.per_sample(model, BatchGrad()):
        loss = model(x).square().mean(1).mean()
        if how == "detached":
            loss = loss * model.s.detach()
        elif how == "no_grad":
            with torch.no_grad():
                now = model[0].weight.norm()
            loss = loss * (norm / now)
        elif how == "earlier-step":
            loss = loss * (norm / norm)
        else:
            loss = loss + 0.0 * sum(p.sum() for p in model[0].parameters())
        loss.backward()
    _exact(model, x, 2.0 if how == "detached" else 1.0)


def test_an_earlier_backward_reaching_a_parameter_after_the_samples_leaves_the_next_alone():
    """Uncertainty weighting: a weight learned from the detached loss, its own backward first.
    What that backward's watched use found was held over and refused the loss's backward."""
    model, x = _mlp_with_scale()
    with leanprop.per_sample(model, BatchGrad()):
        loss = model(x).square().mean(1).mean()
        (model.s * loss.detach()).backward()
        loss.backward()
    _exact(model, x, 1.0)


def test_masked_token_loss_with_a_tiny_penalty_is_refused():
    """Tokens selected by a boolean mask (HF's padding) leave no batch dimension in the loss's
    input, so the loss was no sum of samples to the check, and a penalty 1e-9 λ||w||² in float32
    passed silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(5, 6, 4), torch.randint(0, 3, (5, 6))
    y[:, 4:] = -100
    with (
        pytest.raises(UnsupportedModelError, match="after the samples were combined"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        active = y.view(-1) != -100
        loss = F.cross_entropy(model(x).view(-1, 3)[active], y.view(-1)[active])
        (loss + 1e-9 * sum(p.square().sum() for p in model.parameters())).backward()


@pytest.mark.parametrize("batch_dim", [0, 1])
def test_a_parameter_applied_in_the_loss_after_the_forward_is_refused(batch_dim):
    """`(F.mse_loss(out, y, reduction='none') * w).mean()` outside the model's forward: the use
    of w is not followed there, and w got a gradient but no quantities, silently (reached
    before the backward's quantities began, its gradient was not counted)."""

    class Weighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.w = nn.Linear(4, 3), nn.Parameter(torch.rand(3))

        def forward(self, x):
            return self.lin(x)

    torch.manual_seed(0)
    model = Weighted().double()
    x, y = torch.randn(5, 4, 4, dtype=torch.float64), torch.randn(5, 4, 3, dtype=torch.float64)
    with (
        pytest.raises(UnsupportedModelError, match=r"'w' got a gradient .* applied in the loss"),
        leanprop.per_sample(model, BatchGrad(), batch_dim=batch_dim),
    ):
        (F.mse_loss(model(x), y, reduction="none") * model.w).mean().backward()


class StdConv2d(nn.Conv2d):
    """timm's weight-standardised convolution (BiT, ResNetV2, NFNet): the weight normalised by
    F.batch_norm(training=True) over its own elements, no batch in it."""

    def forward(self, x):
        flat = self.weight.reshape(1, self.out_channels, -1)
        weight = F.batch_norm(flat, None, None, training=True, momentum=0.0, eps=1e-6)
        weight = weight.reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding)


def test_batch_norm_of_no_batch_or_without_autograd_is_not_refused():
    """The functional batch-norm check refused a weight standardisation (no batch in its
    input) and a mean teacher's BatchNorm in training mode under torch.no_grad()."""
    torch.manual_seed(0)
    model = nn.Sequential(StdConv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).double()
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    with leanprop.per_sample(model, BatchGrad()):
        model(x).square().sum().backward()
    expected = individual_gradients(model, lambda o, y, r: o.square().sum(), x, x, "sum")
    for k, p in model.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)
    student = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    teacher = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    with leanprop.per_sample(student, BatchGrad()):
        out = student(x)
        with torch.no_grad():
            target = teacher(x)
        (out - target).square().sum().backward()
    expected = individual_gradients(student, lambda o, y, r: (o - y).square().sum(), x, target,
                                    "sum")  # fmt: skip
    for k, p in student.named_parameters():
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)


@pytest.mark.parametrize("form", ["stack", "in-place", "in-place-from-zeros"])
def test_a_small_penalty_joined_in_other_forms_is_refused(form):
    """`torch.stack([loss, penalty]).sum()` (a list argument) and `total = penalty; total +=
    loss` (the penalty the target of an in-place op) passed silently below the sum check's
    tolerance, or raised torch's error about a view changed in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with (
        pytest.raises(UnsupportedModelError, match="after the samples were combined"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        penalty = 1e-4 * sum(p.square().sum() for p in model.parameters())
        loss = F.cross_entropy(model(x), y)
        if form == "stack":
            total = torch.stack([loss, penalty]).sum()
        elif form == "in-place":
            total = penalty
            total += loss
        else:
            total = torch.zeros(())
            total += penalty
            total += loss
        total.backward()
    with leanprop.per_sample(model, BatchGrad(), check=False):  # (unchecked: not watched)
        total = 1e-4 * sum(p.square().sum() for p in model.parameters())
        total += F.cross_entropy(model(x), y)
        total.backward()


def test_per_sample_losses_with_the_targets_a_forward_input():
    """`F.cross_entropy(logits, y, reduction='none')` with `y` passed to the forward (HF
    style) took the batch in the targets for lost, and refused a per-sample weight after it."""

    class Tagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.s = nn.Linear(4, 3), nn.Parameter(torch.tensor(0.3))

        def forward(self, x, y):
            return F.cross_entropy(self.lin(x), y, reduction="none") * self.s.exp()

    torch.manual_seed(0)
    model = Tagged().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with leanprop.per_sample(model, BatchGrad(), batch_dims={"y": 0}):
        model(x, y).sum().backward()
    for k, p in model.named_parameters():
        rows = [
            torch.autograd.grad(model(x[i : i + 1], y[i : i + 1]).sum(), p)[0] for i in range(5)
        ]
        assert_close(p.grad_batch, torch.stack(rows), k, 1e-10, 1e-12)


@pytest.mark.parametrize("where", ["masked tokens", "batch last"])
def test_functional_batch_norm_over_a_moved_or_lost_batch_is_refused(where):
    """Refused only with the batch in dim 0, F.batch_norm over tokens selected by a mask (the
    batch lost) or with the batch last mixed samples silently."""

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            h = self.lin(x)  # [N, T, 3]
            if where == "masked tokens":
                h = h[torch.ones(h.shape[:2], dtype=torch.bool)]  # [N*T, 3], samples lost
            else:
                h = h.permute(1, 2, 0)  # [T, 3, N]: the batch last
            return F.batch_norm(h, None, None, training=True)

    model = Norm().double()
    with (
        pytest.raises(UnsupportedModelError, match="functional batch norm"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(torch.randn(4, 5, 4, dtype=torch.float64)).square().sum().backward()


@pytest.mark.parametrize("join", ["cosine_embedding", "dot", "matmul"])
def test_penalties_next_to_other_sums_of_samples_are_refused(join):
    """Losses outside the first list (cosine embedding, ...) and products contracting the
    batch (per-sample losses @ weights) were not taken for sums of samples: a tiny penalty
    beside them passed silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, weights = torch.randn(6, 4), torch.rand(6)
    with (
        pytest.raises(UnsupportedModelError, match="after the samples were combined"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        out = model(x)
        if join == "cosine_embedding":
            loss = F.cosine_embedding_loss(out, torch.ones_like(out), torch.ones(6))
        else:
            losses = out.square().sum(1)
            loss = torch.dot(losses, weights) if join == "dot" else losses @ weights
        (loss + 1e-9 * model[0].weight.square().sum()).backward()


def test_autograd_grad_with_materialize_grads_computes_its_own_results():
    """``autograd.grad(..., materialize_grads=True)`` was taken for a form left to torch: it
    computed nothing and the previous backward's results stayed on the parameters as its own
    (stale, silently). Its results now are its own, and unused inputs get zeros, as torch's."""
    case = build("mlp")
    params = list(case.model.parameters())
    unused = nn.Parameter(torch.randn(3, dtype=torch.float64))
    with leanprop.per_sample(case.model, BatchGrad()):
        case.loss(case.model(case.x), case.y, "sum").backward()
        for p in params:
            p.grad = None
        loss = case.loss(case.model(2 * case.x), case.y, "sum")
        grads = torch.autograd.grad(loss, [*params, unused], materialize_grads=True)
    expected = individual_gradients(case.model, case.loss, 2 * case.x, case.y, "sum")
    for (k, p), g in zip(case.model.named_parameters(), grads, strict=False):
        assert_close(p.grad_batch, expected[k], k, 1e-10, 1e-12)
        assert_close(g, expected[k].sum(0), k, 1e-10, 1e-12)
    assert torch.equal(grads[-1], torch.zeros_like(unused))


class _OpLevel(nn.Module):
    """Layers whose parameters are used at the op level: HF's Conv1D (addmm: a closed form)
    and MultiheadAttention (its projections in ops with none: the generic path)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.proj = Conv1D(4, 3)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        return self.head(self.attn(h, h, h, need_weights=False)[0])


@pytest.mark.parametrize("inner_on", ["model", "submodule"])
@pytest.mark.parametrize("quantities", ["grad+variance", "l2+grad"])
def test_nested_contexts_with_op_level_layers_each_compute_theirs(inner_on, quantities):
    """Two contexts on the same op-level parameters: the inner one captured the op and the
    outer one, whose capture ran inside it, got nothing (its closed forms skipped the op's
    backward, or that backward was taken for one with respect to inputs only): raised "got a
    gradient but no per-sample quantities"."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _OpLevel().double()
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    params = dict(model.named_parameters())
    rows = [
        torch.autograd.grad(model(x[i : i + 1]).square().sum(), list(params.values()))
        for i in range(3)
    ]
    expected = {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}
    outer_q, inner_q = (
        (BatchGrad(), Variance()) if quantities == "grad+variance" else
        (leanprop.BatchL2Grad(), BatchGrad())
    )  # fmt: skip
    inner = model if inner_on == "model" else model.proj
    with leanprop.per_sample(model, outer_q), leanprop.per_sample(inner, inner_q):
        model(x).square().sum().backward()
    ref = {
        "grad_batch": lambda e: e,
        "variance": lambda e: e.var(0, unbiased=False),
        "batch_l2": lambda e: e.flatten(1).square().sum(1),
    }
    prefix = "" if inner_on == "model" else "proj."
    for k, p in model.named_parameters():
        assert_close(getattr(p, outer_q.attr), ref[outer_q.attr](expected[k]), k, 1e-10, 1e-12)
        assert_close(p.grad, expected[k].sum(0), f"{k}.grad", 1e-10, 1e-12)
    for k, p in inner.named_parameters():
        e = expected[prefix + k]
        assert_close(getattr(p, inner_q.attr), ref[inner_q.attr](e), k, 1e-10, 1e-12)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.parametrize("contexts", ["one", "two on disjoint modules"])
def test_chunked_cross_entropy_is_not_taken_for_another_contexts_capture(contexts):
    """An op-level capture of ``chunked_linear_cross_entropy`` has leanprop's own autograd
    function in its local graph, which was taken for another context's capture (nested
    contexts): create_graph was refused with "two nested per_sample contexts both track"
    where none, or one other context on other parameters, was open; the op's own refusal
    comes instead. Without create_graph, exact."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix, self.head = nn.Linear(4, 4), nn.Linear(4, 11)

        def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.mix(h)).flatten(0, 1)
            return leanprop.chunked_linear_cross_entropy(
                h, self.head.weight, y.flatten(), self.head.bias, chunk_size=3
            )

    torch.manual_seed(0)
    body, top = nn.Linear(4, 4).double(), Head().double()
    x, y = torch.randn(4, 4, 4, dtype=torch.float64), torch.randint(0, 11, (4, 4))

    def opened() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if contexts != "one":
            stack.enter_context(leanprop.per_sample(body, BatchGrad()))
        stack.enter_context(leanprop.per_sample(top, BatchGrad()))
        return stack

    with opened(), pytest.raises(UnsupportedModelError, match="chunk by chunk"):
        top(body(x), y).backward(create_graph=True)
    for p in [*body.parameters(), *top.parameters()]:
        p.grad = None
    with opened():
        top(body(x), y).backward()
    rows = [
        torch.autograd.grad(
            top(body(x[i : i + 1]), y[i : i + 1]) / 4, list(top.parameters())
        )  # (a mean over the 16 tokens: each sample's share)
        for i in range(4)
    ]
    for j, p in enumerate(top.parameters()):
        assert_close(p.grad_batch, torch.stack([r[j] for r in rows]), f"{j}", 1e-10, 1e-12)


def test_nested_contexts_with_op_level_layers_under_create_graph_are_refused_clearly():
    """Under create_graph the op's graph is rebuilt without the other context's capture:
    the outer context got nothing ("got a gradient but no per-sample quantities"). Refused
    with what to do instead; both contexts stay usable."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(4, 3), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    with leanprop.per_sample(model, BatchGrad()), leanprop.per_sample(model[0], Variance()):
        with pytest.raises(UnsupportedModelError, match="two nested per_sample contexts"):
            model(x).square().sum().backward(create_graph=True)
        for p in model.parameters():
            p.grad = None
        model(x).square().sum().backward()
    rows = [
        torch.autograd.grad(model(x[i : i + 1]).square().sum(), list(model.parameters()))
        for i in range(3)
    ]
    for j, p in enumerate(model.parameters()):
        assert_close(p.grad_batch, torch.stack([r[j] for r in rows]), f"{j}", 1e-10, 1e-12)


def test_metadata_and_gradient_bookkeeping_are_not_followed(monkeypatch):
    """Reading a tensor's metadata, or reading (where autograd does not record: in hooks,
    optimizers) and setting a parameter's ``.grad`` is no use of the parameter: passed through
    without the capture's bookkeeping. ``.grad`` was followed as an op, about 40 µs each, 330
    per step of a small clipped transformer, in its backward. Read where autograd records, it
    is followed (a create_graph gradient leads back to its parameter)."""
    from leanprop.per_sample.capture import PerSample

    followed: list[str] = []
    real = PerSample.run_op

    def run_op(self, func, args, kwargs):
        followed.append(getattr(func, "__name__", str(func)))
        return real(self, func, args, kwargs)

    monkeypatch.setattr(PerSample, "run_op", run_op)
    model = nn.Linear(3, 2)
    with leanprop.clip_per_sample(model, 1.0):
        model(torch.randn(4, 3)).sum().backward()  # (its hooks read and set .grad)
        followed.clear()
        w = model.weight
        _ = (w.shape, w.dtype, w.requires_grad, w.dim(), w._post_accumulate_grad_hooks)
        with torch.no_grad():
            w.grad = w.grad * 1
        assert followed == []
        _ = w * 2  # (a use: followed)
        _ = w.grad
    assert len(followed) == 2 and "mul" in followed[0] and followed[1] == "__get__", followed


def test_create_graph_through_an_op_whose_result_changed_in_place_is_refused():
    """Its fresh graph for the second derivatives cannot be checked against the forward's
    values (which would tell randomness inside the op); without create_graph it is exact (the
    model zoo's in_place_after_layers)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 3, 1), nn.BatchNorm1d(3)).double().eval()
    x = torch.randn(4, 3, 5, dtype=torch.float64)

    def forward() -> torch.Tensor:
        h = model(x)
        h += x  # (in place on the BatchNorm's result)
        return h.square().sum()

    with leanprop.per_sample(model, leanprop.BatchGrad()):
        loss = forward()
        with pytest.raises(leanprop.UnsupportedModelError, match="changed in place"):
            loss.backward(create_graph=True)


class SmallEscape(nn.Module):
    """The weight used again in an in-place op outside its module (as InPlaceUse's, an op
    leanprop leaves alone), its share of the gradient a millionth of the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        return h + torch.zeros_like(h).addmm_(x, self.lin.weight.t(), alpha=1e-6)


def test_the_sum_check_takes_a_module_scale_for_rounding_not_for_errors():
    """A parameter's difference may be taken relative to its module's gradient (a bias whose
    gradient is zero but for rounding, HF BART's key projections'); an escaped use a millionth
    of the module's gradient is still refused in float64."""
    model = SmallEscape().double()
    with (
        pytest.raises(UnsupportedModelError, match=r"do not add up.*'lin\.weight'"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(torch.randn(4, 3, dtype=torch.float64)).square().sum().backward()


@pytest.mark.parametrize(
    "loss",
    [lambda o: (o - o.mean(0)).square().sum(), lambda o: F.cross_entropy(o @ o.T, torch.arange(4)),
     lambda o: (o.softmax(0) * o).sum(),
     lambda o: 1 - (2 * (o.sigmoid() * 0.5).sum(0) / (o.sigmoid().sum(0) + 1)).mean(),
     lambda o: F.relu(1 - o.std(0)).mean() + torch.cov(o.T).square().sum(),
     lambda o: torch.cdist(o, o).exp().sum(),
     lambda o: -F.logsigmoid(o[:2].sum(1) - o[2:].sum(1)).mean(),
     lambda o: -F.logsigmoid(o.sum(1)[[0, 1]] - o.sum(1)[[2, 3]]).mean(),
     lambda o: -F.logsigmoid(torch.sub(*o.sum(1).split_with_sizes([2, 2]))).mean(),
     lambda o: F.cross_entropy(torch.stack([o[:2, 0], o[2:, 0]], 1), torch.zeros(2).long()),
     lambda o: o[1:].sum(0).square().sum(),
     lambda o: torch.tensordot(o, o, ([1], [1])).exp().sum(),
     lambda o: (o.view(2, 2, 4).softmax(1) * o.view(2, 2, 4)).sum(),
     lambda o: F.cross_entropy(o.T, torch.arange(4))],
    ids=["centred", "contrastive", "softmax-over-the-batch", "batch-dice", "variance-covariance",
         "distances-between-samples", "a-preference-pair's-halves", "halves-by-list-indices",
         "halves-by-split_with_sizes", "halves-side-by-side", "a-pick's-sum-squared",
         "a-gram-matrix-by-tensordot", "a-softmax-within-groups", "the-samples-as-classes"],
)  # fmt: skip
def test_a_loss_that_mixes_the_samples_after_the_last_layer_is_refused(loss):
    """It ran: each sample's values through the others' leave no sample its own gradient,
    yet the contributions add up to p.grad, so the sum check passed (sample-alone errors of
    50-300 %). N == 4 == the output's width, where o @ o.T keeps the output's shape.
    check=False gives the contributions, which add up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with leanprop.per_sample(model, BatchGrad()):
        with pytest.raises(UnsupportedModelError, match="mixes the samples"):
            loss(model(x)).backward()
        model(x).square().sum().backward()  # (usable after the refusal)
    assert model[0].weight.grad_batch.shape == (4, 4, 3)
    model.zero_grad()
    with leanprop.per_sample(model, BatchGrad(), check=False):
        loss(model(x)).backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "loss",
    [lambda o, y: F.cross_entropy(torch.cat([o[:2], o[2:]]), y),
     lambda o, y: F.cross_entropy(o[:4], y) + (o[1:][:2] * o[1:3]).sum(),
     lambda o, y: F.cross_entropy(o.flip(0).flip(0), y),
     lambda o, y: F.cross_entropy(o[:3].flip(0), y[:3].flip(0)) + o[3].square().sum(),
     lambda o, y: F.cross_entropy(o, y, reduction="none").view(2, 2).mean(1).amax()],
    ids=["halves-put-back-together", "the-same-picks-by-two-routes", "flipped-twice",
         "a-part-reordered-with-its-labels", "the-worst-group's-loss"],
)  # fmt: skip
def test_losses_over_picks_of_the_samples_are_exact(loss):
    """Picks of the samples followed as batches of them: the same samples by different
    routes meet freely (each term still one sample's), against a per-sample loop. Before,
    ``o[1:][:2] * o[1:3]`` was refused as mixing. N == 4 == the width."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([1, 0, 3, 2])
    with leanprop.per_sample(model, BatchGrad()):
        loss(model(x), y).backward()
    for n in range(4):

        def alone(p, n=n):  # (sample n's term: the loss with the other samples' outputs fixed)
            with torch.no_grad():
                fixed = model(x)
            o = torch.cat([fixed[:n], p, fixed[n + 1 :]])
            return loss(o, y)

        model.zero_grad()
        out = model(x[n : n + 1])
        torch.autograd.backward(alone(out))
        for p in model.parameters():
            torch.testing.assert_close(p.grad_batch[n], p.grad, rtol=1e-12, atol=1e-12)


class PartsRejoined(nn.Module):
    """Parts of the batch put back together in another order between two layers."""

    def __init__(self, rejoin) -> None:
        super().__init__()
        self.a, self.b, self.rejoin = nn.Linear(4, 4), nn.Linear(4, 4), rejoin

    def forward(self, x):
        return self.b(self.rejoin(self.a(x).tanh()))


@pytest.mark.parametrize(
    "rejoin",
    [lambda h: torch.cat([h.flip(0)[:2], h.flip(0)[2:]]),
     lambda h: torch.cat(h.roll(1, 0).chunk(2)),
     lambda h: torch.cat(h[torch.tensor([2, 0, 3, 1])].split(2))],
    ids=["a-flipped-batch's-halves", "a-rolled-batch's-chunks", "a-permuted-batch's-splits"],
)  # fmt: skip
def test_parts_of_a_reordered_batch_put_together_are_not_taken_for_the_batch(rejoin):
    """Picks of a reordered batch hold its samples in its order (``h.flip(0)[:2]`` holds 3
    and 2): put back together they are the samples in another order, and the layer after them
    is a clear error. (A first version of following picks took them at their positions, put
    back together the batch in order: another sample's gradients, errors of 0.2 in float64,
    the sum check passed.)"""
    torch.manual_seed(0)
    model = PartsRejoined(rejoin).double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.tensor([1, 0, 3, 2])
    with (
        pytest.raises(BatchError, match="samples in another order"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        F.cross_entropy(model(x), y).backward()


class HeadsForParts(nn.Module):
    """A head for each part of the batch (by a slice, or a mask)."""

    def __init__(self, by_mask: bool) -> None:
        super().__init__()
        self.a, self.h1, self.h2 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.by_mask = by_mask

    def forward(self, x):
        h = self.a(x).tanh()
        if self.by_mask:
            mask = x[:, 0] > 0
            return torch.cat([self.h1(h[mask]), self.h2(h[~mask])])
        return torch.cat([self.h1(h[:2]), self.h2(h[2:])])


@pytest.mark.parametrize("by_mask", [False, True], ids=["by-a-slice", "by-a-mask"])
def test_a_layer_run_on_part_of_the_batch_is_a_clear_error(by_mask):
    """It said to keep the batch a dimension of its own, which it is: now it says only some
    samples reach the layer, and how to run it on the whole batch instead."""
    torch.manual_seed(0)
    model = HeadsForParts(by_mask).double()
    x = torch.tensor([[1.0, 0, 0, 0], [-1, 0, 0, 0], [1, 0, 0, 0], [-1, 0, 0, 0]]).double()
    with (
        pytest.raises(BatchError, match=r"Linear 'h1'.*Only some of the samples.*torch\.where"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        F.cross_entropy(model(x), torch.tensor([1, 0, 3, 2])).backward()


class BiasEscape(nn.Module):
    """A wide layer called twice (its totals are sums, checked), its bias used again in an
    in-place op outside it; inputs in [0, 255]: the weight's gradient is thousands of times
    the bias's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(784, 10)

    def forward(self, x):
        h = self.lin(x) + self.lin(x.flip(-1))
        return h + torch.zeros_like(h).addmm_(x[:, :10], torch.diag(self.lin.bias), alpha=0.01)


def test_the_module_scale_does_not_hide_an_escape_in_float32():
    """Taken relative to the module's gradient whatever the parameter's own, the escaped use
    (40 % of the bias's gradient) passed in float32, silently wrong; the module's scale is
    only for gradients at the rounding of the module's."""
    torch.manual_seed(0)
    model = BiasEscape()
    x, y = torch.rand(8, 784) * 255, torch.randint(0, 10, (8,))
    with (
        pytest.raises(UnsupportedModelError, match=r"do not add up.*'lin\.bias'"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        F.cross_entropy(model(x), y, reduction="sum").backward()


@pytest.mark.parametrize("check", [True, False], ids=["check", "unchecked"])
def test_a_penalty_backward_between_two_forwards_keeps_the_first(check):
    """A backward that reaches parameters but no samples (a penalty on a weight alone) between
    two forwards, then one backward through both: refused (two forwards' samples in one
    backward). A first fix for a refusal that outlived its forward ended the first forward at
    that penalty: the joint backward then took the second forward's samples alone, silently
    wrong with check=False (review; never released)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    xa, xb = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    with (
        pytest.raises(UnsupportedModelError, match="two forward passes"),
        leanprop.per_sample(model, leanprop.BatchGrad(), check=check),
    ):
        la = model(xa).square().sum()
        model[0].weight.square().sum().backward()
        lb = model(xb).square().sum()
        (la + lb).backward()
