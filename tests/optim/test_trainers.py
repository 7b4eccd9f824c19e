"""InBackward as the optimizer of real training stacks (HF ``Trainer``, Lightning, accelerate):
bit-identical to the same trainer with the plain optimizer, stepping in backward wherever the
trainer's step allows it, and holding the gradients for ``step()`` where it does not."""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings

import pytest
import torch
from torch import nn

from leanprop import UnsupportedModelError
from leanprop.optim import InBackward, in_backward


def _count_steps(monkeypatch) -> dict[str, int]:
    """Counts the inner steps InBackward makes in backward and in ``step()``."""
    counts = {"backward": 0, "step": 0}
    real = InBackward.step_bucket

    def counting(self, params, in_backward=True):
        if params:
            counts["backward" if in_backward else "step"] += 1
        return real(self, params, in_backward)

    monkeypatch.setattr(InBackward, "step_bucket", counting)
    return counts


def _assert_same(model_a: nn.Module, model_b: nn.Module) -> None:
    for (k, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b), k


# ---------------------------------------------------------------------------- HF Trainer
class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randint(0, 100, (24, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class _HalveGradients:
    """An HF callback that changes the gradients before the step (no clipping call)."""

    def __getattr__(self, name):  # every other event: nothing
        return lambda *args, **kwargs: None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        for p in kwargs["model"].parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


def _hf_run(tmp_path, ours: bool, callback: bool = False, twice: dict | None = None,
            **kwargs):  # fmt: skip
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = tf.GPT2LMHeadModel(cfg)
    if ours:
        opt = InBackward(model.parameters(), torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():  # (newer versions rename gradient_checkpointing)
        warnings.simplefilter("ignore")
        args = tf.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, num_train_epochs=1,
            report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
            disable_tqdm=True, **kwargs,
        )  # fmt: skip
        data = _Tokens()
        callbacks = [_HalveGradients()] if callback else None
        trainer = tf.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None),
                             callbacks=callbacks)  # fmt: skip
        trainer.train()
        for k, v in (twice or {}).items():  # train again, the arguments changed
            setattr(trainer.args, k, v)
        if twice is not None:
            trainer.train()
    if ours:
        opt.remove()
    return model, [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


HF_CASES = {
    "defaults": {},  # max_grad_norm=1.0: the trainer clips
    "no-clipping": {"max_grad_norm": 0},
    "accumulation": {"gradient_accumulation_steps": 2},
    "accumulation-no-clipping": {"gradient_accumulation_steps": 2, "max_grad_norm": 0},
    "bf16": {"bf16": True},
    "bf16-no-clipping": {"bf16": True, "max_grad_norm": 0},
    "checkpointing-no-clipping": {"gradient_checkpointing": True, "max_grad_norm": 0},
}


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_trainer_trains_bit_identically(case, tmp_path, monkeypatch):
    """HF Trainer with InBackward and no other change: the parameters and the logged gradient
    norms are bit-identical to the Trainer with the plain AdamW (gradient accumulation was
    stepped on every micro-batch; the default max_grad_norm raised). Without clipping the
    steps happen in backward from the second step on; with it, the gradients are held for the
    trainer's clip and step()."""
    kwargs = HF_CASES[case]
    plain, plain_norms = _hf_run(tmp_path, False, **kwargs)
    counts = _count_steps(monkeypatch)
    ours, our_norms = _hf_run(tmp_path, True, **kwargs)
    _assert_same(plain, ours)
    assert our_norms == plain_norms and len(our_norms) >= 3
    clips = kwargs.get("max_grad_norm", 1.0) > 0
    assert (counts["backward"] > 0) != clips, counts  # stepped in backward unless it clips
    assert counts["step"] >= 1  # the first step (and every clipped one) through step()


# ---------------------------------------------------------------------------- Lightning
def _lightning_run(ours: bool, accumulate: int, clip: float | None, precision: str = "32-true",
                   algorithm: str | None = None, hook: str | None = None,
                   fits: int = 1) -> nn.Module:  # fmt: skip
    pl = pytest.importorskip("lightning.pytorch")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            if ours:
                opt = InBackward(self.parameters(), torch.optim.AdamW, lr=1e-2)
            else:
                opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            self.opt = opt
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (k + 1))
            return {"optimizer": opt, "lr_scheduler": schedule}

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(72, 8, generator=g), 3 * torch.randn(72, 1, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    class Hooked(Regression):
        def on_before_optimizer_step(self, optimizer):
            if hook == "scale":  # a gradient change no clipping call shows
                for p in self.parameters():
                    p.grad.mul_(0.5)
            else:  # Lightning's recipe for logging the gradient norms
                from lightning.pytorch.utilities import grad_norm

                self.norms_seen.append(len(grad_norm(self.net, norm_type=2)))

    torch.manual_seed(0)
    module = Regression() if hook is None else Hooked()
    module.norms_seen = []
    try:
        for _ in range(fits):  # each fit calls configure_optimizers again
            trainer = pl.Trainer(
                max_epochs=2, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                gradient_clip_algorithm=algorithm, precision=precision, accelerator="cpu",
                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False,
            )  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.fit(module, data)
    finally:
        if ours:
            module.opt.remove()
    return module


LIGHTNING_CASES = {
    "defaults": (1, None),
    "accumulation": (2, None),
    "accumulation-3": (3, None),
    "clip-norm": (1, 0.5),
    "accumulation-clip-norm": (2, 0.5),
    "bf16-mixed": (1, None, "bf16-mixed"),
    "bf16-mixed-clip-norm": (1, 0.5, "bf16-mixed"),
    "bf16-mixed-accumulation-clip-norm": (2, 0.5, "bf16-mixed"),
    "clip-value": (1, 0.05, "32-true", "value"),
    "gradients-changed-in-a-hook": (1, None, "32-true", None, "scale"),
    "gradient-norms-logged-in-a-hook": (1, None, "32-true", None, "log"),
    "fit-twice": (2, None, "32-true", None, None, 2),
}


@pytest.mark.parametrize("case", LIGHTNING_CASES)
def test_lightning_trains_bit_identically(case, monkeypatch):
    """Lightning automatic optimization with InBackward from configure_optimizers: bit-identical
    to the plain AdamW (was: "takes no closure"; accumulate_grad_batches stepped every
    micro-batch; gradient_clip_val raised, under bf16-mixed as well). Steps happen in
    backward (inside Lightning's step(closure)) wherever the trainer does not clip or
    otherwise see the gradients (a hook scaling them was skipped from the second step on,
    silently, and one logging their norms found none; a second fit raised "already belong to
    another InBackward")."""
    plain = _lightning_run(False, *LIGHTNING_CASES[case])
    counts = _count_steps(monkeypatch)
    ours = _lightning_run(True, *LIGHTNING_CASES[case])
    _assert_same(plain, ours)
    holds = LIGHTNING_CASES[case][1] is not None or "hook" in case
    assert (counts["backward"] > 0) != holds, counts
    assert ours.norms_seen == plain.norms_seen  # (grad_norm found no gradient: empty dicts)


def test_lightning_accumulation_without_detection_raises_not_steps_twice(monkeypatch):
    """Should Lightning's wrapper stop being recognised, accumulation must not train silently
    differently: the micro-batch stepped outside step(closure) is reported at the step."""
    monkeypatch.setattr(in_backward, "lightning_wrapper", lambda cls: None)
    with pytest.raises(UnsupportedModelError, match=r"outside the closure"):
        _lightning_run(True, 2, None)


# ---------------------------------------------------------------------------- accelerate
def _small_adam(ours: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))
    if ours:
        return model, InBackward(model.parameters(), torch.optim.Adam, lr=1e-2)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _accelerate_run(ours: bool, accumulate: int, call_step: bool = True, clip: bool = False,
                    device_placement: bool = True, norms: list | None = None,
                    clip_after: int | None = None) -> nn.Module:  # fmt: skip
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model, opt = _small_adam(ours)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g))
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate,
                                 device_placement=device_placement)  # fmt: skip
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    try:
        for i, (x,) in enumerate(loader):
            with acc.accumulate(model):
                acc.backward(model(x).square().mean())
                if norms is not None and acc.sync_gradients:  # (what HF Trainer logs)
                    max_norm = float("inf") if clip_after is None or i < clip_after else 1.0
                    norms.append(acc.clip_grad_norm_(model.parameters(), max_norm))
                if clip and acc.sync_gradients:  # the user's own clipping, in two calls
                    grads = [p.grad for p in model.parameters()]
                    norm = torch.nn.utils.get_total_norm(grads)
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.01, norm)
                if call_step:
                    opt.step()
                    opt.zero_grad()
    finally:
        if ours:
            opt.optimizer.remove()
        GradientState._reset_state()
    return model


