"""Per-sample clipping in one backward (float64) against the per-sample loop, on every case of
the registry, and what it refuses."""

from __future__ import annotations

import contextlib
import copy
import importlib

import pytest
import torch
from torch import nn

import leanprop
from leanprop import LeanpropValueError, UnsupportedModelError
from leanprop.testing import clipped_gradients

from ..cases import CASES, build
from ..helpers import assert_close


def _run(case, threshold, reduction, **kwargs):
    with leanprop.clip_per_sample(
        case.model, threshold, loss_reduction=reduction, **kwargs
    ) as clip:
        case.loss(case.model(case.x), case.y, reduction).backward()
    return clip


def _check(case, threshold, reduction, **kwargs):
    model = copy.deepcopy(case.model)
    expected, norms = clipped_gradients(model, case.loss, case.x, case.y, threshold)
    clip = _run(case, threshold, reduction, **kwargs)
    for name, p in case.model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad, expected[name], f"{name} clipped", 1e-10, 1e-12)
            assert not hasattr(p, "batch_l2") and not hasattr(p, "grad_batch"), name
    assert_close(clip.last_norms, norms, "norms", 1e-10, 1e-12)
    return norms


def _median_norm(case) -> float:
    _, norms = clipped_gradients(copy.deepcopy(case.model), case.loss, case.x, case.y, 1.0)
    return float(norms.median())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_flat_clipping_matches_the_loop(name, reduction):
    """The threshold at the median norm: some samples clipped, some not."""
    case = build(name)
    _check(case, _median_norm(case), reduction)


@pytest.mark.parametrize("name", ["mlp", "conv2d", "tied_lm", "sequence", "recurrent"])
@pytest.mark.parametrize("scale", [1e-3, 1e3], ids=["all-clipped", "none-clipped"])
def test_every_sample_or_none_clipped(name, scale):
    case = build(name)
    _check(case, _median_norm(case) * scale, "mean")


@pytest.mark.parametrize("name", ["mlp", "conv2d", "tied_lm", "attention", "own_parameter"])
def test_per_parameter_thresholds_by_name_and_in_order(name):
    case = build(name)
    named = [(k, p) for k, p in case.model.named_parameters() if p.requires_grad]
    per = {k: 0.05 * (i + 1) for i, (k, _) in enumerate(named)}
    model = copy.deepcopy(case.model)
    expected, _ = clipped_gradients(model, case.loss, case.x, case.y, per)
    for thresholds in (per, list(per.values())):
        case.model.zero_grad(set_to_none=True)
        _run(case, thresholds, "mean")
        for k, p in named:
            assert_close(p.grad, expected[k], f"{k} per-parameter", 1e-10, 1e-12)


def test_micro_batches_add_up_and_the_context_is_reusable():
    """Two backward passes (gradient accumulation), each in its own `with` of one context."""
    case = build("conv2d")
    c = _median_norm(case)
    half = case.x.shape[0] // 2
    parts = [(case.x[:half], case.y[:half]), (case.x[half:], case.y[half:])]
    expected = [
        clipped_gradients(copy.deepcopy(case.model), case.loss, x, y, c)[0] for x, y in parts
    ]
    clip = leanprop.clip_per_sample(case.model, c, loss_reduction="sum")
    for x, y in parts:
        with clip:
            case.loss(case.model(x), y, "sum").backward()
    for k, p in case.model.named_parameters():
        assert_close(p.grad, expected[0][k] + expected[1][k], k, 1e-10, 1e-12)
        assert clip.holds_clipped_grad(p)
    assert clip.clipped_backwards == 2


def test_a_micro_batch_whose_backward_raises_leaves_the_held_gradients():
    """Accumulating micro-batches: a backward that raises midway (after some parameters'
    gradients were accumulated) leaves ``.grad`` as the micro-batches before it left it, and
    the next micro-batch adds to that."""
    case = build("conv2d")
    c = _median_norm(case)
    third = case.x.shape[0] // 3
    parts = [(case.x[i * third : (i + 1) * third], case.y[i * third : (i + 1) * third])
             for i in range(3)]  # fmt: skip
    expected = [
        clipped_gradients(copy.deepcopy(case.model), case.loss, x, y, c)[0] for x, y in parts
    ]
    clip = leanprop.clip_per_sample(case.model, c, loss_reduction="sum")
    first = next(case.model.parameters())

    def fail(grad):
        raise RuntimeError("stop here")

    for i, (x, y) in enumerate(parts):
        with clip:
            loss = case.loss(case.model(x), y, "sum")
            if i == 1:  # (the first parameter's gradient comes last: the others are in)
                handle = first.register_hook(fail)
                with pytest.raises(RuntimeError, match="stop here"):
                    loss.backward()
                handle.remove()
            else:
                loss.backward()
    for k, p in case.model.named_parameters():
        assert_close(p.grad, expected[0][k] + expected[2][k], k, 1e-10, 1e-12)


