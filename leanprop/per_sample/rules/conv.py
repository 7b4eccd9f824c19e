"""Rule for ``nn.Conv1d/2d/3d`` (stride, padding incl. ``"same"``, padding modes, dilation, groups).

Weight ``[O, C/G, *K]``, input ``x: [N, C, *S]``, output gradient ``g: [N, O, *S']``. The
individual weight gradient of sample n is the cross-correlation of ``x_n`` with ``g_n``::

    W_n[o, c, k] = sum_s g_n[o, s] · x_pad_n[c(o), s·stride + k·dilation]

Three algorithms (``RuleOptions.conv_algorithm``), all exact:

* ``"unfold"``: gather the patches ``[N, C, S', K]`` (im2col) and contract them with ``g``;
  scratch memory ``C·K·|S'|`` per sample.
* ``"grouped"``: Rochette et al. (2019): one grouped convolution with the batch folded into
  the groups, input and gradient swapping roles and stride swapping with dilation; no patches,
  scratch memory about the size of the result.
* ``"weight_backward"``: the backend's own weight-gradient kernel (oneDNN, cuDNN) on one
  convolution whose groups are the samples; no patches either.

Which is fastest depends on the layer's shape and the backend by a factor of up to 10 either
way, so ``"auto"`` tries the algorithms whose scratch memory fits in turn on a layer shape's
first calls, timing each as it runs, and keeps the fastest (per shape, device and dtype in this
process; not while autograd records). All run over chunks of samples chosen by the caller to
bound scratch memory.

Squared norms alone (``BatchL2Grad``) of a layer with few output positions ``L`` (the late,
low-resolution layers of a CNN, which hold most of its parameters) come without ``W_n``: per
group, ``W_n = sum_s g_n[:, s] ⊗ u_n[:, s]`` (``u_n[:, s]`` the patch of output position s) is
a sum of ``L`` outer products, so ``||W_n||² = sum_{s,t} (g_s·g_t)(u_s·u_t)`` (``factors.py``'s
Gram form), used where it is cheaper than materialising ``W_n`` (the linear layer's criterion,
with ``L`` for the sequence length). The patches' Gram ``u_s·u_t = sum_k <x_{p(s)+k},
x_{p(t)+k}>`` (``p(s)``: where window s starts in the padded input, ``k`` over the kernel's
offsets) comes either from the patches themselves (im2col: a strided copy, slow where windows
are small) or, where that is no more work (stride 1: about as many input pixels as windows),
from the Gram of the padded input's pixels ``A = x_padᵀ x_pad`` ``[P, P]``, summed over the
``K`` shifted ``[L, L]`` blocks: no patches at all.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..chunks import sample_chunks
from ..factors import Outer, inner
from ..registry import RuleOptions, register_rule
from ..stats import widen
from .linear import gram_is_cheaper

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _dims(module: nn.Module) -> int:
    return len(module.kernel_size)


def _check(module: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    x, d = inputs[0], _dims(module)
    if x.dim() != d + 2:
        return (
            f"got an input of shape {tuple(x.shape)}; expected [N, {module.in_channels}, "
            f"{d} spatial dims] with the batch first (unbatched inputs have no per-sample meaning)"
        )
    return None


def _pad(module: nn.Module, x: Tensor) -> Tensor:
    """Pad ``x`` as the module's forward does, so the convolution itself has no padding."""
    if module.padding_mode != "zeros":
        return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return x
        pads: list[int] = []  # "same": the extra element goes to the end, as torch does
        for k, dil in zip(reversed(module.kernel_size), reversed(module.dilation), strict=True):
            total = dil * (k - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads)
    if any(module.padding):
        return F.pad(x, [p for p in reversed(module.padding) for _ in range(2)])
    return x


def _patches(module: nn.Module, x: Tensor) -> Tensor:
    """im2col of the (unpadded) input: ``[N, C * prod(K), L]`` (channel-major, as the weight).

    Padded once, then windowed as a strided view and copied: on CPU this is 2-7x faster than
    ``F.unfold``'s im2col kernel (which tests the padding bounds element by element)."""
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    d = len(kernel)
    x = _pad(module, x)
    n, c = x.shape[:2]
    patches = x
    for i, (k, s, dil) in enumerate(zip(kernel, stride, dilation, strict=True)):
        patches = patches.unfold(2 + i, dil * (k - 1) + 1, s)  # appends a window dim
        if dil > 1:
            patches = patches[..., ::dil]
    # patches: [N, C, *S', *K] -> [N, C, *K, *S']
    order = [0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d)]
    return patches.permute(order).reshape(n, c * math.prod(kernel), -1)


