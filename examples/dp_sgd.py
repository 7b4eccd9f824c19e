"""Private training (DP-SGD) with leanprop: per-sample clipping inside the one backward pass,
noise and averaging in the optimizer, Poisson-sampled batches, privacy spent by Opacus' RDP
accountant (pip install opacus).

Run: python examples/dp_sgd.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import leanprop


def main(epochs: int = 3) -> tuple[list[float], float]:
    """Train a small CNN on a synthetic task; returns each epoch's mean loss and epsilon."""
    torch.manual_seed(0)
    x = torch.randn(512, 1, 12, 12)
    y = (x[:, 0, :6].mean((1, 2)) > x[:, 0, 6:].mean((1, 2))).long()  # top half brighter?
    dataset = torch.utils.data.TensorDataset(x, y)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 6 * 6, 2),
    )  # fmt: skip
    sample_rate = 64 / len(dataset)  # expected batch size 64
    loader = leanprop.poisson_loader(dataset, sample_rate)
    clip = leanprop.clip_per_sample(model, max_grad_norm=1.0)  # loss_reduction="mean"
    optimizer = leanprop.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), clip, noise_multiplier=1.0,
        expected_batch_size=64, accountant="rdp", sample_rate=sample_rate,
    )  # fmt: skip
    losses = []
    for _ in range(epochs):
        total, count = 0.0, 0
        for xb, yb in loader:
            with clip:  # forward and backward inside: .grad gets the clipped sum
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
            optimizer.step()  # noise once, average by 64, step, account
            optimizer.zero_grad()
            if len(xb):  # (Poisson batches may be empty)
                total, count = total + loss.item() * len(xb), count + len(xb)
        losses.append(total / count)
    return losses, optimizer.epsilon(delta=1e-5)


if __name__ == "__main__":
    losses, epsilon = main()
    print("mean loss per epoch:", [round(v, 3) for v in losses])
    print(f"privacy spent: epsilon = {epsilon:.2f} at delta = 1e-5")
