"""Per-sample gradients, their norms and variance in one backward pass.

Run: python examples/per_sample_quickstart.py
"""

import torch
from torch import nn

import leanprop
from leanprop import BatchGrad, BatchL2Grad, Variance

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Flatten(),
    nn.Linear(8 * 14 * 14, 10),
)
x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))

with leanprop.per_sample(model, BatchGrad(), BatchL2Grad(), Variance()):
    loss = nn.functional.cross_entropy(model(x), y)  # mean over the batch
    loss.backward()

for name, p in model.named_parameters():
    # grad_batch[n] is sample n's contribution to p.grad (its own gradient / N for a mean loss)
    assert torch.allclose(p.grad_batch.sum(0), p.grad, atol=1e-6)
    print(
        f"{name:10} grad_batch {tuple(p.grad_batch.shape)}  "
        f"largest per-sample norm {p.batch_l2.max().sqrt():.3e}  "
        f"total variance {p.variance.sum():.3e}"
    )
