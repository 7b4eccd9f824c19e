"""Kronecker factors of the GGN's blocks (KFLR: exact, KFAC: Monte-Carlo), as BackPACK
defines them, from the layers' inputs and their output gradients in the curvature passes.

For a linear layer on ``[N, I]`` inputs ``a_n`` whose output gets the factor columns' output
gradients ``v_mn`` ``[O]`` (one per backward pass m): weight ``[B, A]`` with
``B = sum_{m,n} v_mn v_mn^T`` ``[O, O]`` and ``A = 1/N sum_n a_n a_n^T`` ``[I, I]``; bias
``[B]``. For a convolution (``groups=1``): ``B`` from the output gradients summed over the
output positions ``[C_out, C_out]``, ``A`` from the unfolded input summed over positions and
averaged over samples ``[C_in k..., C_in k...]``. With one sample ``B ⊗ A`` is the weight's GGN
block exactly.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F

from ...errors import UnsupportedModelError

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def patches(module: nn.Conv1d | nn.Conv2d | nn.Conv3d, x: Tensor) -> Tensor:
    """The input's im2col patches with the samples and positions together,
    ``[C_in * prod(k), N * positions]`` (the patch elements in the weight's order): one copy
    of a padded, strided view of ``x``, laid out for one matrix product over samples and
    positions at once (``F.unfold``'s ``[N, K, L]`` needs another copy or a slower
    contraction over two dimensions)."""
    d = x.dim() - 2
    k, s, p, dil = module.kernel_size, module.stride, module.padding, module.dilation
    x = F.pad(x, [q for i in reversed(range(d)) for q in (p[i], p[i])])
    for i in range(d):
        x = x.unfold(2 + i, dil[i] * (k[i] - 1) + 1, s[i])[..., :: dil[i]]
    # x: [N, C, *positions, *k] -> [C, *k, N, *positions]
    x = x.permute(1, *range(2 + d, 2 + 2 * d), 0, *range(2, 2 + d))
    return x.reshape(x.shape[0] * math.prod(k), -1)


def unsupported_conv(module: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> str | None:
    """Why a convolution's Kronecker factors are not defined (as BackPACK's), or None."""
    name = type(module).__name__
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        return (
            f"{name} with padding={module.padding!r}, padding_mode={module.padding_mode!r}; "
            "Kronecker factors are computed for explicit zero padding (padding=<int or tuple>, "
            "padding_mode='zeros')"
        )
    if module.groups != 1:
        return (
            f"{name} with groups={module.groups}; Kronecker factors are defined for groups=1 "
            "(as in BackPACK)"
        )
    return None


def input_factor(module: nn.Module, x: Tensor) -> Tensor:
    """The input-side factor ``A`` of a linear layer (``x`` ``[N, I]``: ``[I, I]``) or a
    convolution (``x`` ``[N, C_in, *S]``: ``[C_in k..., C_in k...]``), averaged over the
    samples."""
    if isinstance(module, nn.Linear):
        return (x.mT @ x).div_(x.shape[0])
    cols = patches(module, x)  # [K, N L]
    return (cols @ cols.mT).div_(x.shape[0])


def output_factor(g: Tensor) -> Tensor:
    """The output-side factor's part ``sum_n g_n g_n^T`` ``[O, O]`` of output gradients ``g``:
    a linear layer's ``[N, O]``, or a convolution's ``[N, C_out, *S]`` summed over the output
    positions first."""
    if g.dim() > 2:
        g = g.flatten(2).sum(2)  # [N, C_out]
    return g.mT @ g


class KroneckerFactors:
    """Accumulates each observed layer's ``B`` over the passes of one factor; ``A`` from the
    first pass's inputs."""

    def __init__(self, name: str) -> None:
        self.name = name  # the quantity, for errors
        self.a: dict[nn.Module, Tensor] = {}
        self.b: dict[nn.Module, Tensor] = {}
        self._pass: dict[nn.Module, int] = {}
        self.passes = 0

    def next_pass(self) -> None:
        self.passes += 1

    def observe(self, module: nn.Module, inputs: tuple[Any, ...], g: Tensor) -> None:
        """One call of ``module`` in the current pass: input ``inputs[0]`` and output gradient
        ``g``, both with the batch first."""
        if not isinstance(module, (nn.Linear, *CONVS)):
            return
        if self._pass.get(module) == self.passes:
            raise UnsupportedModelError(
                f"{self.name}: {type(module).__name__} is called more than once in the forward "
                "(shared); its Kronecker factors are not defined (as in BackPACK). Ask for the "
                "GGN diagonal or square root instead."
            )
        self._pass[module] = self.passes
        x = inputs[0]
        if isinstance(module, nn.Linear):
            if x.dim() != 2:
                raise UnsupportedModelError(
                    f"{self.name}: Linear with inputs of shape {tuple(x.shape)}; Kronecker "
                    "factors are defined for [N, in_features] inputs (as in BackPACK)."
                )
        else:
            why = unsupported_conv(module)
            if why is not None:
                raise UnsupportedModelError(f"{self.name}: {why}.")
        b = output_factor(g)
        if module not in self.a:
            self.a[module] = input_factor(module, x)
        self.b[module] = b if module not in self.b else self.b[module] + b

    def results(self) -> dict[nn.Parameter, list[Tensor]]:
        """``{weight: [B, A], bias: [B]}`` of every observed layer."""
        out: dict[nn.Parameter, list[Tensor]] = {}
        for module, b in self.b.items():
            out[module.weight] = [b, self.a[module]]
            if module.bias is not None:
                out[module.bias] = [b]
        return out
