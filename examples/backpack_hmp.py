"""BackPACK's block-diagonal Hessian products (``HMP``), on leanprop's facade.

``p.hmp(mat)`` multiplies ``mat`` ``[V, *p.shape]`` by the parameter's block of the loss's
Hessian (the GGN's part plus the curved activations' terms, and any other second-order term):
the building block of block-diagonal Newton and conjugate-gradient methods. Code written
against BackPACK runs with the import changed (``leanprop.compat.backpack`` instead of
``backpack``); inside the block, ``loss.backward()`` keeps the forward's graph for the products.
The first layer's products are checked against autograd's Hessian-vector products (float64).

Run: python examples/backpack_hmp.py
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
    with backpack(extensions.HMP()):
        loss.backward()

    for name, p in model.named_parameters():
        v = torch.randn(4, *p.shape, dtype=p.dtype)  # 4 vectors at once
        print(f"{name:10s} hmp(v) {tuple(p.hmp(v).shape)}")

    # the first layer's weight: autograd's Hessian-vector product of the loss
    w = model[1].weight
    v = torch.randn(1, *w.shape, dtype=w.dtype)

    def loss_of(weight: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(torch.nn.functional.linear(x.flatten(1), weight, model[1].bias))
        return torch.nn.functional.cross_entropy(model[3](h), y)

    _, hv = torch.autograd.functional.hvp(loss_of, w.detach(), v[0])
    error = (w.hmp(v)[0] - hv).abs().max().item()
    print(f"largest difference to autograd's Hessian-vector product: {error:.1e}")
    return error


if __name__ == "__main__":
    main()
