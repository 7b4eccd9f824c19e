"""BackPACK's Hessian-diagonal pattern, on leanprop's facade.

``DiagHessian`` and ``BatchDiagHessian`` of a small sigmoid MLP (random data standing in for
MNIST): the Hessian's diagonal is the GGN's plus the terms of the curved activations, so it can
be negative where the GGN's never is. Code written against BackPACK runs with the import
changed (``leanprop.compat.backpack`` instead of ``backpack``). The last layer's diagonal is
checked against autograd's full Hessian (float64).

Run: python examples/backpack_diag_hessian.py
"""

import torch
from torch.nn import CrossEntropyLoss, Flatten, Linear, Sequential, Sigmoid

from leanprop.compat.backpack import backpack, extend, extensions


def main() -> float:
    torch.manual_seed(0)
    model = extend(Sequential(Flatten(), Linear(784, 16), Sigmoid(), Linear(16, 10)).double())
    lossfunc = extend(CrossEntropyLoss())
    x = torch.randn(32, 1, 28, 28, dtype=torch.float64)
    y = torch.randint(0, 10, (32,))

    loss = lossfunc(model(x), y)
    with backpack(
        extensions.DiagHessian(), extensions.BatchDiagHessian(), extensions.DiagGGNExact()
    ):
        loss.backward()

    for name, p in model.named_parameters():
        print(
            f"{name:10s} diag_h {tuple(p.diag_h.shape)}  diag_h_batch "
            f"{tuple(p.diag_h_batch.shape)}  min diag_h {p.diag_h.min().item():+.2e}  "
            f"min diag_ggn_exact {p.diag_ggn_exact.min().item():+.2e}"
        )

    # the first layer's weight: autograd's full Hessian of the loss, its diagonal
    w = model[1].weight

    def loss_of(weight: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(torch.nn.functional.linear(x.flatten(1), weight, model[1].bias))
        return torch.nn.functional.cross_entropy(model[3](h), y)

    small = w[:2, :8]  # (a block of the weight, so that the full Hessian stays small)

    def loss_of_block(block: torch.Tensor) -> torch.Tensor:
        full = w.detach().clone()
        full[:2, :8] = block
        return loss_of(full)

    hessian = torch.autograd.functional.hessian(loss_of_block, small.detach())
    exact = hessian.reshape(16, 16).diagonal().view(2, 8)
    error = (w.diag_h[:2, :8] - exact).abs().max().item()
    print(f"max |diag_h - autograd's| on a block of the first layer: {error:.1e}")
    return error


if __name__ == "__main__":
    main()
