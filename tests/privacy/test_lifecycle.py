"""Clipping in training loops as people write them: nothing silently unprivate (each case was
silently wrong or a raw error before it got its test), float64 against the per-sample loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leanprop
from leanprop import DPOptimizer, LeanpropValueError, UnsupportedModelError
from leanprop.testing import clipped_gradients

from ..cases import build
from ..helpers import assert_close


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _xy(n: int = 6, seed: int = 1):
    torch.manual_seed(seed)
    return torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 2, (n,))


def _ce(out, y, reduction="sum"):
    return F.cross_entropy(out, y, reduction=reduction)


def _dp(model, clip, lr=0.1, noise=1.0, **options):
    """A DPOptimizer over SGD, averaging by the 6 samples of ``_xy()``."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    return DPOptimizer(sgd, clip, noise_multiplier=noise, expected_batch_size=6, **options)


def _expected(model, x, y, c):
    return clipped_gradients(copy.deepcopy(model), _ce, x, y, c)[0]


def test_a_second_backward_through_one_forward_is_refused():
    """Two losses of one forward backward'ed separately: each sample would count twice."""
    model, (x, _) = _mlp(), _xy()
    with leanprop.clip_per_sample(model, 0.05, loss_reduction="sum"):
        out = model(x)
        out[:, 0].square().sum().backward(retain_graph=True)
        with pytest.raises(UnsupportedModelError, match="second backward through a forward"):
            out[:, 1].square().sum().backward()
    model.zero_grad()
    with leanprop.clip_per_sample(model, 0.05, loss_reduction="sum"):  # a penalty's backward
        model(x).square().sum().backward()
        with pytest.raises(UnsupportedModelError, match="second backward through a forward"):
            model[0].weight.square().sum().backward()


def test_autograd_grad_and_input_only_backward_leave_grad_alone():
    """autograd.grad returned zeros for the parameters (and wrote clipped sums to .grad); an
    input-gradient pass (FGSM) wrote .grad, and the training backward then added to it."""
    model, (x, y) = _mlp(), _xy()
    plain = torch.autograd.grad(_ce(model(x), y), list(model.parameters()))
    clip = leanprop.clip_per_sample(model, 0.1, loss_reduction="sum")
    with clip:
        got = torch.autograd.grad(_ce(model(x), y), list(model.parameters()))
    for a, b in zip(got, plain, strict=True):
        assert_close(a, b, "autograd.grad", 1e-12, 1e-14)
    assert all(p.grad is None for p in model.parameters()) and clip.clipped_backwards == 0
    xr = x.clone().requires_grad_()
    with clip:
        (gx,) = torch.autograd.grad(_ce(model(xr), y), xr)  # an adversarial step's gradient
        _ce(model(x), y).backward()
    for k, p in model.named_parameters():
        assert_close(p.grad, _expected(model, x, y, 0.1)[k], k, 1e-10, 1e-12)
    assert gx.shape == x.shape


def test_backward_inputs_writes_only_those_parameters():
    model, (x, y) = _mlp(), _xy()
    with leanprop.clip_per_sample(model, 0.1, loss_reduction="sum"):
        _ce(model(x), y).backward(inputs=[model[2].weight])
    assert [p.grad is None for p in model.parameters()] == [True, True, False, True]
    # clipped by the norm over what the backward accumulated: the weight alone
    per = {k: (0.1 if k == "2.weight" else 1e9) for k, _ in model.named_parameters()}
    expected = clipped_gradients(copy.deepcopy(model), _ce, x, y, per)[0]["2.weight"]
    assert_close(model[2].weight.grad, expected, "2.weight", 1e-10, 1e-12)


def test_an_unclipped_gradient_already_in_grad_is_refused():
    """It was added to and then stepped as if clipped."""
    model, (x, y) = _mlp(), _xy()
    _ce(model(x), y).backward()  # outside the clipping, no zero_grad after
    with (
        pytest.raises(UnsupportedModelError, match="already holds a gradient that the clipping"),
        leanprop.clip_per_sample(model, 0.1, loss_reduction="sum"),
    ):
        _ce(model(x), y).backward()


