"""Real-model patterns written out (no torchvision/timm: they would replace the CPU torch).

Each builder returns ``(model, per_sample_losses, options)``: ``per_sample_losses()`` runs one
batch forward and returns the losses ``[N]`` of the samples; ``options`` go to ``per_sample``.
Models are in training mode with their usual dropout / drop-path, so the oracle is
:func:`leanprop.testing.individual_gradients_of_losses` on that same forward. Sequence length
or token count equals the batch size N wherever the model has one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

N = 5
Built = tuple[nn.Module, Callable[[], Tensor], dict[str, Any]]
ZOO: dict[str, Callable[[], Built]] = {}


def model(fn: Callable[[], Built]) -> Callable[[], Built]:
    ZOO[fn.__name__] = fn
    return fn


def per_sample_sq(out: Tensor, batch_dim: int = 0) -> Tensor:
    """``[N]``: each sample's sum of squares of the output."""
    out = out.movedim(batch_dim, 0)
    return out.reshape(out.shape[0], -1).square().sum(1)


# ------------------------------------------------------------------ vision (timm-style)
class DropPath(nn.Module):
    """Stochastic depth: whole residual branches dropped per sample."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, drop: float) -> None:
        super().__init__()
        self.heads, self.drop = heads, drop
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = self.drop if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 2, drop: float = 0.1) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, drop)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(drop), nn.Linear(2 * dim, dim)
        )
        self.ls1, self.ls2 = LayerScale(dim), LayerScale(dim)
        self.drop_path = DropPath(0.3)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


class ViT(nn.Module):
    """timm's VisionTransformer layout: cls_token and pos_embed owned by the model itself."""

    def __init__(self, dim: int = 8, patch: int = 2, image: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, dim) * 0.1)
        self.pos_drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(Block(dim), Block(dim))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, img: Tensor) -> Tensor:
        x = self.patch_embed(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        return self.head(self.norm(self.blocks(x))[:, 0])


@model
def vit_timm_style() -> Built:
    m = ViT()  # 4 patches + cls token = 5 tokens == N
    img, y = torch.randn(N, 3, 4, 4), torch.randint(0, 3, (N,))
    return m, lambda: F.cross_entropy(m(img), y, reduction="none"), {}


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1, self.pw2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))
        self.drop_path = DropPath(0.3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.dwconv(x).permute(0, 2, 3, 1)  # channels last
        h = self.gamma * self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + self.drop_path(h.permute(0, 3, 1, 2))


@model
def convnext_blocks() -> Built:
    m = nn.Sequential(ConvNeXtBlock(4), ConvNeXtBlock(4))
    x = torch.randn(N, 4, N, N)  # H == W == N
    return m, lambda: per_sample_sq(m(x)), {}


class GRN(nn.Module):
    """ConvNeXt V2's global response normalisation (channels last): a vector norm over the
    positions, divided by its mean over the channels (HF's ``ConvNextV2GRN``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1, 1, 1, dim), 0.3))
        self.bias = nn.Parameter(torch.full((1, 1, 1, dim), 0.1))

    def forward(self, h: Tensor) -> Tensor:  # [N, H, W, C]
        g = torch.linalg.vector_norm(h, ord=2, dim=(1, 2), keepdim=True)
        return self.weight * (h * (g / (g.mean(dim=-1, keepdim=True) + 1e-6))) + self.bias + h


@model
def convnext_v2_grn() -> Built:
    m = nn.Sequential(nn.Conv2d(3, 4, 2), Permuted(GRN(4)), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(N, 3, N, N)  # H == W == N
    m(x)
    return m, lambda: per_sample_sq(m(x)), {}


class Permuted(nn.Module):
    """``inner`` on channels-last ``[N, H, W, C]``, back to ``[N, C, H, W]``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ResBlock(nn.Module):
    def __init__(self, c: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.n1, self.n2 = norm(c), norm(c)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x + self.n2(self.conv2(F.relu(self.n1(self.conv1(x))))))


def _resnet(norm: Callable[[int], nn.Module]) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), norm(4), nn.ReLU(), ResBlock(4, norm),
        ResBlock(4, norm), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )  # fmt: skip


@model
def resnet_groupnorm() -> Built:
    m = _resnet(lambda c: nn.GroupNorm(2, c))
    x, y = torch.randn(N, 3, 8, 8), torch.randint(0, 3, (N,))
    return m, lambda: F.cross_entropy(m(x), y, reduction="none"), {}


