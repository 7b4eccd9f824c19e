"""Real-model patterns in training mode (dropout, drop-path) against the per-sample gradients
of the same batch forward, float64, every quantity; T == N wherever there is a sequence."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import leanprop
from leanprop import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from leanprop.testing import individual_gradients_of_losses, quantities_from_individual

from ..helpers import assert_close
from ..model_zoo import ZOO, bilinear_of_two_views, hf_models

ALL = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())


def check(build, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model, losses_fn, options = build()
    model.double()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    with leanprop.per_sample(model, *ALL, **options):
        losses = losses_fn()
        losses.sum().backward(retain_graph=True)
    expected = individual_gradients_of_losses(losses, params)
    scale = max(float(g.abs().max()) for g in expected.values())
    for k, p in params.items():
        ref = quantities_from_individual(expected[k])
        for q in ALL:
            assert_close(getattr(p, q.attr), ref[q.attr], f"{k}.{q.attr}", 1e-8, 1e-10 * scale)


pytestmark = pytest.mark.usefixtures("float64_default")


@pytest.mark.parametrize("name", sorted(ZOO))
def test_model_pattern(name):
    check(ZOO[name])


def test_bilinear_layer():
    """``nn.Bilinear`` on ``[N, T, I]``: its op lost the batch (an error)."""
    check(bilinear_of_two_views)


@pytest.mark.parametrize(
    "name",
    [
        "hf_gpt2",
        "hf_llama",
        "hf_bert",
        "hf_vit",
        "hf_bart",
        "hf_bart_classifier",
        "hf_bloom",
        "hf_falcon",
        "hf_wav2vec2",
        "hf_t5",
    ],
)
def test_hf_model_in_training_mode(name):
    pytest.importorskip("transformers")
    check(hf_models()[name])


@pytest.mark.parametrize("name", ["functional_layers", "vit_timm_style"])
def test_generic_op_capture_without_closed_forms(name, monkeypatch):
    """The batched vector-Jacobian path of ops.py alone (closed forms switched off)."""
    from leanprop.per_sample import ops

    monkeypatch.setattr(ops, "closed_form", lambda *args, **kwargs: None)
    check(ZOO[name])


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-outside", "inside"])
@pytest.mark.parametrize("name", [*sorted(ZOO), "hf_gpt2", "hf_llama"])
def test_bf16_autocast(name, backward_inside):
    """Layers compute in bfloat16; every quantity is float32 (the parameters' dtype) and close
    to the float32 gradients of the same forward."""
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model, losses_fn, options = (ZOO.get(name) or hf_models()[name])()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    try:
        with leanprop.per_sample(model, *ALL, **options):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = losses_fn().float()
                if backward_inside:
                    losses.sum().backward(retain_graph=True)
            if not backward_inside:
                losses.sum().backward(retain_graph=True)
    except RuntimeError as e:  # (oneDNN has no bf16 LSTM kernel on some CPUs, AMD EPYC among
        # them: torch's own forward fails, or, over a PackedSequence, the per-sample passes'
        # LSTM on one unpacked sequence)
        if "could not create a primitive descriptor" not in str(e):
            raise
        pytest.skip(f"torch's bf16 LSTM kernel is missing on this CPU: {e}")
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        for q in ALL:
            assert getattr(p, q.attr).dtype == torch.float32, f"{k}.{q.attr}"
        ref = expected[k]
        rel = float((p.grad_batch - ref).norm() / (ref.norm() + 1e-12))
        assert rel < 5e-2, f"{k}: relative error {rel:.2e} against the same forward"


@pytest.mark.parametrize("name", ["functional_layers_wide", "hf_gpt2_wide"])
def test_batch_l2_alone_uses_closed_form_norms(name, monkeypatch):
    """BatchL2Grad alone: op-level linear/matmul/addmm uses give norms from Gram matrices
    (no individual gradients), exact against the same forward's individual gradients."""
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    from leanprop.per_sample import ops

    calls = []
    real = ops.closed_norms

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(ops, "closed_norms", counting)
    torch.manual_seed(0)
    if name == "hf_gpt2_wide":
        model, losses_fn, options = hf_models()[name]()
    else:
        model = FunctionalWide()
        x = torch.randn(3, 2, 16)
        model, losses_fn, options = model, lambda: model(x).square().flatten(1).sum(1), {}
    model.double()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    with leanprop.per_sample(model, BatchL2Grad(), **options):
        losses = losses_fn()
        losses.sum().backward(retain_graph=True)
    assert any(calls), "no closed-form norms were used"
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        ref = expected[k].flatten(1).square().sum(1)
        assert_close(p.batch_l2, ref, f"{k}.batch_l2", 1e-8, 1e-12)


class FunctionalWide(torch.nn.Module):
    """Wide F.linear / matmul / addmm uses on short sequences (Gram form cheaper)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.b1 = torch.nn.Parameter(torch.randn(16))
        self.w2 = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.b2 = torch.nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.nn.functional.linear(x, self.w1, self.b1))
        return torch.addmm(self.b2, h.reshape(-1, 16), self.w2).view_as(h)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "hf_bert"])
def test_batch_l2_alone_on_hf_models(name, monkeypatch):
    """BatchL2Grad alone takes the closed forms (Gram norms, and for GPT-2's embedding tied to
    its head the factors of both uses): exact against the same forward's individual gradients."""
    pytest.importorskip("transformers")
    from leanprop.per_sample import factors

    factored = []
    real = factors.inner
    monkeypatch.setattr(factors, "inner", lambda *a: factored.append(1) or real(*a))
    torch.manual_seed(0)
    model, losses_fn, options = hf_models()[name]()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    with leanprop.per_sample(model, BatchL2Grad(), **options):
        losses = losses_fn()
        losses.sum().backward(retain_graph=True)
    assert bool(factored) == (name == "hf_gpt2")  # the only one with a tied head here
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        ref = expected[k].flatten(1).square().sum(1)
        assert_close(p.batch_l2, ref, f"{k}.batch_l2", 1e-8, 1e-12)


@pytest.mark.parametrize("mib", [None, 0.001], ids=["default-workspace", "tiny-workspace"])
def test_batch_l2_alone_materialises_chunks_in_one_reused_buffer(mib, monkeypatch):
    """BatchL2Grad alone where the Gram form is dearer (GPT-2's Conv1D on longer sequences):
    the individual gradients are formed a chunk of samples at a time in one scratch buffer,
    reused by every chunk and op of the backward (fresh temporaries cost page faults), and
    the norms are exact; with a tiny workspace, in many chunks."""
    pytest.importorskip("transformers")
    from leanprop.per_sample.chunks import Scratch

    taken = []
    real = Scratch.take

    def take(self, shape, like, slot=""):
        before = dict(self._buffers)  # (held: a freed buffer's address is not reused here)
        out = real(self, shape, like, slot)
        grew = any(before.get(k) is not v for k, v in self._buffers.items())
        taken.append((shape, grew))
        return out

    monkeypatch.setattr(Scratch, "take", take)
    torch.manual_seed(0)
    model, losses_fn, options = hf_models()["hf_gpt2"]()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    with leanprop.per_sample(model, BatchL2Grad(), **options, max_workspace_mib=mib):
        losses = losses_fn()
        losses.sum().backward(retain_graph=True)
    assert taken, "no individual gradients were materialised in the scratch buffer"
    grown = sum(grew for _, grew in taken)
    assert grown < len(taken) / 2, f"the scratch buffer was allocated {grown} of {len(taken)} times"
    if mib is not None:
        assert any(shape[0] == 1 for shape, _ in taken), "no chunk smaller than the batch"
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        ref = expected[k].flatten(1).square().sum(1)
        assert_close(p.batch_l2, ref, f"{k}.batch_l2", 1e-8, 1e-12)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_learned_initial_state_of_an_rnn_is_refused(packed):
    """A learned h0 expanded over the batch would need per-sample gradients through the RNN's
    initial state: a clear error (was a raw shape error, padded; a misleading one, packed)."""
    from torch import nn

    from leanprop import UnsupportedModelError

    class LearnedH0(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)
            self.h0 = nn.Parameter(torch.randn(1, 1, 4))

        def forward(self, x, lengths):
            if packed:
                x = nn.utils.rnn.pack_padded_sequence(x, lengths, True, enforce_sorted=False)
            return self.rnn(x, self.h0.expand(1, lengths.shape[0], 4).contiguous())[1].sum()

    m = LearnedH0()
    learned = pytest.raises(UnsupportedModelError, match=r"'h0': a learned initial state")
    with leanprop.per_sample(m, BatchGrad()), learned:
        m(torch.randn(3, 3, 3), torch.tensor([3, 1, 2]))


def test_batch_free_rows_picked_by_an_order_of_the_samples():
    """Rows of a constant picked by indices computed from the samples (sorted lengths: the
    index mixes samples, and is read by value) meet the batch further on: exact, T == N.
    Rows of a parameter picked so stay refused clearly (their per-sample parts would have to
    follow the order)."""
    from torch import nn

    from leanprop import BatchError

    class Picked(nn.Module):
        def __init__(self, learned: bool) -> None:
            super().__init__()
            table = torch.randn(5, 5)
            if learned:
                self.table = nn.Parameter(table)
            else:
                self.register_buffer("table", table)
            self.head = nn.Linear(5, 2)

        def forward(self, x, lengths):
            order = torch.sort(lengths, descending=True).indices
            return self.head(x * self.table.index_select(0, order) + self.table[order])

    def build(learned=False):
        m = Picked(learned)
        x, lengths = torch.randn(5, 5), torch.tensor([3, 5, 1, 4, 2])
        return m, lambda: m(x, lengths).square().sum(1), {}

    check(build)
    m, losses, _ = build(learned=True)
    with leanprop.per_sample(m, BatchGrad()), pytest.raises(BatchError, match="sort"):
        losses().sum().backward()


@pytest.mark.parametrize("how", ["detach", "no_grad"])
def test_a_detached_initial_state_is_a_constant(how):
    """A learned h0 detached (or expanded under no_grad) gets no gradient: exact (was refused
    as a learned initial state)."""
    from torch import nn

    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)
            self.h0 = nn.Parameter(torch.randn(1, 1, 4))

        def forward(self, x):
            if how == "detach":
                h0 = self.h0.detach().expand(1, x.shape[0], 4).contiguous()
            else:
                with torch.no_grad():
                    h0 = self.h0.expand(1, x.shape[0], 4).contiguous()
            return self.rnn(x, h0)[1][0].square().sum(1)

    def build():
        m = Detached()
        m.h0.requires_grad_(False)  # (no gradient reaches it: frozen, so the oracle skips it)
        x = torch.randn(4, 4, 3)
        return m, lambda: m(x), {}

    check(build)


