"""InBackward as the optimizer of real training stacks (HF ``Trainer``, Lightning, accelerate):
bit-identical to the same trainer with the plain optimizer, stepping in backward wherever the
trainer's step allows it, and holding the gradients for ``step()`` where it does not."""

from __future__ import annotations

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
    real = InBackward._step_params

    def counting(self, params, in_backward=True):
        if params:
            counts["backward" if in_backward else "step"] += 1
        return real(self, params, in_backward)

    monkeypatch.setattr(InBackward, "_step_params", counting)
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


def _hf_run(tmp_path, ours: bool, **kwargs):
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
        trainer = tf.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
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
                   algorithm: str | None = None) -> nn.Module:  # fmt: skip
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
    torch.manual_seed(0)
    module = Regression()
    trainer = pl.Trainer(
        max_epochs=2, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm, precision=precision, accelerator="cpu",
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    try:
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
}


@pytest.mark.parametrize("case", LIGHTNING_CASES)
def test_lightning_trains_bit_identically(case, monkeypatch):
    """Lightning automatic optimization with InBackward from configure_optimizers: bit-identical
    to the plain AdamW (was: "takes no closure"; accumulate_grad_batches stepped every
    micro-batch; gradient_clip_val raised, under bf16-mixed as well). Steps happen in
    backward (inside Lightning's step(closure)) wherever the trainer does not clip."""
    plain = _lightning_run(False, *LIGHTNING_CASES[case])
    counts = _count_steps(monkeypatch)
    ours = _lightning_run(True, *LIGHTNING_CASES[case])
    _assert_same(plain, ours)
    clips = LIGHTNING_CASES[case][1] is not None
    assert (counts["backward"] > 0) != clips, counts


def test_lightning_accumulation_without_detection_raises_not_steps_twice(monkeypatch):
    """Should Lightning's wrapper stop being recognised, accumulation must not train silently
    differently: the micro-batch stepped outside step(closure) is reported at the step."""
    monkeypatch.setattr(in_backward, "lightning_wrapped", lambda cls: None)
    with pytest.raises(UnsupportedModelError, match=r"outside the closure"):
        _lightning_run(True, 2, None)


# ---------------------------------------------------------------------------- accelerate
def _accelerate_run(ours: bool, accumulate: int, call_step: bool = True) -> nn.Module:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))
    if ours:
        opt = InBackward(model.parameters(), torch.optim.Adam, lr=1e-2)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g))
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    try:
        for (x,) in loader:
            with acc.accumulate(model):
                acc.backward(model(x).square().mean())
                if call_step:
                    opt.step()
                    opt.zero_grad()
    finally:
        if ours:
            opt.optimizer.remove()
        GradientState._reset_state()
    return model


@pytest.mark.parametrize("accumulate", [1, 3])
def test_accelerate_loop_trains_bit_identically(accumulate, monkeypatch):
    """An accelerate loop (prepare, accumulate, backward, step): bit-identical to the plain
    optimizer, micro-batches before the last held, the last stepped in backward."""
    plain = _accelerate_run(False, accumulate)
    counts = _count_steps(monkeypatch)
    ours = _accelerate_run(True, accumulate)
    _assert_same(plain, ours)
    assert counts["backward"] > 0


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
