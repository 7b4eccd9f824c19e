"""The Opacus facade against Opacus itself: the same training loop with only the import
changed gives Opacus' parameters (noise 0) and Opacus' epsilon."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leanprop import LeanpropValueError, UnsupportedModelError
from leanprop.compat.opacus import PrivacyEngine
from leanprop.testing import clipped_gradients

from ..helpers import assert_close

opacus = pytest.importorskip("opacus")
pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),  # (Opacus' hooks)
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Optimal order is the"),
    pytest.mark.filterwarnings("ignore:GDP accounting is experimental"),
]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.norm = nn.GroupNorm(2, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [N, T]
        h = self.norm(self.conv(self.emb(ids).transpose(1, 2))).relu()
        return self.head(h.mean(2))


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = _Net()
    data = torch.utils.data.TensorDataset(torch.randint(0, 20, (24, 5)), torch.randint(0, 3, (24,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    return model, torch.optim.SGD(model.parameters(), lr=0.5), loader


def _train(
    engine, reduction: str = "mean", noise: float = 0.0, epochs: int = 2,
    physical_batch: int | None = None, **options,
):  # fmt: skip
    """An Opacus loop (``physical_batch``: through Opacus' BatchMemoryManager); returns the
    trained parameters and the engine."""
    model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise,
        poisson_sampling=False, loss_reduction=reduction, **options,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        if physical_batch is not None:
            from opacus.utils.batch_memory_manager import BatchMemoryManager

            manager = BatchMemoryManager(
                data_loader=loader, max_physical_batch_size=physical_batch, optimizer=optimizer
            )
            loader = stack.enter_context(manager)
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y, reduction=reduction).backward()
                optimizer.step()
    inner = getattr(model, "_module", model)
    return {k: p.detach().clone() for k, p in inner.named_parameters()}, engine


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_the_same_loop_gives_opacus_parameters(clipping, reduction):
    norm = 0.3 if clipping == "flat" else [0.1, 0.2, 0.05, 0.3, 0.2, 0.1, 0.4]
    options = {"max_grad_norm": norm, "clipping": clipping}
    theirs, _ = _train(opacus.PrivacyEngine(), reduction, **options)
    ours, _ = _train(PrivacyEngine(), reduction, **options)
    for k in theirs:
        assert_close(ours[k], theirs[k], k, 1e-5, 1e-6)
    initial = dict(_setup()[0].named_parameters())
    assert not torch.allclose(ours["head.weight"], initial["head.weight"])  # (it trained)


@pytest.mark.parametrize("accountant", ["prv", "rdp", "gdp"])
def test_epsilon_equals_opacus(accountant):
    _, theirs = _train(opacus.PrivacyEngine(accountant=accountant), noise=1.0, max_grad_norm=1.0)
    _, ours = _train(PrivacyEngine(accountant=accountant), noise=1.0, max_grad_norm=1.0)
    assert ours.get_epsilon(1e-5) == theirs.get_epsilon(1e-5)


def test_poisson_sampling_and_make_private_with_epsilon():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0,
        target_delta=1e-5, epochs=2, max_grad_norm=1.0,
    )  # fmt: skip
    their_model, their_optimizer, their_loader = _setup()
    _, their_optimizer, _ = opacus.PrivacyEngine(accountant="rdp").make_private_with_epsilon(
        module=their_model, optimizer=their_optimizer, data_loader=their_loader,
        target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0,
    )  # fmt: skip
    assert optimizer.noise_multiplier == their_optimizer.noise_multiplier
    sizes = []
    for _ in range(2):
        for x, y in loader:
            sizes.append(len(x))
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert len(sizes) == 6 and len(set(sizes)) > 1  # Poisson: sizes vary
    assert abs(engine.get_epsilon(1e-5) - 3.0) < 0.1


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_virtual_steps_with_opacus_batch_memory_manager(reduction):
    """Opacus' BatchMemoryManager splits each batch of 8 into physical batches of 3: one step
    per batch, averaged by the batch size and accounted once, as in Opacus (the facade
    averaged by 8 times the physical batches and accounted their rate)."""

    def train(engine, noise: float):
        return _train(engine, reduction, noise, epochs=1, physical_batch=3, max_grad_norm=0.3)

    theirs, _ = train(opacus.PrivacyEngine(accountant="rdp"), 0.0)
    ours, _ = train(PrivacyEngine(accountant="rdp"), 0.0)
    for k in theirs:
        assert_close(ours[k], theirs[k], k, 1e-5, 1e-6)
    _, their_engine = train(opacus.PrivacyEngine(accountant="rdp"), 1.0)
    _, our_engine = train(PrivacyEngine(accountant="rdp"), 1.0)
    assert our_engine.accountant.history == their_engine.accountant.history
    assert our_engine.get_epsilon(1e-5) == their_engine.get_epsilon(1e-5)


def test_forward_without_backward_then_another_batch_size_and_make_private_again():
    """A forward with autograd on and no backward (a validation forward), then the next batch
    of another size raised a BatchError; make_private twice left the module unusable."""
    model, optimizer, loader = _setup()
    engine = PrivacyEngine(accountant="rdp")
    for norm in (5.0, 0.3):  # the second call's threshold is the one used
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0,
            max_grad_norm=norm, poisson_sampling=False,
        )  # fmt: skip
    x, y = next(iter(loader))
    model(x[:5])  # validation forward under grad
    reference = copy.deepcopy(model)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    expected, _ = clipped_gradients(
        reference, lambda o, t, r: F.cross_entropy(o, t, reduction=r), x, y, 0.3
    )
    for k, p in model.named_parameters():
        assert_close(p.grad, expected[k], k, 1e-5, 1e-6)


def test_what_the_facade_does_not_offer():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine()
    base = {"module": model, "optimizer": optimizer, "data_loader": loader, "noise_multiplier": 1.0}
    with pytest.raises(LeanpropValueError, match="ghost"):
        engine.make_private(**base, max_grad_norm=1.0, grad_sample_mode="ghost")
    with pytest.raises(LeanpropValueError, match="'flat' and 'per_layer'"):
        engine.make_private(**base, max_grad_norm=1.0, clipping="adaptive")
    with pytest.raises(LeanpropValueError, match="takes a list of thresholds"):
        engine.make_private(**base, max_grad_norm=1.0, clipping="per_layer")
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    data = torch.utils.data.TensorDataset(torch.randn(8, 3))
    bn, _, dl = engine.make_private(
        module=bn, optimizer=torch.optim.SGD(bn.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=False,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="BatchNorm"):
        bn(next(iter(dl))[0]).sum().backward()


def test_zeroing_through_the_model_and_checkpoints(tmp_path):
    """With model.zero_grad() (HF Trainer's way) each step averaged by one more batch and
    accounted one more rate than the last; the accountant's history survives a checkpoint."""
    model, optimizer, loader = _setup()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=False,
    )  # fmt: skip
    for x, y in loader:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert engine.accountant.history == [(1.0, 1 / 3, 3)]
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
    fresh_model, fresh_optimizer, _ = _setup()
    fresh = PrivacyEngine(accountant="rdp")
    fresh.load_checkpoint(path=tmp_path / "ckpt.pt", module=fresh_model, optimizer=fresh_optimizer)
    assert fresh.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    for a, b in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_loss_scaling_is_refused_with_its_reason():
    """The facade's optimizer took no grad_scaler: GradScaler.step raised a raw TypeError."""
    model, optimizer, loader = _setup()
    model, optimizer, loader = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=False,
    )  # fmt: skip
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(loader))
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    with (
        pytest.warns(FutureWarning, match="GradScaler is going to stop passing"),
        pytest.raises(UnsupportedModelError, match="loss scaling"),
    ):
        scaler.step(optimizer)
