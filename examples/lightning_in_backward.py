"""Lightning with the optimizer stepped inside backward: only ``configure_optimizers`` changes.

Run:

    python examples/lightning_in_backward.py

A small regression model is trained twice by ``lightning.Trainer`` with gradient accumulation,
bf16 mixed precision and an LR schedule: once with ``torch.optim.AdamW``, once with
``InBackward(..., torch.optim.AdamW)``. The final parameters are bit-identical. Lightning runs
the last micro-batch's forward and backward inside ``optimizer.step(closure)``: from the second
step on, that backward steps each bucket of gradients as soon as it is final (the first step
is held, to learn what the trainer does before its step), the micro-batches before it only
accumulate. With ``gradient_clip_val`` set, the trainer clips exactly, so the gradients are
held for its clip and ``step()``, as with the plain optimizer.
"""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from leanprop.optim import InBackward


class Regression(pl.LightningModule):
    def __init__(self, in_backward: bool) -> None:
        super().__init__()
        self.in_backward = in_backward
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.GELU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> dict:
        if self.in_backward:  # the only change
            opt = InBackward(self.parameters(), torch.optim.AdamW, lr=1e-2)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k))
        return {"optimizer": opt, "lr_scheduler": schedule}


def train(in_backward: bool) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    torch.manual_seed(0)
    module = Regression(in_backward)
    trainer = pl.Trainer(
        max_epochs=3, accumulate_grad_batches=2, precision="bf16-mixed", accelerator="cpu",
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    if in_backward:
        trainer.optimizers[0].remove()
    return module


def main() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    plain, ours = train(False), train(True)
    pairs = zip(plain.parameters(), ours.parameters(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    print(f"parameters bit-identical to the plain AdamW run: {same}")
    assert same


if __name__ == "__main__":
    main()
