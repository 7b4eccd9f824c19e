"""DPOptimizer (noise, averaging, accounting, refusals), Poisson sampling, and a DP-SGD loop
against Opacus' own (noise 0: the same parameters)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leanprop
from leanprop import DPOptimizer, LeanpropValueError, UnsupportedModelError
from leanprop.privacy import PoissonBatchSampler, make_accountant, noise_multiplier_for

from ..helpers import assert_close


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(24, 3)).double()


def _data(n: int = 16):
    torch.manual_seed(1)
    return torch.randn(n, 2, 8, dtype=torch.float64), torch.randint(0, 3, (n,))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # (Opacus' hooks)
def test_training_matches_opacus_without_noise():
    """Three DP-SGD steps, flat clipping (mean-reduced loss), noise 0: Opacus' parameters."""
    opacus = pytest.importorskip("opacus")
    x, y = _data()
    theirs, ours = _model(), _model()
    gsm = opacus.GradSampleModule(theirs)
    opt_t = opacus.optimizers.DPOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.5), noise_multiplier=0.0, max_grad_norm=0.1,
        expected_batch_size=16,
    )  # fmt: skip
    clip = leanprop.clip_per_sample(ours, 0.1)
    opt_o = DPOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.5), clip, noise_multiplier=0.0,
        expected_batch_size=16,
    )  # fmt: skip
    for _ in range(3):
        opt_t.zero_grad()
        F.cross_entropy(gsm(x), y).backward()
        opt_t.step()
        opt_o.zero_grad()
        with clip:
            F.cross_entropy(ours(x), y).backward()
        opt_o.step()
    for (k, a), b in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        assert_close(b, a, k, 1e-10, 1e-12)
    assert not torch.equal(ours[0].weight, _model()[0].weight)  # (it trained)


def test_noise_statistics_and_averaging():
    """Noise alone (no backward: an empty Poisson batch): mean 0, std sigma * C / B."""
    model = nn.Linear(300, 200)
    clip = leanprop.clip_per_sample(model, 2.0)
    for secure in (False, True):
        opt = DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), clip, noise_multiplier=1.5,
            expected_batch_size=4, secure_mode=secure,
        )  # fmt: skip
        opt.zero_grad()
        opt.step()
        g = model.weight.grad
        std = 1.5 * 2.0 / 4
        assert abs(float(g.std()) / std - 1) < 0.02, (secure, float(g.std()))
        assert abs(float(g.mean())) < 5 * std / math.sqrt(g.numel())


def test_seeded_generator_reproduces_the_noise():
    grads = []
    for _ in range(2):
        model = nn.Linear(3, 2)
        clip = leanprop.clip_per_sample(model, 1.0)
        opt = DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), clip, noise_multiplier=1.0,
            expected_batch_size=2, generator=torch.Generator().manual_seed(7),
        )  # fmt: skip
        opt.step()
        grads.append(model.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_accumulation_averages_over_micro_batches_and_accounts_their_rate():
    model = _model()
    x, y = _data()
    clip = leanprop.clip_per_sample(model, 0.1, loss_reduction="sum")
    accountant = make_accountant("rdp")
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), clip, noise_multiplier=0.0,
        accountant=accountant, sample_rate=0.01,
    )  # fmt: skip
    for part in (slice(0, 8), slice(8, 16)):
        with clip:
            F.cross_entropy(model(x[part]), y[part], reduction="sum").backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()  # sum reduction: no division
    for k, p in model.named_parameters():
        assert torch.equal(p.grad, expected[k]), k
    reference = make_accountant("rdp")
    reference.step(noise_multiplier=0.0, sample_rate=0.02)  # two micro-batches: twice the rate
    assert accountant.history == reference.history


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # (few steps)
def test_epsilon_equals_opacus_accountant():
    pytest.importorskip("opacus")
    model = nn.Linear(3, 2)
    clip = leanprop.clip_per_sample(model, 1.0)
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), clip, noise_multiplier=1.1,
        expected_batch_size=4, accountant="rdp", sample_rate=0.01,
    )  # fmt: skip
    for _ in range(50):
        with clip:
            model(torch.randn(4, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    from opacus.accountants import RDPAccountant

    ref = RDPAccountant()
    for _ in range(50):
        ref.step(noise_multiplier=1.1, sample_rate=0.01)
    assert opt.epsilon(1e-5) == ref.get_epsilon(1e-5)
    sigma = noise_multiplier_for(2.0, 1e-5, 0.01, steps=1000)
    from opacus.accountants.utils import get_noise_multiplier

    assert sigma == get_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=1000, accountant="rdp"
    )


def test_unclipped_gradients_are_refused():
    model = nn.Linear(3, 2)
    clip = leanprop.clip_per_sample(model, 1.0)
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), clip, noise_multiplier=1.0,
        expected_batch_size=4,
    )  # fmt: skip
    model(torch.randn(4, 3)).sum().backward()  # outside the context
    with pytest.raises(UnsupportedModelError, match="not left by per-sample clipping"):
        opt.step()
    opt.zero_grad()
    with clip:
        model(torch.randn(4, 3)).sum().backward()
    model.weight.grad.mul_(2)  # changed after clipping
    with pytest.raises(UnsupportedModelError, match="not left by per-sample clipping"):
        opt.step()
    opt.zero_grad()
    with clip:
        model(torch.randn(4, 3)).sum().backward()
    model(torch.randn(4, 3)).sum().backward()  # an unclipped backward added to it
    with pytest.raises(UnsupportedModelError, match="not left by per-sample clipping"):
        opt.step()