@model
def resnet_batchnorm_eval() -> Built:
    m = _resnet(nn.BatchNorm2d)
    for bn in m.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
            bn.eval()
    x, y = torch.randn(N, 3, 8, 8), torch.randint(0, 3, (N,))
    return m, lambda: F.cross_entropy(m(x), y, reduction="none"), {}


class LinearBatchNormOnTokens(nn.Module):
    """HF LeViT's ``MLPLayerWithBN``: an eval-mode BatchNorm1d on the tokens flattened with
    the samples, ``[N*T, C]`` (an affine map of each row's channels)."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.linear, self.batch_norm = nn.Linear(i, o, bias=False), nn.BatchNorm1d(o)
        self.batch_norm.running_mean.uniform_(-0.5, 0.5)
        self.batch_norm.running_var.uniform_(0.5, 1.5)
        self.batch_norm.eval()

    def forward(self, h: Tensor) -> Tensor:  # [N, T, i]
        h = self.linear(h)
        return self.batch_norm(h.flatten(0, 1)).reshape_as(h)


@model
def levit_batchnorm_on_tokens_eval() -> Built:
    m = nn.Sequential(LinearBatchNormOnTokens(4, 6), nn.GELU(), LinearBatchNormOnTokens(6, 3))
    x = torch.randn(N, N, 4)  # T == N
    return m, lambda: per_sample_sq(m(x)), {}


class InPlaceAfterLayers(nn.Module):
    """Results changed in place right after the layer that made them, each accepted by plain
    autograd: an embedding's output scaled in place; ``h += x`` and ``ReLU(inplace=True)``
    after a Linear on ``[N, T, D]`` (whose output is a view); the residual added in place to
    an eval-mode BatchNorm's output (HF ResNet's blocks)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(7, d), nn.Linear(d, d)
        self.conv, self.bn = nn.Conv1d(d, d, 1), nn.BatchNorm1d(d)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 1.5)
        self.bn.eval()
        self.head = nn.Linear(d, 3)

    def forward(self, ids: Tensor) -> Tensor:  # [N, T]
        h = self.emb(ids)
        h.mul_(2.0)
        z = self.lin(h)
        z += h
        z = F.relu(z, inplace=True)
        c = self.bn(self.conv(z.transpose(1, 2)))  # [N, D, T]
        c += z.transpose(1, 2)
        return self.head(c.mean(-1))


@model
def in_place_after_layers() -> Built:
    m = InPlaceAfterLayers()
    ids = torch.randint(0, 7, (N, N))
    return m, lambda: per_sample_sq(m(ids)), {}


class MaskedSteps(nn.Module):
    """Wav2Vec2's SpecAugment: the time steps a mask picks take a learned embedding, written
    in place (``h[mask] = embedding``)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(3, d), nn.Linear(d, 2)
        self.masked = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # x [N, T, 3], mask [N, T]
        h = self.proj(x)
        h[mask] = self.masked.to(h.dtype)
        return self.head(torch.tanh(h))


@model
def masked_steps_filled_with_a_parameter() -> Built:
    m = MaskedSteps()
    x, mask = torch.randn(N, N, 3), torch.rand(N, N) < 0.4
    mask[0] = False  # (a sample with none)
    return m, lambda: per_sample_sq(m(x, mask)), {}


class VectorQuantiser(nn.Module):
    """VQ-VAE's bottleneck: each step's code is its nearest codebook row (``cdist`` between
    the steps and the codebook, T == N), passed on straight through; the codebook and
    commitment terms added to each sample's loss."""

    def __init__(self, d: int = 4, codes: int = 6) -> None:
        super().__init__()
        self.enc, self.dec = nn.Conv1d(3, d, 3, padding=1), nn.Linear(d, 3)
        self.codebook = nn.Parameter(torch.randn(codes, d))

    def forward(self, x: Tensor) -> Tensor:  # x [N, 3, T] -> each sample's loss [N]
        z = self.enc(x).transpose(1, 2)  # [N, T, d]
        q = self.codebook[torch.cdist(z, self.codebook).argmin(-1)]
        side = (q - z.detach()).square() + 0.25 * (z - q.detach()).square()
        out = self.dec(z + (q - z).detach())
        return per_sample_sq(out) + side.flatten(1).sum(1)


@model
def vector_quantiser() -> Built:
    m = VectorQuantiser()
    x = torch.randn(N, 3, N)
    return m, lambda: m(x), {}