@pytest.mark.parametrize("clip", [False, True], ids=["", "clipping-in-two-calls"])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_accelerate_loop_trains_bit_identically(accumulate, clip, monkeypatch):
    """An accelerate loop (prepare, accumulate, backward, step): bit-identical to the plain
    optimizer, micro-batches before the last held, the last stepped in backward; with the
    user's clipping as get_total_norm + clip_grads_with_norm_, held at every step (it was
    skipped from the second step on, silently)."""
    plain = _accelerate_run(False, accumulate, clip=clip)
    counts = _count_steps(monkeypatch)
    ours = _accelerate_run(True, accumulate, clip=clip)
    _assert_same(plain, ours)
    assert (counts["backward"] > 0) != clip, counts


@pytest.mark.parametrize("accumulate", [1, 3])
def test_accelerator_clip_grad_norm_reads_the_stepped_norm(accumulate, monkeypatch):
    """accelerate's ``Accelerator.clip_grad_norm_(params, inf)``, which HF Trainer calls every
    step to log the norm: bit-identical to the plain loop's, the steps in backward. From
    accelerate 1.16 on it takes the norm of the gradients that are there itself, and returned
    0 for gradients stepped and freed, silently."""
    plain_norms: list[torch.Tensor] = []
    our_norms: list[torch.Tensor] = []
    plain = _accelerate_run(False, accumulate, norms=plain_norms)
    counts = _count_steps(monkeypatch)
    ours = _accelerate_run(True, accumulate, norms=our_norms)
    _assert_same(plain, ours)
    assert len(our_norms) == len(plain_norms) >= 3
    assert all(torch.equal(a, b) for a, b in zip(our_norms, plain_norms, strict=True))
    assert counts["backward"] > 0 and all(n > 0 for n in our_norms)