def _unfold(module: nn.Module, x: Tensor, g: Tensor, out: Tensor | None) -> Tensor:
    n, groups, o = x.shape[0], module.groups, g.shape[1]
    c_g = x.shape[1] // groups
    patches = _patches(module, x)  # [N, C*K, L], x unpadded
    u = patches.reshape(n * groups, -1, patches.shape[-1])  # [N*G, C/G*K, L]
    gs = g.reshape(n * groups, o // groups, -1)  # [N*G, O/G, L]
    if out is not None:  # write straight into the caller's buffer
        torch.bmm(gs, u.mT, out=out.view(n * groups, o // groups, -1))
        return out
    w = torch.bmm(gs, u.mT)  # [N*G, O/G, C/G*K]
    return w.reshape(n, o, c_g, *module.kernel_size)


def _grouped(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    n, groups, o = x.shape[0], module.groups, g.shape[1]
    c_g = x.shape[1] // groups
    spatial = x.shape[2:]
    # input [C/G, N*G, *S]: batch of C/G, channels (sample, group)
    inp = x.reshape(n * groups, c_g, *spatial).transpose(0, 1)
    # weight [N*O, 1, *S']: one filter per (sample, output channel)
    wgt = g.reshape(n * o, 1, *g.shape[2:])
    conv = _CONV_FN[_dims(module)]
    res = conv(inp, wgt, None, module.dilation, 0, module.stride, n * groups)  # [C/G, N*O, *K']
    res = res[(..., *(slice(0, k) for k in module.kernel_size))]
    return res.reshape(c_g, n, o, *module.kernel_size).transpose(0, 1).transpose(1, 2)


def _weight_backward(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    n, d = x.shape[0], _dims(module)
    o, c_g = module.out_channels, module.in_channels // module.groups
    # only the weight's shape is read: a stride-0 view, no memory
    weight = g.new_empty(()).expand(n * o, c_g, *module.kernel_size)
    res = torch.ops.aten.convolution_backward(
        g.reshape(1, n * o, *g.shape[2:]), x.reshape(1, n * module.in_channels, *x.shape[2:]),
        weight, None, module.stride, [0] * d, module.dilation, False, [0] * d,
        n * module.groups, [False, True, False],
    )[1]  # fmt: skip
    return res.view(n, o, c_g, *module.kernel_size)


ALGORITHMS = ("unfold", "grouped", "weight_backward")


def _workspace_of(module: nn.Module, g: Tensor, algorithm: str) -> int:
    """Scratch bytes per sample: the result, plus the patches for ``"unfold"``."""
    result = module.weight.numel()  # (shapes only: indexing a tensor costs a kernel call)
    if algorithm != "unfold":
        return 2 * result * g.element_size()
    patches = module.in_channels * math.prod(module.kernel_size) * math.prod(g.shape[2:])
    return (patches + result) * g.element_size()


def candidates(module: nn.Module, g: Tensor, opts: RuleOptions) -> tuple[str, ...]:
    """The algorithms ``opts.conv_algorithm`` allows: ``"auto"``, every one whose scratch memory
    for one sample fits the workspace budget."""
    if opts.conv_algorithm != "auto":
        return (opts.conv_algorithm,)
    fits = tuple(a for a in ALGORITHMS if _workspace_of(module, g, a) <= opts.workspace_bytes)
    return fits or ("grouped",)


def _workspace(module: nn.Module, inputs: tuple[Any, ...], g: Tensor, opts: RuleOptions) -> int:
    return max(_workspace_of(module, g, a) for a in candidates(module, g, opts))


_TRIES = 3  # timed calls of each algorithm per layer shape before the fastest is kept
_SLOWER = 1.5  # after one call each, algorithms this much slower than the best are dropped
_FASTEST: dict[tuple, str] = {}  # layer configuration and shapes -> fastest algorithm
_TIMES: dict[tuple, dict[str, list[float]]] = {}  # the same -> seconds of each call tried
_LOCK = threading.Lock()  # guards the two


def _key(module: nn.Module, x: Tensor, g: Tensor, options: tuple[str, ...]) -> tuple:
    return (
        x.device, x.dtype, tuple(x.shape), tuple(g.shape), tuple(module.weight.shape),
        module.stride, module.dilation, module.groups, options,
    )  # fmt: skip


def _sync(x: Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def _weight_grads(
    module: nn.Module, x: Tensor, g: Tensor, options: tuple[str, ...], out: Tensor | None
) -> Tensor:
    """Individual weight gradients ``[n, O, C/G, *K]`` by the fastest of ``options`` for this
    layer and shape, written into ``out`` where given.

    The fastest is found in use: the first calls of each algorithm on a shape are timed as
    they run (their results are the results: nothing is computed twice): one each, then
    ``_TRIES`` of those within ``_SLOWER`` times the best, and the one with the lowest median
    is kept for the process. Timed where it runs, a call pays
    what the model's real calls pay (the result's fresh memory, cold caches, the backend's
    kernel selection), which a separate trial does not see (oneDNN's grouped weight
    gradient times from 1x to 10x im2col's on identical layers). While autograd records,
    the first of ``options``."""
    run = {
        "unfold": lambda: _unfold(module, x, g, out),
        "grouped": lambda: _grouped(module, _pad(module, x), g),
        "weight_backward": lambda: _weight_backward(module, _pad(module, x), g),
    }
    if len(options) == 1 or torch.is_grad_enabled():
        return run[options[0]]()
    key = _key(module, x, g, options)
    fastest = _FASTEST.get(key)
    if fastest is not None:
        return run[fastest]()
    with _LOCK:  # (backward passes on several threads: one model per device, per thread)
        times = _TIMES.setdefault(key, {a: [] for a in options})
        algorithm = min(times, key=lambda a: len(times[a]))  # the least tried
    _sync(x)
    start = time.perf_counter()
    res = run[algorithm]().view(x.shape[0], *module.weight.shape)
    if out is not None and res.data_ptr() != out.data_ptr():  # (every one pays the write)
        res = out.copy_(res)
    _sync(x)
    took = time.perf_counter() - start
    with _LOCK:
        times = _TIMES.get(key)
        if times is None or algorithm not in times:  # (decided meanwhile, on another thread)
            return res
        times[algorithm].append(took)
        if all(times.values()):  # each tried once: the clearly slower ones are not tried again
            best = min(min(t) for t in times.values())
            for a in [a for a, t in times.items() if min(t) > _SLOWER * best]:
                del times[a]
        if all(len(t) >= _TRIES for t in times.values()):
            _FASTEST[key] = min(times, key=lambda a: statistics.median(times[a]))
            del _TIMES[key]
    return res


def _explicit_zero_padding(module: nn.Module) -> bool:
    """Zero padding given as numbers (not ``"same"``/``"valid"``, not another padding mode)."""
    return module.padding_mode == "zeros" and not isinstance(module.padding, str)


def _can_fuse(module: nn.Module) -> bool:
    """The op is replaced only where torch's own call is ``convN(x, w, b, stride, padding...)``
    with numeric zero padding (string padding and other padding modes keep autograd's
    backward, which our input gradient does not reproduce)."""
    return _explicit_zero_padding(module)


def _conv_backward(module: nn.Module, x: Tensor, g: Tensor, mask: list[bool]) -> tuple:
    d = _dims(module)
    padding = module.padding
    if not _explicit_zero_padding(module):  # ("same", other padding modes: the weight's only)
        x, padding = _pad(module, x), [0] * d
    return torch.ops.aten.convolution_backward(
        g, x, module.weight.to(g.dtype), [module.out_channels] if mask[2] else None,
        module.stride, padding, module.dilation, False, [0] * d, module.groups, mask,
    )  # fmt: skip


def conv_input_grad(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """Ordinary input gradient ``[N, C, *S]`` (of a layer with numeric zero padding: the op
    is replaced only there)."""
    return _conv_backward(module, x, g, [True, False, False])[0]


def conv_param_grads(
    module: nn.Module, x: Tensor, g: Tensor, names: frozenset[str]
) -> dict[str, Tensor]:
    """Ordinary (summed) parameter gradients."""
    out: dict[str, Tensor] = {}
    if "weight" in names:
        out["weight"] = _conv_backward(module, x, g, [False, True, False])[1]
    if "bias" in names:
        out["bias"] = g.transpose(0, 1).flatten(1).sum(1)  # [O]
    return out


def conv_batch_l2(
    module: nn.Module, inputs: tuple[Any, ...], g: Tensor, names: frozenset[str],
    opts: RuleOptions,
) -> dict[str, Tensor]:  # fmt: skip
    """Squared norms ``[N]`` of the weight's individual gradients by the Gram form, where the
    layer has few output positions (the bias's, ``[N, O]``, cost less than a closed form)."""
    x = inputs[0]
    n, groups = x.shape[0], module.groups
    out: dict[str, Tensor] = {}
    o_g = module.out_channels // groups
    i_g = math.prod(module.weight.shape[1:])  # C/G * prod(K)
    positions = math.prod(g.shape[2:])  # L
    if "weight" not in names or not gram_is_cheaper(positions, i_g, o_g, opts.sums_wanted):
        return out
    pixels = _pixel_gram_is_cheaper(module, x, g)
    k = math.prod(module.kernel_size)
    if pixels:  # the padded input, its pixel Gram, the [L, L] Grams: [n, C P], [n, G (P² + 3 L²)]
        p = math.prod(s + 2 * q for s, q in zip(x.shape[2:], _padding_of(module), strict=True))
        per_sample = module.in_channels * p + groups * (p * p + 3 * positions**2)
    else:  # the patches: [n, C*K, L] (no more than the individual gradients would take: the
        # criterion bounds them)
        per_sample = math.prod(x.shape[1:]) + module.in_channels * k * positions
    parts = []
    for start, stop in sample_chunks(n, per_sample * g.element_size(), opts.workspace_bytes):
        m = stop - start
        if pixels:
            sq = _pixel_gram_norms(module, x[start:stop], g[start:stop])  # [m*G]
        else:
            u = _patches(module, x[start:stop]).reshape(m * groups, i_g, positions).mT
            gs = g[start:stop].reshape(m * groups, o_g, positions).mT  # [m*G, L, O/G]
            sq = inner(Outer(gs, u), Outer(gs, u), opts.workspace_bytes)  # [m*G]
        parts.append(sq.view(m, groups).sum(1))
    out["weight"] = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else g.new_zeros(0)
    return out


def _pixel_gram_is_cheaper(module: nn.Module, x: Tensor, g: Tensor) -> bool:
    """Whether the patches' Gram costs no more from the padded input's pixel Gram (``P²`` per
    channel) than from the patches (``K L²`` per channel, plus their copy)."""
    padded = [s + 2 * p for s, p in zip(x.shape[2:], _padding_of(module), strict=True)]
    return math.prod(padded) ** 2 <= math.prod(module.kernel_size) * math.prod(g.shape[2:]) ** 2


def _padding_of(module: nn.Module) -> tuple[int, ...]:
    """Padding on each side of each spatial dim (at most: ``"same"`` may pad one less)."""
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0,) * _dims(module)
        pairs = zip(module.kernel_size, module.dilation, strict=True)
        return tuple(dil * (k - 1) // 2 + 1 for k, dil in pairs)
    return tuple(module.padding)


def _pixel_gram_norms(module: nn.Module, x: Tensor, g: Tensor) -> Tensor:
    """``||W_n||²`` per sample and group ``[n * G]`` from the pixel Gram of the padded input
    (16-bit values in float32)."""
    n, groups = x.shape[0], module.groups
    xp = _pad(module, x)
    padded, out = tuple(xp.shape[2:]), tuple(g.shape[2:])
    p, positions = math.prod(padded), math.prod(out)
    xf = widen(xp.reshape(n * groups, -1, p))  # [nG, C/G, P]
    pixels = torch.bmm(xf.mT, xf)  # [nG, P, P]
    # the block A[p(s) + k, p(t) + k] of window pairs (s, t) for each kernel offset k: a view
    # of A with the windows' strides (stride x the padded input's steps) along rows and columns
    steps = [math.prod(padded[i + 1 :]) for i in range(len(padded))]
    walk = [st * step for st, step in zip(module.stride, steps, strict=True)]
    size, strides = (n * groups, *out, *out), (p * p, *(w * p for w in walk), *walk)
    patch_gram = None
    for offset in itertools.product(*(range(extent) for extent in module.kernel_size)):
        dims = zip(offset, module.dilation, steps, strict=True)
        off = sum(i * d * step for i, d, step in dims)
        block = pixels.as_strided(size, strides, pixels.storage_offset() + off * (p + 1))
        patch_gram = block if patch_gram is None else patch_gram + block
    gf = widen(g.reshape(n * groups, -1, positions))  # [nG, O/G, L]
    grad_gram = torch.bmm(gf.mT, gf)  # [nG, L, L]
    return (patch_gram.reshape(n * groups, positions, positions) * grad_gram).sum((1, 2))


@register_rule(
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    batch_l2=conv_batch_l2,
    workspace=_workspace,
    check_input=_check,
    input_grad=conv_input_grad,
    param_grads=conv_param_grads,
    can_fuse=_can_fuse,
    accepts_out=True,
    batch_first=True,
    op_takes_module_input=lambda module: module.padding_mode == "zeros",
)
def conv_batch_grads(
    module: nn.Module,
    inputs: tuple[Any, ...],
    g: Tensor,
    names: frozenset[str],
    opts: RuleOptions,
    out: dict[str, Tensor | None] | None = None,
) -> dict[str, Tensor]:
    """Individual gradients ``{"weight": [N, O, C/G, *K], "bias": [N, O]}``.

    ``out["weight"]``, when given, is a contiguous buffer the im2col algorithm writes into.
    """
    target = (out or {}).get("weight")
    res: dict[str, Tensor] = {}
    if "weight" in names:
        res["weight"] = _weight_grads(module, inputs[0], g, candidates(module, g, opts), target)
    if "bias" in names:
        res["bias"] = g.flatten(2).sum(2)  # [N, O]
    return res