def test_zero_grad_without_a_step_starts_the_count_again():
    """A backward, zero_grad (a skipped step), a backward, a step: averaged over 1, not 2."""
    model, (x, y) = _mlp(), _xy()
    clip = leanprop.clip_per_sample(model, 0.1)
    opt = _dp(model, clip, lr=0.0, noise=0.0, accountant="rdp", sample_rate=0.1)
    for _ in range(2):
        opt.zero_grad()
        with clip:
            _ce(model(x), y, "mean").backward()
    expected = _expected(model, x, y, 0.1)
    opt.step()
    for k, p in model.named_parameters():
        assert_close(p.grad, expected[k] / 6, k, 1e-10, 1e-12)
    assert opt.accountant.history == [(0.0, 0.1, 1)]


def test_loss_scaling_is_refused():
    model, (x, y) = _mlp(), _xy()
    clip = leanprop.clip_per_sample(model, 0.1)
    opt = _dp(model, clip)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with clip:
        scaler.scale(_ce(model(x), y, "mean")).backward()
    with (
        pytest.warns(FutureWarning, match="GradScaler is going to stop passing"),
        pytest.raises(UnsupportedModelError, match="loss scaling"),
    ):
        scaler.step(opt)


def test_an_optimizer_stepping_inside_backward_is_refused():
    model, (x, y) = _mlp(), _xy()
    clip = leanprop.clip_per_sample(model, 0.1)
    with pytest.raises(LeanpropValueError, match="steps after backward; got InBackward"):
        DPOptimizer(leanprop.InBackward(model.parameters(), torch.optim.SGD, lr=0.1), clip,
                    noise_multiplier=1.0, expected_batch_size=6)  # fmt: skip
    opt = leanprop.InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
    try:
        with (
            pytest.raises(UnsupportedModelError, match="another hook that runs when its grad"),
            clip,
        ):
            _ce(model(x), y).backward()
    finally:
        opt.remove()


@pytest.mark.parametrize(
    "name", ["attention", "batchnorm_eval", "recurrent", "sequence", "own_parameter"]
)
def test_an_empty_poisson_batch(name):
    """Op-level captures of an empty batch raised an IndexError."""
    case = build(name)
    with leanprop.clip_per_sample(case.model, 1.0, loss_reduction="sum"):
        case.loss(case.model(case.x[:0]), case.y[:0], "sum").backward()
    assert all(not p.grad.any() for p in case.model.parameters() if p.grad is not None)
    case.model.zero_grad()
    with leanprop.per_sample(case.model, leanprop.BatchGrad()):
        case.loss(case.model(case.x[:0]), case.y[:0], "sum").backward()
    assert all(p.grad_batch.shape[0] == 0 for p in case.model.parameters() if p.requires_grad)


def test_per_parameter_thresholds_and_a_parameter_unfrozen_later():
    model, (x, y) = _mlp(), _xy()
    model[0].weight.requires_grad_(False)
    clip = leanprop.clip_per_sample(model, [0.1, 0.1, 0.1], loss_reduction="sum")
    model[0].weight.requires_grad_(True)
    with pytest.raises(LeanpropValueError, match=r"'0\.weight' has no threshold of its own"), clip:
        _ce(model(x), y).backward()


def test_sum_reduction_is_not_averaged_and_optimizer_hooks_work():
    model, (x, y) = _mlp(), _xy()
    clip = leanprop.clip_per_sample(model, 0.1, loss_reduction="sum")
    opt = _dp(model, clip, lr=0.0, noise=0.0)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append("pre"))
    opt.register_step_post_hook(lambda *a: seen.append("post"))
    with clip:
        _ce(model(x), y).backward()
    expected = _expected(model, x, y, 0.1)
    opt.step()
    assert seen == ["pre", "post"]
    for k, p in model.named_parameters():
        assert_close(p.grad, expected[k], k, 1e-10, 1e-12)


def test_ddp_and_a_process_group_without_distributed_are_refused(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    model = _mlp()
    clip = leanprop.clip_per_sample(model, 1.0)  # (a process group is fine for clipping)
    with pytest.raises(LeanpropValueError, match="pass distributed=True"):
        _dp(model, clip)
    from leanprop.compat.opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_xy()), batch_size=3)
    with pytest.raises(UnsupportedModelError, match="or a process group"):
        PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        )  # fmt: skip


