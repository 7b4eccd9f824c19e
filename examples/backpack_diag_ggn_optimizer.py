"""BackPACK's "diagonal Gauss-Newton second-order optimizer" pattern, on leanprop's facade.

A Newton-like step with the GGN diagonal (Monte-Carlo, one sample) as preconditioner:
``p -= lr * p.grad / (p.diag_ggn_mc + damping)``. Code written against BackPACK runs with
the import changed (``leanprop.compat.backpack`` instead of ``backpack``); random data stands
in for MNIST. Also printed: the exact diagonal and the Kronecker factors of one layer.

Run: python examples/backpack_diag_ggn_optimizer.py
"""

import torch
from torch.nn import Conv2d, CrossEntropyLoss, Flatten, Linear, MaxPool2d, ReLU, Sequential

from leanprop.compat.backpack import backpack, extend, extensions


class DiagGGNOptimizer(torch.optim.Optimizer):
    """SGD preconditioned by the damped GGN diagonal."""

    def __init__(self, parameters, step_size, damping):
        super().__init__(parameters, dict(step_size=step_size, damping=damping))

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                step_direction = p.grad / (p.diag_ggn_mc + group["damping"])
                p.data.add_(step_direction, alpha=-group["step_size"])


def main(steps: int = 5) -> list[float]:
    torch.manual_seed(0)
    model = extend(
        Sequential(
            Conv2d(1, 8, 3, padding=1), ReLU(), MaxPool2d(2), Flatten(), Linear(8 * 14 * 14, 10)
        )
    )
    lossfunc = extend(CrossEntropyLoss())
    optimizer = DiagGGNOptimizer(model.parameters(), step_size=0.1, damping=10.0)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = lossfunc(model(x), y)
        with backpack(extensions.DiagGGNMC()):
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.4f}")

    loss = lossfunc(model(x), y)
    with backpack(extensions.DiagGGNExact(), extensions.KFLR()):
        loss.backward()
    w = model[4].weight
    b, a = w.kflr
    print(
        "diag_ggn_exact",
        tuple(w.diag_ggn_exact.shape),
        "kflr factors",
        tuple(b.shape),
        tuple(a.shape),
    )
    return losses


if __name__ == "__main__":
    main()