def test_accelerator_clip_grad_norm_of_stepped_gradients_is_refused():
    """A loop that starts clipping after the first steps (learnt: none) would clip gradients
    already stepped and freed: accelerate 1.16 clipped nothing, silently; refused. The guard
    goes with the last InBackward."""
    accelerate = pytest.importorskip("accelerate")
    original = vars(accelerate.Accelerator)["clip_grad_norm_"]
    with pytest.raises(UnsupportedModelError, match=r"nothing left to clip"):
        _accelerate_run(True, 1, norms=[], clip_after=3)
    gc.collect()  # (no other InBackward alive: the guard is gone)
    assert vars(accelerate.Accelerator)["clip_grad_norm_"] is original


def test_accelerate_without_device_placement_refuses_the_first_micro_batch():
    """Without device placement accelerate's wrapper never reads the optimizer's state_dict,
    so leanprop cannot know it is driven before its first step(): the first micro-batches
    were stepped in backward, silently. Now a clear error."""
    with pytest.raises(UnsupportedModelError, match=r"device_placement"):
        _accelerate_run(True, 3, device_placement=False)


def test_accelerate_loop_without_step_raises():
    """A loop driven by accelerate holds the first step's gradients for step(): one that never
    calls step() is told so at the next backward (instead of never training)."""
    with pytest.raises(UnsupportedModelError, match=r"step\(\) was not called"):
        _accelerate_run(True, 1, call_step=False)