def test_clipping_nested_with_another_context_is_refused():
    """Both orders failed with a false 'do not add up' error."""
    model, (x, y) = _mlp(), _xy()
    for outer, inner in (
        (leanprop.clip_per_sample(model, 1.0), leanprop.per_sample(model, leanprop.BatchGrad())),
        (leanprop.per_sample(model, leanprop.BatchGrad()), leanprop.clip_per_sample(model, 1.0)),
    ):
        with outer, pytest.raises(LeanpropValueError, match="cannot be nested"), inner:
            pass
    with leanprop.clip_per_sample(model, 0.1, loss_reduction="sum"):  # usable after
        _ce(model(x), y).backward()
    for k, p in model.named_parameters():
        assert_close(p.grad, _expected(model, x, y, 0.1)[k], k, 1e-10, 1e-12)


def test_autograd_grad_from_another_thread_after_a_clipped_backward():
    """After a clipped .backward(), an autograd.grad the interception does not see (another
    thread) got the zeros handed to autograd for the Linear layers' weights."""
    import threading

    model, (x, y) = _mlp(), _xy()
    reference = torch.autograd.grad(_ce(model(x), y), list(model.parameters()))
    got = {}
    with leanprop.clip_per_sample(model, 1.0, loss_reduction="sum"):
        _ce(model(x), y).backward()
        model.zero_grad()
        loss = _ce(model(x), y)
        thread = threading.Thread(
            target=lambda: got.update(g=torch.autograd.grad(loss, list(model.parameters())))
        )
        thread.start()
        thread.join()
    for a, b in zip(got["g"], reference, strict=True):
        assert_close(a, b, "autograd.grad", 1e-12, 1e-14)


def test_passes_for_inputs_before_the_backward_of_the_same_forward():
    """An input-gradient pass (or backward(inputs=[x])) then the training backward of the same
    forward were refused as a second clipped backward; autograd.grad with a gradient in .grad
    that the clipping did not leave was refused too (it writes nothing)."""
    model, (x, y) = _mlp(), _xy()
    expected = _expected(model, x, y, 0.1)
    for first in ("grad", "inputs"):
        model.zero_grad()
        xr = x.clone().requires_grad_()
        with leanprop.clip_per_sample(model, 0.1, loss_reduction="sum"):
            loss = _ce(model(xr), y)
            if first == "grad":
                torch.autograd.grad(loss, xr, retain_graph=True)
            else:
                loss.backward(inputs=[xr], retain_graph=True)
            loss.backward()
        for k, p in model.named_parameters():
            assert_close(p.grad, expected[k], f"{first}: {k}", 1e-10, 1e-12)
    model.zero_grad()
    _ce(model(x), y).backward()  # a foreign gradient in .grad
    with leanprop.clip_per_sample(model, 0.1, loss_reduction="sum"):
        torch.autograd.grad(_ce(model(x), y), list(model.parameters()))  # accepted


def test_zero_grad_in_place():
    """DPOptimizer.zero_grad(set_to_none=False) left zeros the next clipped backward refused."""
    model, (x, y) = _mlp(), _xy()
    clip = leanprop.clip_per_sample(model, 0.1)
    opt = _dp(model, clip)
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        with clip:
            _ce(model(x), y, "mean").backward()
        opt.step()


def test_the_accountant_is_saved_with_the_optimizer_state():
    """A resumed run restarted epsilon at 0."""
    model, (x, y) = _mlp(), _xy()
    runs = []
    for _ in range(2):
        clip = leanprop.clip_per_sample(model, 0.1)
        adam = torch.optim.Adam(model.parameters(), lr=0.1)
        options = {"expected_batch_size": 6, "accountant": "rdp", "sample_rate": 0.1}
        runs.append(DPOptimizer(adam, clip, noise_multiplier=1.0, **options))
    with runs[0].clip:
        _ce(model(x), y, "mean").backward()
    runs[0].step()
    runs[1].load_state_dict(runs[0].state_dict())
    assert runs[1].accountant.history == runs[0].accountant.history == [(1.0, 0.1, 1)]
    assert runs[1].optimizer.state_dict()["state"].keys() == runs[0].state_dict()["state"].keys()