def test_bad_thresholds_and_reduction():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(LeanpropValueError, match="positive, finite number"):
            leanprop.clip_per_sample(model, bad)
    with pytest.raises(LeanpropValueError, match="3 per-parameter thresholds for 4"):
        leanprop.clip_per_sample(model, [1.0, 1.0, 1.0])
    with pytest.raises(LeanpropValueError, match=r"unknown \['x'\], missing \['1.bias'\]"):
        leanprop.clip_per_sample(model, {"0.weight": 1.0, "0.bias": 1.0, "1.weight": 1.0, "x": 1.0})
    # keyed by the parameters themselves: the message's sort compared tensors (RuntimeError)
    with pytest.raises(LeanpropValueError, match=r"Parameter of shape \(2, 3\).*not by the"):
        leanprop.clip_per_sample(model, {p: 1.0 for p in model.parameters()})
    with pytest.raises(LeanpropValueError, match="loss_reduction='none'"):
        leanprop.clip_per_sample(model, 1.0, loss_reduction="none")
    with pytest.raises(LeanpropValueError, match=r"needs the model \(an nn.Module\) first"):
        leanprop.clip_per_sample([model], 1.0)
    import numpy as np

    assert leanprop.clip_per_sample(model, np.float32(0.5)).clipping.max_norm == 0.5


def test_batchnorm_in_training_mode_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with (
        pytest.raises(UnsupportedModelError, match="BatchNorm"),
        leanprop.clip_per_sample(model, 1.0),
    ):
        model(torch.randn(5, 3)).sum().backward()