class _TokensGroupNorm(nn.Module):
    """GroupNorm over tokens turned to channels: ``[N, T, C] -> [N, C, T]``, a transposed
    (non-contiguous) input, as in audio and time-series models."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(3, 6), nn.GroupNorm(3, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.lin(x).transpose(1, 2))


@model
def groupnorm_transposed_input() -> Built:
    m = _TokensGroupNorm()
    x = torch.randn(N, N, 3)  # T == N
    return m, lambda: per_sample_sq(m(x)), {}


@model
def groupnorm_channels_last() -> Built:
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Flatten())
    m = m.to(memory_format=torch.channels_last)
    x = torch.randn(N, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    return m, lambda: per_sample_sq(m(x)), {}


class InvertedResidual(nn.Module):
    """MobileNetV2: pointwise expand, depthwise (strided), pointwise project."""

    def __init__(self, c: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, 4 * c, 1), nn.GroupNorm(1, 4 * c), nn.ReLU6(),
            nn.Conv2d(4 * c, 4 * c, 3, stride, 1, groups=4 * c), nn.ReLU6(),
            nn.Conv2d(4 * c, c, 1, bias=False),
        )  # fmt: skip
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        return x + h if self.stride == 1 else h


@model
def mobilenet_blocks() -> Built:
    m = nn.Sequential(InvertedResidual(3, 1), InvertedResidual(3, 2), nn.Flatten())
    x = torch.randn(N, 3, 6, 6)
    return m, lambda: per_sample_sq(m(x)), {}


class SpatialTransformer(nn.Module):
    """A spatial transformer network: a localisation net regresses each sample's affine
    transform, ``affine_grid`` makes its sampling grid, ``grid_sample`` warps the input."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 6))
        self.head = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(50, 3))

    def forward(self, x: Tensor) -> Tensor:  # [N, 1, N, N]
        theta = self.loc(x).view(-1, 2, 3) + torch.eye(2, 3, dtype=x.dtype)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.head(F.grid_sample(x, grid, align_corners=False))


@model
def spatial_transformer() -> Built:
    m = SpatialTransformer()
    x = torch.randn(N, 1, N, N)  # H == W == N
    return m, lambda: per_sample_sq(m(x)), {}


class ModulatedConv(nn.Module):
    """StyleGAN2's modulated convolution: each sample's weight scaled by its style and
    demodulated, all samples in one grouped convolution over ``[1, N*C, H, W]``."""

    def __init__(self, c: int = 2, o: int = 3, w: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, c, 3, 3))
        self.affine = nn.Linear(w, c)

    def forward(self, x: Tensor, style: Tensor) -> Tensor:  # [N, C, H, W], [N, W]
        n, c, h, w = x.shape
        weight = self.weight[None] * self.affine(style)[:, None, :, None, None]  # [N, O, C, 3, 3]
        weight = weight * (weight.square().sum((2, 3, 4), keepdim=True) + 1e-8).rsqrt()
        out = F.conv2d(x.reshape(1, n * c, h, w), weight.reshape(-1, c, 3, 3), padding=1, groups=n)
        return out.view(n, -1, h, w)


@model
def stylegan2_modulated_conv() -> Built:
    m = ModulatedConv()
    x, style = torch.randn(N, 2, N, N), torch.randn(N, 4)  # H == W == N
    return m, lambda: per_sample_sq(m(x, style)), {}


