"""BackPACK's module path ``utils.examples``: its examples' helpers.

``autograd_diag_ggn_exact`` is the GGN's diagonal by plain autograd (one GGN-vector product per
entry: an oracle for small problems). The MNIST helpers need ``torchvision`` (not a leanprop
dependency) and download the data to ``./data`` on first use, as BackPACK's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from ....errors import LeanpropError, LeanpropValueError
from ..hessianfree import ggn_vector_product
from .convert_parameters import vector_to_parameter_list


def autograd_diag_ggn_exact(
    X: Tensor, y: Tensor, model: nn.Module, loss_function: nn.Module,
    idx: Sequence[int] | Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The exact GGN's diagonal ``[len(idx)]`` (all ``P`` entries if ``idx`` is None) of
    ``loss_function(model(X), y)``, over the trainable parameters flattened and concatenated
    in ``model.parameters()``'s order, by one autograd GGN-vector product per entry."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    entries = range(total) if idx is None else [int(i) for i in idx]
    bad = [i for i in entries if not 0 <= i < total]
    if bad:
        raise LeanpropValueError(
            f"autograd_diag_ggn_exact(idx=...): entries {bad[:5]} are out of range for "
            f"{total} parameters; pass indices in [0, {total})."
        )
    outputs = model(X)
    loss = loss_function(outputs, y)
    diagonal = []
    for d in entries:
        unit = torch.zeros(total, device=loss.device, dtype=loss.dtype)
        unit[d] = 1.0
        column = ggn_vector_product(loss, outputs, model, vector_to_parameter_list(unit, params))
        diagonal.append(parameters_to_vector([c.contiguous() for c in column])[d])
    return torch.stack(diagonal) if diagonal else loss.new_zeros(0)


def _mnist() -> Any:
    try:
        from torchvision.datasets import MNIST
        from torchvision.transforms import Compose, Normalize, ToTensor
    except ImportError as e:
        raise LeanpropError(
            "the MNIST helpers of BackPACK's examples need torchvision, which leanprop does "
            "not depend on; install torchvision (the build matching your torch), or load "
            "your own batch."
        ) from e
    return MNIST(
        root="./data", train=True, download=True,
        transform=Compose([ToTensor(), Normalize((0.1307,), (0.3081,))]),
    )  # fmt: skip


def get_mnist_dataloader(batch_size: int = 64, shuffle: bool = True) -> Any:
    """MNIST's training set, normalised, as a ``DataLoader`` (needs torchvision)."""
    return torch.utils.data.DataLoader(_mnist(), batch_size=batch_size, shuffle=shuffle)


def load_one_batch_mnist(
    batch_size: int = 64, shuffle: bool = True, flat: bool = False
) -> tuple[Tensor, Tensor]:
    """One batch ``(inputs [B, 1, 28, 28] or [B, 784] if flat, labels [B])`` of MNIST."""
    x, y = next(iter(get_mnist_dataloader(batch_size, shuffle)))
    return (x.reshape(x.shape[0], -1) if flat else x), y


__all__ = ["autograd_diag_ggn_exact", "get_mnist_dataloader", "load_one_batch_mnist"]