def test_lightning_wrapper_runs_the_optimizers_own_methods():
    """Methods called on Lightning's wrapper (self.optimizers()) act on the optimizer itself:
    manual optimization with clipped_backward through the wrapper is exact, and remove()
    through it releases the parameters (both ran on the wrapper, whose state the hooks never
    see: clipped_backward stepped unclipped, remove() left the parameters taken)."""
    pl = pytest.importorskip("lightning.pytorch")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Manual(pl.LightningModule):
        def __init__(self, ours: bool) -> None:
            super().__init__()
            self.ours, self.automatic_optimization = ours, False
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, index):
            opt = self.optimizers()
            opt.zero_grad()
            loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
            if self.ours:
                opt.clipped_backward(loss, 0.1)
            else:
                self.manual_backward(loss)
                torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)
            opt.step()

        def configure_optimizers(self):
            if self.ours:
                return InBackward(self.parameters(), torch.optim.AdamW, lr=1e-2)
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def run(ours: bool) -> nn.Module:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                              torch.randn(32, 1, generator=g))  # fmt: skip
        torch.manual_seed(0)
        module = Manual(ours)
        trainer = pl.Trainer(
            max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
        if ours:
            assert module.optimizers().last_grad_norm is not None
            module.optimizers().remove()
            InBackward(module.parameters(), torch.optim.SGD, lr=0.1).remove()  # free again
        return module

    _assert_same(run(False), run(True))


@pytest.mark.parametrize(
    "script, needs",
    [("hf_trainer_in_backward.py", "transformers"), ("lightning_in_backward.py", "lightning")],
)
def test_examples_run(script, needs):
    import pathlib
    import runpy

    pytest.importorskip(needs)
    path = pathlib.Path(__file__).parents[2] / "examples" / script
    runpy.run_path(str(path), run_name="__main__")


def test_lightning_optimizer_reused_after_fit_in_a_plain_loop():
    """The optimizer a finished fit used, reused in a plain loop: steps in backward."""
    pl = pytest.importorskip("lightning.pytorch")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.opt = InBackward(self.parameters(), torch.optim.SGD, lr=0.1)

        def training_step(self, batch, index):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return self.opt

    module = Tiny()
    data = torch.utils.data.TensorDataset(torch.randn(16, 4))
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=2, accelerator="cpu",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    before = module.net.weight.detach().clone()
    module.net(torch.randn(4, 4)).square().mean().backward()
    assert module.net.weight.grad is None and not torch.equal(before, module.net.weight)
    module.opt.remove()


def test_fabric_wrapper_runs_the_optimizers_own_methods():
    """Fabric copies the optimizer's state into its wrapper once: opt.accumulate() through
    the wrapper set a flag the hooks never saw, and every micro-batch was stepped."""
    lightning = pytest.importorskip("lightning")
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

    def run(ours: bool) -> nn.Module:
        fabric = lightning.Fabric(accelerator="cpu", devices=1)
        model, opt = fabric.setup(*_small_adam(ours))
        x = torch.randn(12, 4, 6, generator=torch.Generator().manual_seed(1))
        for i in range(12):
            last = (i + 1) % 3 == 0
            with opt.accumulate() if ours and not last else contextlib.nullcontext():
                fabric.backward(model(x[i]).square().mean())
            if last:
                opt.step()
                opt.zero_grad()
        if ours:
            opt.remove()
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _assert_same(run(False), run(True))


def test_hf_trainer_callback_changing_gradients(tmp_path):
    """A callback that changes the gradients before the step (no clipping call) was skipped
    from the second step on, silently: now bit-identical to the plain optimizer."""
    plain, plain_norms = _hf_run(tmp_path, False, max_grad_norm=0, callback=True)
    ours, our_norms = _hf_run(tmp_path, True, max_grad_norm=0, callback=True)
    _assert_same(plain, ours)
    assert our_norms == plain_norms


def test_hf_trainer_clipping_turned_on_for_a_second_run_is_refused(tmp_path):
    """The trainer's clipping is learnt on the optimizer's first step: a second train() with
    the same optimizer that clips now gets the guard's clear error (never unclipped)."""
    with pytest.raises(UnsupportedModelError, match=r"needs a new InBackward"):
        _hf_run(tmp_path, True, max_grad_norm=0, twice={"max_grad_norm": 1.0})


def test_accelerate_loop_that_skips_a_step_with_zero_grad():
    """A trainer-driven loop that drops a held step with zero_grad() (e.g. a skipped batch)
    got "step() was not called" at its next backward."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        model = nn.Linear(3, 2)
        opt = InBackward(model.parameters(), torch.optim.SGD, lr=0.1)
        acc = accelerate.Accelerator(cpu=True)
        model, opt = acc.prepare(model, opt)
        acc.backward(model(torch.randn(4, 3)).sum())  # the first step: held
        opt.zero_grad()  # skipped
        acc.backward(model(torch.randn(4, 3)).sum())
        opt.step()
        opt.optimizer.remove()
    finally:
        GradientState._reset_state()