class PoolsWithIndices(nn.Module):
    """SegNet's decoder unpools at the encoder's max positions; fractional max pooling
    (random windows per sample and channel), adaptive max pooling with its indices, and
    power-average pooling over a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Conv2d(1, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
        self.frac = nn.FractionalMaxPool2d(2, output_size=3)
        self.seq = nn.Conv1d(2, 2, 1)
        self.head = nn.Linear(2 * 9 + 2 * 4 + 2 * 2 + 2 * 2, 2)

    def forward(self, x: Tensor) -> Tensor:  # [N, 1, 6, 6]
        h, where = F.max_pool2d(self.enc(x), 2, return_indices=True)  # [N, 2, 3, 3]
        up = self.dec(F.max_unpool2d(h, where, 2))  # [N, 2, 6, 6]
        frac = self.frac(up)  # [N, 2, 3, 3]
        top, _ = F.adaptive_max_pool2d(up, 2, return_indices=True)  # [N, 2, 2, 2]
        seq = self.seq(up.flatten(2)[..., :N])  # [N, 2, T], T == N
        power = F.lp_pool1d(seq, 2, 2)  # [N, 2, 2]
        one, at = F.max_pool1d(seq, 2, return_indices=True)  # [N, 2, 2]
        back = F.max_unpool1d(one, at, 2, output_size=[4])  # [N, 2, 4]
        parts = (frac, top, power, back[..., :2])
        return self.head(torch.cat([t.flatten(1) for t in parts], 1))


@model
def pools_with_indices() -> Built:
    m = PoolsWithIndices()
    x = torch.randn(N, 1, 6, 6)
    return m, lambda: per_sample_sq(m(x)), {}


class StackedFeatures(nn.Module):
    """Features put side by side by numpy-style stacking (``column_stack`` of per-sample
    scalars, ``hstack`` of feature matrices, ``atleast_2d``), a polynomial basis of a
    per-sample score (``linalg.vander``) and a softmax left to its legacy dimension
    (``F.softmax(x)`` on ``[N, K]``: over K)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, N), nn.Linear(3, N)  # (N features: D == N)
        self.score = nn.Linear(3, 1)
        self.head = nn.Linear(2 * N + 2 + 3, N)

    def forward(self, x: Tensor) -> Tensor:  # [N, 3]
        s = self.score(x)[:, 0]  # [N]
        scalars = torch.column_stack([s, s.tanh()])  # [N, 2]
        feats = torch.hstack([self.a(x), torch.atleast_2d(self.b(x))])  # [N, 2N]
        basis = torch.linalg.vander(s.tanh().to(x.dtype), N=3)  # [N, 3] (no bf16 kernel)
        h = self.head(torch.hstack([feats, scalars, basis]))
        with warnings.catch_warnings():  # (torch: an implicit dimension is deprecated)
            warnings.simplefilter("ignore", UserWarning)
            return F.softmax(h) * h


@model
def stacked_features() -> Built:
    m = StackedFeatures()
    x = torch.randn(N, 3)
    return m, lambda: per_sample_sq(m(x)), {}


class FunctionalLayers(nn.Module):
    """Parameters used through functions in the model's own forward (closed forms in
    op_rules.py): F.linear, x @ W, addmm on flattened samples, W.t() (parameter-derived)."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(dim, dim)), nn.Parameter(torch.randn(dim))
        self.w2 = nn.Parameter(torch.randn(dim, dim))
        self.w3, self.b3 = nn.Parameter(torch.randn(dim, dim)), nn.Parameter(torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:  # x [N, T, D]
        h = torch.tanh(F.linear(x, self.w1, self.b1))
        h = torch.tanh(h @ self.w2)
        h = torch.addmm(self.b3, h.reshape(-1, h.shape[-1]), self.w3).view_as(h)
        return torch.tanh(h) @ self.w1.t()


@model
def functional_layers() -> Built:
    m = FunctionalLayers()
    x = torch.randn(N, N, 4)
    return m, lambda: per_sample_sq(m(x)), {}


# ------------------------------------------------------------------ sequence models
@model
def transformer_encoder_sequence_first() -> Built:
    layer = nn.TransformerEncoderLayer(8, 2, 16)  # defaults: dropout 0.1, batch_first=False
    m = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(N, N, 8)  # [T, N, D], T == N
    pad = torch.zeros(N, N, dtype=torch.bool)
    pad[0, -2:] = True
    options = {"batch_dim": 1, "batch_dims": {"src_key_padding_mask": 0}}
    return m, lambda: per_sample_sq(m(x, src_key_padding_mask=pad), 1), options


@model
def transformer_encoder_batch_first() -> Built:
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, norm_first=True)
    m = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(N, N, 8)
    return m, lambda: per_sample_sq(m(x)), {}


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 11, block: int = 8, dim: int = 8) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(Block(dim))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        return self.head(self.ln(self.blocks(x)))


class ShiftedDecoderIds(nn.Module):
    """A decoder's input ids made as HF's ``shift_tokens_right`` makes them (BART, T5,
    Whisper): written into a fresh tensor by slice assignment, then filled in place. The ids
    carried no batch: no quantities at all (none, silently, with ``check=False``)."""

    def __init__(self, vocab: int = 11, dim: int = 4) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, ids: Tensor) -> Tensor:  # [N, T]
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 2
        shifted.masked_fill_(shifted == -100, 1)
        return self.head(torch.tanh(self.emb(shifted)))


@model
def shifted_decoder_ids() -> Built:
    m = ShiftedDecoderIds()
    x = torch.randint(0, 11, (N, N))
    return m, lambda: token_losses(m(x), x), {}


class StepsIntoABuffer(nn.Module):
    """A recurrent cell's states written step by step into a preallocated buffer, by
    assignment and by ``copy_`` into its views: the buffer carried no batch."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.inp, self.rec, self.head = nn.Linear(3, d), nn.Linear(d, d), nn.Linear(2 * d, 2)

    def forward(self, x: Tensor) -> Tensor:  # [N, T, 3]
        n, t, _ = x.shape
        d = self.rec.in_features
        h = x.new_zeros(n, d)
        out = x.new_zeros(n, t, 2 * d)
        for s in range(t):
            h = torch.tanh(self.inp(x[:, s]) + self.rec(h))
            out[:, s, :d] = h
            out[:, s, d:].copy_(h.square())
        return self.head(out).sum(1)