@pytest.mark.parametrize("lam", [1e-1, 1e-12])
def test_weight_decay_written_into_the_loss_is_refused_at_any_size(lam):
    """Clipping would drop the penalty's gradient (it is no sample's), as Opacus does
    silently: refused, however small it is, with the fix (the optimizer's weight_decay)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with (
        pytest.raises(UnsupportedModelError, match=r"after the samples.*weight_decay="),
        leanprop.clip_per_sample(model, 1.0),
    ):
        penalty = lam * sum(p.square().sum() for p in model.parameters())
        (model(torch.randn(5, 3)).square().mean() + penalty).backward()


def test_an_empty_batch_clips_to_zero():
    case = build("mlp")
    with leanprop.clip_per_sample(case.model, 1.0, loss_reduction="sum") as clip:
        case.loss(case.model(case.x[:0]), case.y[:0], "sum").backward()
    for p in case.model.parameters():
        assert p.grad is not None and not p.grad.any()
    assert clip.last_norms.shape == (0,)


class _Wide(nn.Module):
    """An embedding, a convolution and a wide linear layer: N x P would dominate memory."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 64)
        self.conv = nn.Conv1d(64, 64, 3, padding=1)
        self.lin = nn.Linear(64 * 8, 512)
        self.head = nn.Linear(512, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [N, 8]
        h = self.conv(self.emb(ids).transpose(1, 2)).relu()  # [N, 64, 8]
        return self.head(self.lin(h.flatten(1)).relu())


def test_no_individual_gradients_of_linear_conv_or_embedding_layers():
    """The exact peak of a clipped step stays below one layer's [N, *p.shape], which
    BatchGrad's (or Opacus' hooks') peak exceeds."""
    torch.manual_seed(0)
    model, n = _Wide(), 64
    ids, y = torch.randint(0, 512, (n, 8)), torch.randint(0, 4, (n,))
    largest = max(p.numel() for p in model.parameters()) * 4 * n  # bytes of [N, *p.shape]

    def step(ctx):
        with ctx:
            torch.nn.functional.cross_entropy(model(ids), y).backward()
        model.zero_grad(set_to_none=True)

    step(leanprop.clip_per_sample(model, 1.0))  # warm up (algorithm choices)
    with leanprop.track_memory() as clipped:
        step(leanprop.clip_per_sample(model, 1.0))
    with leanprop.track_memory() as materialised:
        step(leanprop.per_sample(model, leanprop.BatchGrad()))
    assert materialised.peak_bytes > largest
    assert clipped.peak_bytes < largest / 4, (clipped.peak_mib, largest / 2**20)


def test_norm_layers_on_sequences_keep_their_small_individual_gradients():
    """A LayerNorm's individual gradients [N, D] are kept for the clipped sum, not its input
    and output gradient [N, T, D] (which held 1 MiB per layer until the end of backward)."""
    torch.manual_seed(0)
    n, t, d = 16, 256, 32
    blocks = [nn.Sequential(nn.LayerNorm(d), nn.Tanh()) for _ in range(8)]
    model = nn.Sequential(*blocks, nn.Flatten(1), nn.Linear(t * d, 2))
    x, y = torch.randn(n, t, d), torch.randint(0, 2, (n,))

    def step(ctx):
        with ctx:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    step(leanprop.clip_per_sample(model, 1.0))
    with leanprop.track_memory() as plain:
        step(contextlib.nullcontext())
    with leanprop.track_memory() as clipped:
        step(leanprop.clip_per_sample(model, 1.0))
    held_by_one_layer = 2 * n * t * d * 4
    assert clipped.peak_bytes - plain.peak_bytes < held_by_one_layer / 2, (
        clipped.peak_mib,
        plain.peak_mib,
    )


def test_clipping_takes_gram_norms_where_they_beat_materialising_without_the_sum(monkeypatch):
    """Clipping needs the norms, not the summed gradient (it forms a weighted sum): a linear
    layer on sequences with T (I + O) < I O < 2 T (I + O) gets Gram norms under clipping
    (BatchL2Grad alone materialises: its sum then comes for free), exact."""
    linear = importlib.import_module("leanprop.per_sample.rules.linear")
    calls = []
    real = linear.inner
    monkeypatch.setattr(linear, "inner", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Flatten(1), nn.Linear(24 * 64, 3))
    model.double()
    x, y = torch.randn(5, 24, 64, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(out, target, reduction):
        return torch.nn.functional.cross_entropy(out, target, reduction=reduction)

    with leanprop.per_sample(model, leanprop.BatchL2Grad()):
        loss(model(x), y, "mean").backward()
    assert not calls  # (the sum wanted too: materialised)
    model.zero_grad(set_to_none=True)
    expected, norms = clipped_gradients(copy.deepcopy(model), loss, x, y, 1.0)
    with leanprop.clip_per_sample(model, 1.0) as clip:
        loss(model(x), y, "mean").backward()
    assert calls, "the Gram form was not used under clipping"
    assert_close(clip.last_norms, norms, "norms", 1e-10, 1e-12)
    for name, p in model.named_parameters():
        assert_close(p.grad, expected[name], f"{name} clipped", 1e-10, 1e-12)


class _AddmmLayer(nn.Module):
    """HF ``Conv1D``'s pattern: ``addmm`` on the module's own weight (op-level capture)."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(i, o) / i**0.5)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], -1)


def test_op_level_uses_take_gram_norms_under_clipping(monkeypatch):
    """The op-level closed form (HF Conv1D's addmm) under clipping: Gram norms where they beat
    materialising without the summed gradient (T (I + O) < I O < 2 T (I + O)), which then is
    not computed (autograd gets zeros; the clipping forms the weighted sum), exact."""
    op_rules = importlib.import_module("leanprop.per_sample.op_rules")

    def refuse(*args, **kwargs):
        raise AssertionError("materialised norms under clipping, where Gram norms are cheaper")

    monkeypatch.setattr(op_rules, "_materialised_norms", refuse)
    torch.manual_seed(0)
    model = nn.Sequential(_AddmmLayer(64, 64), nn.Tanh(), nn.Flatten(1), nn.Linear(24 * 64, 3))
    model.double()
    x, y = torch.randn(5, 24, 64, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(out, target, reduction):
        return torch.nn.functional.cross_entropy(out, target, reduction=reduction)

    expected, norms = clipped_gradients(copy.deepcopy(model), loss, x, y, 1.0)
    with leanprop.clip_per_sample(model, 1.0) as clip:
        loss(model(x), y, "mean").backward()
    assert_close(clip.last_norms, norms, "norms", 1e-10, 1e-12)
    for name, p in model.named_parameters():
        assert_close(p.grad, expected[name], f"{name} clipped", 1e-10, 1e-12)


@pytest.mark.parametrize("name", ["mlp", "conv2d", "sequence", "tied_lm"])
def test_under_bf16_autocast(name):
    """bf16 autocast (backward outside it, as usual): within bf16 rounding of the float32
    clipped sum; norms in float32."""
    case = build(name, torch.float32)
    c = _median_norm(case)
    expected, norms = clipped_gradients(copy.deepcopy(case.model), case.loss, case.x, case.y, c)
    with leanprop.clip_per_sample(case.model, c, loss_reduction="mean") as clip:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = case.model(case.x)
        case.loss(out.float(), case.y, "mean").backward()
    assert clip.last_norms.dtype == torch.float32
    assert_close(clip.last_norms, norms, "norms", 5e-2, 1e-3)
    for k, p in case.model.named_parameters():
        assert p.grad.dtype == torch.float32
        scale = float(expected[k].abs().max())
        assert_close(p.grad, expected[k], k, 5e-2, 2e-2 * scale)


def test_a_parameter_whose_individual_gradients_cancel_is_not_left_out():
    """A parameter applied in the loss after the forward (not followed) whose individual
    gradients cancel exactly (an antithetic pair x, -x): a rule taking a zero gradient for an
    unreached parameter left it out of every sample's norm, silently (clipped gradients above
    the threshold)."""

    class Weighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.w = nn.Linear(4, 3, bias=False), nn.Parameter(torch.rand(3))

        def forward(self, x):
            return self.lin(x)

    torch.manual_seed(0)
    x0 = torch.randn(1, 4)
    model = Weighted()
    with (
        pytest.raises(UnsupportedModelError, match="'w' got a gradient"),
        leanprop.clip_per_sample(model, 0.01),
    ):
        (model(torch.cat([x0, -x0])) * model.w).mean().backward()


class _Blocks(nn.Module):
    """Linear and LayerNorm layers (their ops replaced) and HF Conv1D-style weights (used by
    ``torch.addmm``: captured at the op level), each block under ``wrap``."""

    def __init__(self, wrap) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6)) for _ in range(2)
        )
        self.w, self.b = nn.Parameter(torch.randn(6, 6) / 3), nn.Parameter(torch.randn(6))
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = self.wrap(lambda t, block=block: torch.tanh(block(t)), h)
        return self.wrap(lambda t: torch.addmm(self.b, t.reshape(-1, 6), self.w).view_as(t), h)


def _saving_on_cpu(f, h):
    with torch.autograd.graph.save_on_cpu():
        return f(h)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=False),
        _saving_on_cpu,
    ],
    ids=["non-reentrant-checkpoint", "save_on_cpu"],
)
def test_under_saved_tensor_hooks(wrap):
    """On torch 2.8, a parameter saved by our autograd Functions while saved-tensor hooks were
    in effect (a non-reentrant checkpoint's, save_on_cpu's) lost the hooks the clipping put
    on it: its gradient was left unclipped (off by 7.4 on this model), silently."""
    torch.manual_seed(0)
    model = _Blocks(wrap).double()
    x, y = torch.randn(5, 3, 6, dtype=torch.float64), torch.randn(5, 3, 6, dtype=torch.float64)

    def loss_fn(out, target, reduction="sum"):
        return (out - target).square().sum()

    expected, norms = clipped_gradients(model, loss_fn, x, y, 0.5)
    assert bool((norms > 0.5).any())  # (some samples are clipped)
    model.zero_grad()
    with leanprop.clip_per_sample(model, 0.5, loss_reduction="sum") as clip:
        loss_fn(model(x), y).backward()
    for k, p in model.named_parameters():
        assert_close(p.grad, expected[k], k, 1e-10, 1e-12)
    assert_close(clip.last_norms, norms, "norms", 1e-10, 1e-12)


def test_a_head_applied_in_the_loss_under_save_on_cpu_is_refused():
    """A head weight used by chunked_linear_cross_entropy in the loss (after the model's
    forward): refused. On torch 2.8 under save_on_cpu, the loss's autograd Function saved
    the weight and its hooks never fired: the head's gradient was left unclipped, silently."""
    from leanprop.side_losses import chunked_linear_cross_entropy

    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 20)
    model = nn.ModuleDict({"body": body, "head": head})
    x, t = torch.randn(6, 3, 8), torch.randint(0, 20, (18,))
    with (
        pytest.raises(UnsupportedModelError, match=r"'head\.weight', 'head\.bias' got a gradient"),
        leanprop.clip_per_sample(model, 0.5, loss_reduction="sum"),
        torch.autograd.graph.save_on_cpu(),
    ):
        h = torch.tanh(body(x)).reshape(-1, 8)
        chunked_linear_cross_entropy(
            h, head.weight, t, head.bias, reduction="none"
        ).sum().backward()