def test_bad_arguments():
    model = nn.Linear(3, 2)
    clip = leanprop.clip_per_sample(model, 1.0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(LeanpropValueError, match="clip_per_sample"):
        DPOptimizer(sgd, leanprop.per_sample(model), noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(LeanpropValueError, match="expected_batch_size"):
        DPOptimizer(sgd, clip, noise_multiplier=1.0)
    with pytest.raises(LeanpropValueError, match="noise_multiplier=-1"):
        DPOptimizer(sgd, clip, noise_multiplier=-1, expected_batch_size=4)
    with pytest.raises(LeanpropValueError, match="an accountant but no sample_rate"):
        DPOptimizer(sgd, clip, noise_multiplier=1.0, expected_batch_size=4, accountant="rdp")
    with pytest.raises(LeanpropValueError, match="unknown accountant 'moments'"):
        DPOptimizer(sgd, clip, noise_multiplier=1.0, expected_batch_size=4, accountant="moments")


def test_scheduler_and_state_dict_reach_the_wrapped_optimizer():
    model = nn.Linear(3, 2)
    clip = leanprop.clip_per_sample(model, 1.0)
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), clip, noise_multiplier=0.0,
        expected_batch_size=4,
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with clip:
        model(torch.randn(4, 3)).sum().backward()
    opt.step()
    scheduler.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.5
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.5


def test_poisson_sampling():
    dataset = torch.utils.data.TensorDataset(torch.randn(50, 3), torch.arange(50))
    loader = leanprop.poisson_loader(dataset, 0.1, generator=torch.Generator().manual_seed(0))
    assert len(loader) == 10
    sizes = [len(x) for x, _ in loader]
    assert len(sizes) == 10 and all(0 <= s <= 50 for s in sizes)
    sampler = PoissonBatchSampler(1000, 0.05, steps=400, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor([len(b) for b in sampler], dtype=torch.float64)
    assert abs(float(counts.mean()) - 50) < 5 * math.sqrt(1000 * 0.05 * 0.95 / 400)
    # an empty batch comes with the shapes of the examples
    empty = leanprop.poisson_loader(dataset, 1e-9, steps=1)
    ((x, idx),) = list(empty)
    assert x.shape == (0, 3) and idx.shape == (0,)
    for bad in ({"sample_rate": 0.0}, {"sample_rate": 1.5}):
        with pytest.raises(LeanpropValueError, match="sample_rate"):
            leanprop.poisson_loader(dataset, **bad)
    with pytest.raises(LeanpropValueError, match="batch_size"):
        leanprop.poisson_loader(dataset, 0.1, batch_size=4)


def test_a_private_training_loop_with_empty_batches():
    """Poisson batches of ~1 sample (some empty) through clipping and the optimizer."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
    loader = leanprop.poisson_loader(dataset, 0.05, generator=torch.Generator().manual_seed(3))
    clip = leanprop.clip_per_sample(model, 1.0, loss_reduction="sum")
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), clip, noise_multiplier=1.0,
        accountant="rdp", sample_rate=0.05,
    )  # fmt: skip
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        with clip:
            F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
        opt.zero_grad()
    assert 0 in sizes and any(sizes)
    assert opt.epsilon(1e-5) > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_empty_poisson_batches_of_mappings_named_tuples_and_strings():
    """A batch type the empty-batch collation did not know (a UserDict such as HF's
    BatchEncoding) came back as the one-example batch of dataset[0]: an example trained on
    without being sampled."""
    import collections

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> dict:
            return {"ids": torch.tensor([i, i + 1]), "label": i, "text": f"example {i}"}

    Pair = collections.namedtuple("Pair", "ids label")
    collates = {
        "user dict": lambda s: collections.UserDict(torch.utils.data.default_collate(s)),
        "named tuple": lambda s: Pair(torch.stack([e["ids"] for e in s]), [e["label"] for e in s]),
        "default (with strings)": torch.utils.data.default_collate,
        "list of examples": lambda s: [e["ids"] for e in s],  # (variable-length sequences)
    }
    for name, collate in collates.items():
        loader = leanprop.poisson_loader(Data(), 1e-9, steps=1, collate_fn=collate)
        (batch,) = list(loader)
        if name == "list of examples":
            assert batch == []  # (was a list holding one emptied tensor: one example)
            continue
        ids = batch.ids if name == "named tuple" else batch["ids"]
        assert ids.shape == (0, 2), name
        if name == "default (with strings)":
            assert batch["text"] == [] and batch["label"].shape == (0,)
        if name == "named tuple":
            assert batch.label == []

    class Custom:
        def __init__(self, ids: torch.Tensor) -> None:
            self.ids = ids

    loader = leanprop.poisson_loader(
        Data(), 1e-9, steps=1, collate_fn=lambda s: Custom(torch.stack([e["ids"] for e in s]))
    )
    with pytest.raises(LeanpropValueError, match=r"cannot make an empty batch .* Custom"):
        list(loader)


def test_noise_keeps_the_gradients_memory_layout():
    """A channels_last convolution's clipped gradient keeps its layout through the noise and
    the average (the noise's own buffer, contiguous, took them in place)."""
    torch.manual_seed(0)
    channels_last = torch.channels_last
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 2))
    model = model.to(memory_format=channels_last)
    x = torch.randn(5, 3, 6, 6).to(memory_format=channels_last)
    y = torch.randint(0, 2, (5,))
    clip = leanprop.clip_per_sample(model, 1.0)
    opt = leanprop.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), clip, noise_multiplier=1.0,
        expected_batch_size=5,
    )  # fmt: skip
    with clip:
        F.cross_entropy(model(x), y).backward()
    assert model[0].weight.grad.is_contiguous(memory_format=channels_last)
    opt.noise_and_average()
    assert model[0].weight.grad.is_contiguous(memory_format=channels_last)