@model
def steps_into_a_buffer() -> Built:
    m = StepsIntoABuffer()
    x = torch.randn(N, N, 3)
    return m, lambda: per_sample_sq(m(x)), {}


class Cells(nn.Module):
    """``nn.RNNCell``, ``nn.GRUCell`` and ``nn.LSTMCell`` stepped over time (a decoder's loop):
    their ops lost the batch (an error at the head)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.rnn, self.gru, self.lstm = nn.RNNCell(3, d), nn.GRUCell(d, d), nn.LSTMCell(d, d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: Tensor) -> Tensor:  # [N, T, 3]
        h = g = state = None
        for s in range(x.shape[1]):
            h = self.rnn(x[:, s], h)
            g = self.gru(h, g)
            state = self.lstm(g, state)
        return self.head(state[0])


class Bilinear(nn.Module):
    """``nn.Bilinear`` of two views of each sample, on ``[N, T, I]``: its op was unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bil = nn.Linear(3, 4), nn.Bilinear(4, 3, 2)

    def forward(self, x: Tensor) -> Tensor:  # [N, T, 3]
        return self.bil(torch.tanh(self.inp(x)), x)


def bilinear_of_two_views() -> Built:  # (not in ZOO: torch's bilinear has no autocast rule)
    m = Bilinear()
    x = torch.randn(N, N, 3)
    return m, lambda: per_sample_sq(m(x)), {}


@model
def rnn_cells_stepped() -> Built:
    m = Cells()
    x = torch.randn(N, N, 3)
    return m, lambda: per_sample_sq(m(x)), {}


class ComplexRotaryLlama(nn.Module):
    """A decoder block as Meta's reference Llama writes it: RMSNorm, rotary embeddings in
    complex form (``view_as_complex`` of feature pairs times ``freqs_cis``, ``view_as_real``
    back), causal attention, a SwiGLU MLP. Its complex views were unknown to the tracker (an
    error at the attention's output projection)."""

    def __init__(self, vocab: int = 11, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.emb = nn.Embedding(vocab, dim)
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, 12, bias=False), nn.Linear(dim, 12, bias=False)
        self.w2, self.head = nn.Linear(12, dim, bias=False), nn.Linear(dim, vocab, bias=False)
        freqs = 1.0 / 10000.0 ** (torch.arange(0, self.hd, 2).double() / self.hd)
        angles = torch.outer(torch.arange(32, dtype=torch.float64), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def _rotary(self, x: Tensor) -> Tensor:  # [N, T, H, hd]
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # (Meta's .float())
        pairs = torch.view_as_complex(wide.reshape(*x.shape[:-1], -1, 2))
        turns = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, pairs.shape[-1])
        return torch.view_as_real(pairs * turns).flatten(3).type_as(x)

    def forward(self, ids: Tensor) -> Tensor:  # [N, T]
        h = self.emb(ids)
        n, t, d = h.shape
        a = self.norm1(h)
        q = self._rotary(self.wq(a).view(n, t, self.heads, self.hd)).transpose(1, 2)
        k = self._rotary(self.wk(a).view(n, t, self.heads, self.hd)).transpose(1, 2)
        v = self.wv(a).view(n, t, self.heads, self.hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.wo(att.transpose(1, 2).reshape(n, t, d))
        b = self.norm2(h)
        h = h + self.w2(F.silu(self.w1(b)) * self.w3(b))
        return self.head(h)


@model
def llama_complex_rotary() -> Built:
    m = ComplexRotaryLlama()
    x, y = torch.randint(0, 11, (N, N)), torch.randint(0, 11, (N, N))
    return m, lambda: token_losses(m(x), y), {}


def token_losses(logits: Tensor, y: Tensor) -> Tensor:
    """``[N]``: each sample's summed token cross-entropy."""
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return ce.view(y.shape).sum(1)


@model
def nanogpt() -> Built:
    m = NanoGPT()
    x, y = torch.randint(0, 11, (N, N)), torch.randint(0, 11, (N, N))
    return m, lambda: token_losses(m(x), y), {}


def zero_state(rnn: nn.RNNBase, n: int, like: Tensor) -> Tensor | tuple[Tensor, Tensor]:
    """The usual explicit initial state: zeros ``[layers * directions, N, H]`` made in the
    model's forward (batch-free: no sample reaches it)."""
    h = like.new_zeros(rnn.num_layers * (2 if rnn.bidirectional else 1), n, rnn.hidden_size)
    return (h, h.clone()) if isinstance(rnn, nn.LSTM) else h


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase], batch_first: bool, zeros: bool = False) -> None:
        super().__init__()
        self.rnn = cell(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(8, 2)
        self.batch_first, self.zeros = batch_first, zeros

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0 if self.batch_first else 1]
        h, _ = self.rnn(x, zero_state(self.rnn, n, x) if self.zeros else None)
        return self.head(h if self.batch_first else h.transpose(0, 1))


