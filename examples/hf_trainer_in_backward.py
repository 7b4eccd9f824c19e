"""HF ``Trainer`` with the optimizer stepped inside backward: only the optimizer changes.

Run:

    python examples/hf_trainer_in_backward.py

A small GPT-2 (built from a config, no download) is trained twice by ``transformers.Trainer``
with gradient accumulation: once with ``torch.optim.AdamW``, once with
``InBackward(..., torch.optim.AdamW)`` passed as ``optimizers=(opt, None)``. The final
parameters are bit-identical. InBackward reads from accelerate which micro-batches synchronise
(those before the last only accumulate), holds the gradients of the first step to learn what
the trainer does between backward and ``step()``, and from then on steps each bucket of
gradients during the last micro-batch's backward. With ``max_grad_norm > 0`` (the Trainer's
default is 1.0) the trainer clips exactly, so the gradients are held for its clip and
``step()`` at every step, as with the plain optimizer: set ``max_grad_norm=0`` (as here) or
choose InBackward's approximate clipping (``clip_grad_norm=``) to keep the memory saving.
"""

from __future__ import annotations

import tempfile
import warnings

import torch
import transformers as tf

from leanprop.optim import InBackward


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (a language-modelling batch needs nothing else)."""

    def __init__(self, n: int = 32, length: int = 16) -> None:
        self.x = torch.randint(0, 100, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def train(in_backward: bool, out_dir: str) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = tf.GPT2LMHeadModel(config)
    if in_backward:
        opt = InBackward(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    args = tf.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=0, num_train_epochs=2, use_cpu=True, seed=0, report_to=[],
        save_strategy="no", logging_steps=2, disable_tqdm=True,
    )  # fmt: skip
    trainer = tf.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
    trainer.train()
    if in_backward:
        opt.remove()
    return model


def main() -> None:
    tf.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    with tempfile.TemporaryDirectory() as out_dir:
        plain = train(False, out_dir)
        ours = train(True, out_dir)
    pairs = zip(plain.parameters(), ours.parameters(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    print(f"parameters bit-identical to the plain AdamW run: {same}")
    assert same


if __name__ == "__main__":
    main()