def test_batch_l2_alone_in_bf16_chunks_sums_the_gradient_in_float32():
    """BatchL2Grad alone of an op-level linear under bf16 autocast, a chunk at a time: the
    gradient (which becomes .grad, and which the sum check cannot question) was summed over
    the chunks in bf16 (0.8 % off autograd's against 0.1 % in one piece)."""

    class Functional(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float32) / 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.w)

    torch.manual_seed(0)
    model, x = Functional().float(), torch.randn(64, 40, 16, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.autograd.grad(model(x).float().square().sum(), model.w)[0]
    with leanprop.per_sample(model, BatchL2Grad(), max_workspace_mib=0.0005, check=False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().sum().backward()
    err = float((model.w.grad - ref).norm() / ref.norm())
    assert err < 3e-3, err


@pytest.mark.parametrize("norm", ["layer", "group"])
def test_norm_layers_with_float32_parameters_on_bf16_activations(norm):
    """bf16 activations into a norm layer with float32 parameters (no autocast): its gradient
    is as close to the float64 one as plain torch's (the parameters were cast to bf16 for the
    backward kernel, and GroupNorm's individual gradients summed in bf16: 38x further off)."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    if norm == "layer":
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
        x = torch.randn(4, 8, 16)
    else:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8))
        x = torch.randn(4, 3, 9, 9)
    torch.nn.init.normal_(model[1].weight)
    torch.nn.init.normal_(model[1].bias)
    model[0].bfloat16()

    def grads(m, inputs, ctx):
        for p in m.parameters():
            p.grad = None
        with ctx:
            m(inputs).float().pow(2).sum().backward()
        return {k: p.grad.double() for k, p in m.named_parameters()}

    truth = grads(copy.deepcopy(model).double(), x.double(), contextlib.nullcontext())
    plain = grads(model, x.bfloat16(), contextlib.nullcontext())
    mine = grads(model, x.bfloat16(), leanprop.per_sample(model, BatchGrad()))
    for k in ("1.weight", "1.bias"):
        err = float((mine[k] - truth[k]).norm() / truth[k].norm())
        ref = float((plain[k] - truth[k]).norm() / truth[k].norm())
        assert err <= 1.5 * ref + 1e-6, (k, err, ref)


class LinearForms(torch.nn.Module):
    """A module's own weights in each linear form, the weight as it is and transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(12, 12) / 4)
        self.b = torch.nn.Parameter(torch.randn(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, 12)
        h = torch.nn.functional.linear(x, self.w, self.b).tanh()
        h = torch.matmul(h, self.w).tanh() + torch.matmul(h, self.w.t())
        h = torch.mm(h.reshape(-1, 12), self.w).view_as(x).tanh()
        return h + torch.addmm(self.b, rows, self.w).view_as(x)


@pytest.mark.parametrize("q", [BatchGrad(), BatchL2Grad()], ids=repr)
def test_input_gradient_of_op_level_linear_forms_is_torchs(q, monkeypatch):
    """The input's gradient of an op-level linear/matmul/mm/addmm is the product torch's own
    backward computes (not a backward through the op's graph, which under a checkpoint
    recomputed the block once more): the same values, bit for bit, in float32."""
    from leanprop.per_sample import ops

    formed = []
    original = ops.linear_input_grad

    def counted(name, *args):
        out = original(name, *args)
        if out is not None:
            formed.append(name)
        return out

    monkeypatch.setattr(ops, "linear_input_grad", counted)
    torch.manual_seed(0)
    model = LinearForms().float()
    x = torch.randn(5, 5, 12, dtype=torch.float32, requires_grad=True)

    def input_grad(ctx) -> torch.Tensor:
        x.grad = None
        with ctx:
            model(x).square().sum().backward()
        return x.grad

    plain = input_grad(contextlib.nullcontext())
    assert torch.equal(input_grad(leanprop.per_sample(model, q)), plain)
    assert sorted(set(formed)) == ["addmm", "linear", "matmul", "mm"]


class ScaledAddmm(torch.nn.Module):
    def __init__(self, checkpointed: bool, **scales) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(4, 4)
        self.w, self.b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
        self.checkpointed, self.scales = checkpointed, scales

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.b, h, self.w, **self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.body, self.pre(x), use_reentrant=False)
        return self.body(self.pre(x))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("scales", [{"alpha": 2.0}, {"beta": 3.0}], ids=str)
@pytest.mark.parametrize("quantities", [ALL, (BatchL2Grad(),)], ids=["all", "l2-alone"])
def test_addmm_with_scales(scales, quantities, checkpointed):
    """``torch.addmm(b, x, W, alpha=, beta=)`` on a module's own weights: the closed forms
    (individual gradients, the input's gradient) left the scales out, silently (W off by
    1.2, b by 3.8, and the layers before by 4.5); under a non-reentrant checkpoint, the
    generic path that replaced them raised a CheckpointError."""
    torch.manual_seed(0)
    model = ScaledAddmm(checkpointed, **scales)
    x = torch.randn(5, 4)
    params = dict(model.named_parameters())
    expected = individual_gradients_of_losses(model(x).square().sum(1), params)
    with leanprop.per_sample(model, *quantities):
        model(x).square().sum().backward()
    for k, p in params.items():
        ref = quantities_from_individual(expected[k])
        for q in quantities:
            assert_close(getattr(p, q.attr), ref[q.attr], f"{k}.{q.attr}", 1e-9, 1e-12)
        assert_close(p.grad, expected[k].sum(0), f"{k}.grad", 1e-9, 1e-12)


class LeftMatmul(torch.nn.Module):
    """A parameter as the first operand of a matmul (no closed form: the generic path)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.matmul(self.w, x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


def test_a_parameter_first_in_a_matmul_under_a_non_reentrant_checkpoint():
    """The op's local graph saved its tensors through the checkpoint (the op was taken for
    one with closed forms by its name), which the generic per-sample pass made recompute:
    CheckpointError."""
    torch.manual_seed(0)
    model = LeftMatmul()
    x = torch.randn(6, 4, 5)
    expected = individual_gradients_of_losses(
        model(x).square().sum((1, 2)), dict(model.named_parameters())
    )
    with leanprop.per_sample(model, BatchGrad()):
        model(x).square().sum().backward()
    assert_close(model.w.grad_batch, expected["w"], "w", 1e-9, 1e-12)


class _GemmaRMSNorm(torch.nn.Module):
    """HF Gemma's RMSNorm: computed in float32 whatever the model's dtype,
    ``x * rsqrt(mean(x²) + eps) * (1 + weight.float())``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-0.5, 0.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (out * (1.0 + self.weight.float())).type_as(x)


def test_a_parameter_used_in_float32_inside_a_float64_model():
    """The sum check took the float32 use of a float64 parameter (its contributions handed
    back through ``weight.float()``) for a float64 one, and refused its rounding as an
    escaped use (review of HF Gemma in float64); checked as float32 now."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), _GemmaRMSNorm(8), torch.nn.Linear(8, 3)
    ).double()
    x = torch.randn(4, 4, 8, dtype=torch.float64)  # T == N
    _assert_quantities_are_the_losses(model, x, 1e-5, 1e-7)


def _assert_quantities_are_the_losses(model, x, rtol: float, atol: float) -> None:
    """BatchGrad and BatchL2Grad of ``model(x).square().sum()`` against each sample's own
    loss's gradients (float32-rounded uses: the given tolerances)."""
    params = dict(model.named_parameters())
    with leanprop.per_sample(model, BatchGrad(), BatchL2Grad()):
        losses = model(x).square().sum((1, 2))
        losses.sum().backward(retain_graph=True)
    expected = individual_gradients_of_losses(losses, params)
    for k, p in params.items():
        ref = quantities_from_individual(expected[k])
        for attr in ("grad_batch", "batch_l2"):
            assert_close(getattr(p, attr), ref[attr], f"{k}.{attr}", rtol, atol)


class _MixedPrecisionBias(torch.nn.Module):
    """A float64 table and a float32 scale, combined in float32 with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4).double()
        self.head = torch.nn.Linear(4, 3).double()
        self.table = torch.nn.Parameter(torch.linspace(-1, 1, 20, dtype=torch.float64).view(5, 4))
        self.s = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x).float() + self.table.float() * self.s)
        return self.head(h.double())


def test_a_float64_parameter_used_in_float32_with_a_float32_one():
    """The lower precision of a hand-back was taken for all its parameters or none: with a
    float32 parameter beside the float64 one, the float64 one's float32 rounding was refused
    by the sum check as an escaped use. Each parameter is checked in its own use's precision
    now."""
    torch.manual_seed(0)
    model = _MixedPrecisionBias()
    x = torch.randn(5, 5, 4, dtype=torch.float64)  # T == N
    _assert_quantities_are_the_losses(model, x, 1e-5, 1e-6)