@model
def lstm_bidirectional_sequence_first() -> Built:
    m = Recurrent(nn.LSTM, batch_first=False)
    x = torch.randn(N, N, 3)
    return m, lambda: per_sample_sq(m(x)), {"batch_dim": 1}


@model
def gru_bidirectional_batch_first() -> Built:
    m = Recurrent(nn.GRU, batch_first=True)
    x = torch.randn(N, N, 3)
    return m, lambda: per_sample_sq(m(x)), {}


@model
def lstm_zero_initial_state_sequence_first() -> Built:
    m = Recurrent(nn.LSTM, batch_first=False, zeros=True)
    x = torch.randn(N, N, 3)
    return m, lambda: per_sample_sq(m(x)), {"batch_dim": 1}


class LookedUpEmbeddings(nn.Module):
    """Embeddings looked up with batch-free ids: positions [1, T] with a padding row among
    them, and types from a buffer expanded to [N, T] (HF BERT's token types), tied with a
    functional lookup of the same table."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(7, dim)
        self.pos = nn.Embedding(N + 1, dim, padding_idx=2)
        self.types = nn.Embedding(3, dim)
        self.register_buffer("type_ids", torch.tensor([0, 1, 2, 1, 0][:N]).repeat(1, 1))

    def forward(self, idx: Tensor) -> Tensor:  # idx [N, T], T == N
        pos = torch.arange(idx.shape[1], device=idx.device)[None]  # includes the padding row
        types = self.type_ids.expand(idx.shape[0], idx.shape[1])
        h = self.tok(idx) + self.pos(pos) + self.types(types)
        return h * F.embedding(pos[0], self.pos.weight, padding_idx=2).sum(0)


@model
def looked_up_embeddings() -> Built:
    m = LookedUpEmbeddings()
    idx = torch.randint(0, 7, (N, N))
    return m, lambda: per_sample_sq(m(idx)), {}


LENGTHS = [3, N, 1, N, 2]  # unsorted, repeated, and the longest as long as the batch


class PackedClassifier(nn.Module):
    """Packs padded input by its lengths inside the model; classifies from the final states
    (optionally starting from explicit zero states)."""

    def __init__(self, cell: type[nn.RNNBase], batch_first: bool, zeros: bool = False) -> None:
        super().__init__()
        self.rnn = cell(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(8, 2)
        self.batch_first, self.zeros = batch_first, zeros

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=self.batch_first, enforce_sorted=False
        )
        n = x.shape[0 if self.batch_first else 1]
        _, hidden = self.rnn(packed, zero_state(self.rnn, n, x) if self.zeros else None)
        h_n = hidden[0] if isinstance(hidden, tuple) else hidden  # [layers * 2, N, 4]
        return self.head(torch.cat([h_n[-2], h_n[-1]], dim=1))


@model
def lstm_packed_classifier_batch_first() -> Built:
    m = PackedClassifier(nn.LSTM, batch_first=True)
    x, lengths = torch.randn(N, N, 3), torch.tensor(LENGTHS)
    return m, lambda: per_sample_sq(m(x, lengths)), {}


@model
def gru_packed_zero_initial_state() -> Built:
    m = PackedClassifier(nn.GRU, batch_first=True, zeros=True)
    x, lengths = torch.randn(N, N, 3), torch.tensor(LENGTHS)
    return m, lambda: per_sample_sq(m(x, lengths)), {}


@model
def lstm_packed_zero_initial_state_sequence_first() -> Built:
    m = PackedClassifier(nn.LSTM, batch_first=False, zeros=True)
    x, lengths = torch.randn(N, N, 3), torch.tensor(LENGTHS)
    return m, lambda: per_sample_sq(m(x, lengths)), {"batch_dims": {0: 1}}


@model
def gru_packed_classifier_sequence_first() -> Built:
    m = PackedClassifier(nn.GRU, batch_first=False)
    x, lengths = torch.randn(N, N, 3), torch.tensor(LENGTHS)
    return m, lambda: per_sample_sq(m(x, lengths)), {"batch_dims": {0: 1}}


class PackedTagger(nn.Module):
    """Takes a PackedSequence; tags every time step of the padded-back output."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True, proj_size=2)
        self.head = nn.Linear(2, 3)

    def forward(self, packed: nn.utils.rnn.PackedSequence, h0: tuple[Tensor, Tensor]) -> Tensor:
        out, _ = self.rnn(packed, h0)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(padded)  # [N, T, 3], zeros past each length but the bias


