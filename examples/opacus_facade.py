"""An Opacus training loop on leanprop: only the import changes (pip install opacus for the
accountant).

Run: python examples/opacus_facade.py
"""

import torch
from torch import nn

from leanprop.compat.opacus import PrivacyEngine  # was: from opacus import PrivacyEngine


def main(epochs: int = 2) -> float:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 20), torch.randint(0, 3, (256,)))
    train_loader = torch.utils.data.DataLoader(data, batch_size=32)
    model = nn.Sequential(nn.Linear(20, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()

    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader,
        noise_multiplier=1.1, max_grad_norm=1.0,
    )  # fmt: skip
    for _ in range(epochs):
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()  # per-sample clipping happens in this one backward
            optimizer.step()
    return privacy_engine.get_epsilon(delta=1e-5)


if __name__ == "__main__":
    print(f"epsilon = {main():.2f} at delta = 1e-5")