@model
def lstm_packed_input_tagger() -> Built:
    m = PackedTagger()
    seqs = [torch.randn(k, 3) for k in LENGTHS]
    h0 = (torch.randn(1, N, 2), torch.randn(1, N, 4))

    def losses() -> Tensor:
        packed = nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
        out = m(packed, h0)
        mask = torch.arange(N)[None, :] < torch.tensor(LENGTHS)[:, None]
        return (out.square().sum(2) * mask).sum(1)

    return m, losses, {"batch_dims": {1: 1}}


class PackedSortedPooled(nn.Module):
    """Sorted lengths (enforce_sorted=True), padded back; mean-pooled with a mask built from
    the lengths pad_packed_sequence returns."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        out, lens = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        mask = torch.arange(out.shape[1])[None, :] < lens[:, None]
        return self.head((out * mask[..., None]).sum(1) / lens[:, None])


@model
def gru_packed_sorted_pooled() -> Built:
    m = PackedSortedPooled()
    x, lengths = torch.randn(N, N, 3), torch.tensor(sorted(LENGTHS, reverse=True))
    return m, lambda: per_sample_sq(m(x, lengths)), {}


@model
def embedding_bag_with_offsets() -> Built:
    bag = nn.EmbeddingBag(10, 4, mode="mean")
    head = nn.Linear(4, 2)
    m = nn.ModuleDict({"bag": bag, "head": head})
    idx = torch.randint(0, 10, (12,))
    offsets = torch.tensor([0, 2, 5, 6, 9])

    class Bags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, idx: Tensor, offsets: Tensor) -> Tensor:
            return self.m["head"](self.m["bag"](idx, offsets))

    model_ = Bags()
    return model_, lambda: per_sample_sq(model_(idx, offsets)), {"batch_dims": {0: None}}


class WeightedBags(nn.Module):
    """``nn.EmbeddingBag`` whose ids are weighed by a function of each sample's features
    (``per_sample_weights``, passed by keyword); bags of ``[N, L]`` ids, L == N."""

    def __init__(self) -> None:
        super().__init__()
        self.bag, self.weigh = nn.EmbeddingBag(10, 3, mode="sum"), nn.Linear(2, 1)
        self.head = nn.Linear(3, 2)

    def forward(self, ids: Tensor, feats: Tensor) -> Tensor:  # [N, L], [N, L, 2]
        weights = torch.sigmoid(self.weigh(feats)).squeeze(-1)  # [N, L]
        weights = weights.to(self.bag.weight.dtype)  # (under autocast: torch wants the table's)
        return self.head(self.bag(ids, per_sample_weights=weights))


@model
def embedding_bag_weighted() -> Built:
    m = WeightedBags()
    ids, feats = torch.randint(0, 10, (N, N)), torch.randn(N, N, 2)
    return m, lambda: per_sample_sq(m(ids, feats)), {}


# ------------------------------------------------------------------ HF transformers
def _hf_causal(config_cls: Any, model_cls: Any, **config: Any) -> Built:
    m = model_cls(config_cls(**config))
    ids = torch.randint(0, config["vocab_size"], (N, N))
    mask = torch.ones(N, N, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    return m, lambda: token_losses(m(input_ids=ids, attention_mask=mask).logits, ids), {}


def hf_models() -> dict[str, Callable[[], Built]]:
    import transformers as tf

    def gpt2() -> Built:
        return _hf_causal(
            tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=30, n_positions=16, n_embd=8,
            n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip

    def gpt2_wide() -> Built:  # wide enough for the Gram form of the norms (T == N)
        return _hf_causal(
            tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=30, n_positions=16, n_embd=64,
            n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip

    def llama() -> Built:
        return _hf_causal(
            tf.LlamaConfig, tf.LlamaForCausalLM, vocab_size=30, hidden_size=8,
            intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, attention_dropout=0.1,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip

    def bert() -> Built:
        cfg = tf.BertConfig(
            vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=16, max_position_embeddings=16,
        )  # fmt: skip
        m = tf.BertForSequenceClassification(cfg)
        ids, labels = torch.randint(0, 30, (N, N)), torch.randint(0, 2, (N,))
        mask = torch.ones(N, N, dtype=torch.long)
        mask[0, -2:] = 0

        def losses() -> Tensor:
            logits = m(input_ids=ids, attention_mask=mask).logits
            return F.cross_entropy(logits, labels, reduction="none")

        return m, losses, {}

    def vit() -> Built:
        cfg = tf.ViTConfig(
            image_size=4, patch_size=2, num_channels=3, hidden_size=8, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=16, num_labels=3,
            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
        )  # fmt: skip
        m = tf.ViTForImageClassification(cfg)
        img, y = torch.randn(N, 3, 4, 4), torch.randint(0, 3, (N,))
        return m, lambda: F.cross_entropy(m(pixel_values=img).logits, y, reduction="none"), {}

    def bart() -> Built:  # encoder-decoder; its key projections' biases get no gradient
        cfg = tf.BartConfig(
            vocab_size=30, d_model=8, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
            decoder_ffn_dim=16, max_position_embeddings=16, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        )  # fmt: skip
        m = tf.BartForConditionalGeneration(cfg)
        ids = torch.randint(3, 30, (N, N))
        return m, lambda: token_losses(m(input_ids=ids, labels=ids).logits, ids), {}

    def bart_classifier() -> Built:  # each sample's end-of-sentence token by a boolean mask
        cfg = tf.BartConfig(
            vocab_size=30, d_model=8, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
            decoder_ffn_dim=16, max_position_embeddings=16, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, num_labels=3,
        )  # fmt: skip
        m = tf.BartForSequenceClassification(cfg)
        ids, y = torch.randint(3, 30, (N, N)), torch.randint(0, 3, (N,))
        ids[:, -1] = 2
        return m, lambda: F.cross_entropy(m(input_ids=ids).logits, y, reduction="none"), {}

    def bloom() -> Built:  # ALiBi added by alibi.baddbmm(batch1=q, batch2=k)
        # (no padding: a padded row's scores are all masked in its eager attention, NaN)
        m = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=30, hidden_size=8, n_layer=1, n_head=2))
        ids = torch.randint(0, 30, (N, N))
        return m, lambda: token_losses(m(input_ids=ids).logits, ids), {}

    def falcon() -> Built:  # multi-query attention, its heads split by x[..., [-2], :]
        return _hf_causal(
            tf.FalconConfig, tf.FalconForCausalLM, vocab_size=30, hidden_size=8,
            num_hidden_layers=2, num_attention_heads=2,
        )  # fmt: skip

    def wav2vec2() -> Built:  # SpecAugment: masked time steps take a learned embedding
        cfg = tf.Wav2Vec2Config(
            vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=16, conv_dim=(4, 4), conv_stride=(2, 2), conv_kernel=(3, 3),
            num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
            num_feat_extract_layers=2, feat_extract_norm="group", mask_time_prob=0.5,
            mask_time_length=2, mask_feature_prob=0.3, mask_feature_length=2,
        )  # fmt: skip
        m = tf.Wav2Vec2ForSequenceClassification(cfg)
        audio, y = torch.randn(N, 60), torch.randint(0, 2, (N,))
        return m, lambda: F.cross_entropy(m(input_values=audio).logits, y, reduction="none"), {}

    def t5() -> Built:  # decoder ids by _shift_right; relative position bias; tied head
        cfg = tf.T5Config(
            vocab_size=30, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
            relative_attention_num_buckets=4, decoder_start_token_id=0,
        )  # fmt: skip
        m = tf.T5ForConditionalGeneration(cfg)
        ids = torch.randint(1, 30, (N, N))
        return m, lambda: token_losses(m(input_ids=ids, labels=ids).logits, ids), {}

    return {
        "hf_gpt2": gpt2, "hf_gpt2_wide": gpt2_wide, "hf_llama": llama, "hf_bert": bert,
        "hf_vit": vit, "hf_bart": bart, "hf_bart_classifier": bart_classifier,
        "hf_bloom": bloom, "hf_falcon": falcon, "hf_wav2vec2": wav2vec2, "hf_t5": t5,
    }  # fmt: skip
