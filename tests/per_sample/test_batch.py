"""Batch tracking op by op (``leanprop/per_sample/batch/``), with T == N == D so that no
dimension can be told from the batch by its size: a probe tensor holds its sample index n in
every entry of sample n, and each op's tracked batch dimension must gather exactly sample n."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from leanprop.per_sample.batch import BatchDim, BatchTracker, Lost, to_front
from leanprop.per_sample.batch.infos import Combined, Selected
from leanprop.per_sample.batch.mixing import merge_infos

N = 4
PERM = torch.tensor([2, 0, 3, 1])
inf = float("inf")
LENGTHS = torch.tensor([2, N, 1, 3])


def pack(x, lengths, batch_first=True, enforce_sorted=True):
    return torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first, enforce_sorted)


def pad(packed, batch_first=True):
    return torch.nn.utils.rnn.pad_packed_sequence(packed, batch_first)


class Follow(TorchFunctionMode):
    """Follows every op with ``propagate`` or, where ``quick`` (as the op interception does),
    with ``propagate_batched`` for ops that take no parameter-derived operand."""

    def __init__(self, tracker: BatchTracker, quick: bool = False) -> None:
        super().__init__()
        self.tracker, self.quick = tracker, quick

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        batched = self.tracker.batched_only(args, kwargs) if self.quick else None
        if batched is None:
            self.tracker.propagate(func, args, kwargs, out)
        else:
            self.tracker.propagate_batched(func, args, kwargs, out, batched, False)
        return out


def follow(op, quick=False):
    tracker = BatchTracker(())
    tracker.n = N
    x = torch.arange(N, dtype=torch.float64).view(N, 1, 1).expand(N, N, N).clone()
    tracker.mark(x, BatchDim(0))
    with Follow(tracker, quick):
        out = op(x)
    outs = out if isinstance(out, tuple | list) else (out,)
    return [(o, tracker.info(o)) for o in outs]


def _copied_into_a_view(v):
    buf = torch.zeros_like(v)
    buf.narrow(0, 0, v.shape[0]).copy_(v)
    return buf


def _added_in_place(x):
    """A loss started without grad from a softmax over the batch (times zero), the
    per-sample loss added in place, then another op without grad."""
    with torch.no_grad():
        loss = x.softmax(0).amax() * 0
    loss += x.square().sum()
    with torch.no_grad():
        x.abs().mean()
    return loss


def _implicit(softmax, x):
    """``softmax(x)`` with its dimension left to torch's legacy choice (deprecated: warns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return softmax(x)


def assigned(shape, *writes):
    """``dest = x.new_zeros(shape(x)); dest[index] = value(x)`` for each ``(index, value)``
    of ``writes``: ``dest``, which carried no batch before."""

    def op(x):
        dest = x.new_zeros(shape(x))
        for index, value in writes:
            dest[index] = value(x)
        return dest

    return op


def _written_into_a_view(x):
    dest = x.new_zeros(x.shape)
    dest[:, 1:].copy_(x[:, :-1])
    dest[:, :1].copy_(x[:, -1:])
    return dest


def _written_step_by_step(x):  # (an RNN's outputs into a preallocated buffer)
    out = x.new_zeros(N, N, N)
    for t in range(N):
        out[:, t].copy_(x[:, t] * 2 - x[:, t])
    return out


def _written_into_part_of_the_batch(x):
    dest = x.new_zeros(N + 1, N, N)
    dest[1:].copy_(x)
    return dest


def _written_into_a_view_of_itself(x):
    d = x.clone()
    d[:, 0].copy_(x[:, 1])
    d.view(N * N, N).mul_(1.0)  # (a flattened view: the samples stay where they are)
    return d


def _other_values_written(how):
    """``d`` shifted as HF does, then written again with values not each sample's own."""

    def op(x):
        d = x.new_zeros(x.shape)
        d[:, 1:] = x[:, :-1]
        if how == "one sample's":
            d[:, 0] = x[0, 0]
        elif how == "a batch mean":
            d[:, 0] = x[:, 0].mean(0)
        elif how == "samples along time":
            d[:, :1] = x.transpose(0, 1)[:, :1]
        else:  # into a view of it
            d[:, 0].copy_(x[0, 0])
        return d

    return op


def _assigned_through_a_view(x):
    dest = x.new_zeros(N, N * N)
    dest.view(N, N, N)[:, :] = x
    return dest


def _complex_pairs(x):
    """Rotary embeddings' complex form (Meta's Llama): pairs of features as complex numbers,
    turned, and back as pairs."""
    turned = torch.view_as_complex(x.reshape(N, N, -1, 2)) * torch.polar(
        torch.ones(N // 2, dtype=torch.float64), torch.zeros(N // 2, dtype=torch.float64)
    )
    return torch.view_as_real(turned).flatten(-2)


def _real_and_imaginary(x):
    pairs = torch.view_as_complex(x.reshape(N, N, -1, 2))
    return torch.cat([pairs.real, pairs.imag], -1)


KEEP = {
    "max_pool1d's values beside its indices": lambda x: F.max_pool1d(x, 2, return_indices=True)[0],
    "max_pool3d's values beside its indices": lambda x: F.max_pool3d(
        x[:, None, None].expand(N, 1, 2, N, N), 2, return_indices=True
    )[0],
    "adaptive max pooling's values beside its indices": lambda x: F.adaptive_max_pool2d(
        x[:, None], 2, return_indices=True
    )[0],
    "fractional max pooling": lambda x: F.fractional_max_pool2d(x[:, None], 2, output_size=2),
    "fractional max pooling in 3-d, with its indices": lambda x: F.fractional_max_pool3d(
        x[:, None, None].expand(N, 1, N, N, N), 2, output_size=2, return_indices=True
    )[0],
    "pixel shuffle of frames, the batch second": lambda x: F.pixel_shuffle(
        x[None, :, :, None].expand(2, N, N, 4, N).transpose(2, 3).contiguous(), 2
    ),
    "pixel unshuffle with the batch behind other leading dimensions": lambda x: F.pixel_unshuffle(
        x[None, None, :, None].expand(1, 2, N, 1, N, N), 2
    ),
    "a vector made 2-d": lambda x: torch.atleast_2d(x[:, 0, 0]),
    "a vector made 3-d": lambda x: torch.atleast_3d(x[:, 0, 0]),
    "a matrix made 3-d": lambda x: torch.atleast_3d(x[:, 0]),
    "several tensors made 3-d, one with the batch": lambda x: torch.atleast_3d(
        x[:, 0], torch.ones(2, dtype=x.dtype)
    )[0],
    "several tensors made 2-d, each with the batch": lambda x: torch.atleast_2d(
        x[:, 0, 0], x[:, 0, 1]
    ),
    "vectors as columns": lambda x: torch.column_stack([x[:, 0, 0], x[:, 0, 1]]),
    "vectors and matrices as columns": lambda x: torch.column_stack((x[:, 0, 0], x[:, 0])),
    "matrices side by side (hstack)": lambda x: torch.hstack([x[:, 0], x[:, 1]]),
    "vectors as rows (row_stack)": lambda x: torch.row_stack([x[:, 0, 0], x[:, 0, 1]]),
    "vectors stacked in depth": lambda x: torch.dstack([x[:, 0, 0], x[:, 0, 1]]),
    "matrices stacked in depth": lambda x: torch.dstack([x[:, 0], x[:, 1]]),
    "grid_sample of batched images": lambda x: F.grid_sample(
        x.unsqueeze(1), torch.zeros(N, 2, 2, 2, dtype=x.dtype), align_corners=False
    ),
    "fold of im2col": lambda x: F.fold(F.unfold(x.unsqueeze(1), 2, stride=2), (N, N), 2, stride=2),
    "complex pairs and back": _complex_pairs,
    "a complex view's real and imaginary parts": lambda x: _real_and_imaginary(x),
    "renorm of each sample": lambda x: x.renorm(2, 0, 1e9),
    "as_strided as it is": lambda x: x.as_strided(x.shape, x.stride()),
    "as_strided of each sample's first rows": lambda x: x.as_strided((N, 2, N), (N * N, N, 1)),
    "as_strided with the samples last": lambda x: x.as_strided((N, N, N), (N, 1, N * N)),
    "as_strided, the samples and features swapped": lambda x: x.as_strided(
        (N, N, N), (1, N, N * N)
    ),
    "fftshift of other dimensions": lambda x: torch.fft.fftshift(x, (1, 2)),
    "as_strided_copy, the samples and features swapped": lambda x: torch.as_strided_copy(
        x, (N, N, N), (1, N, N * N)
    ),
    "as_strided of a view at an offset": lambda x: x[:, 1:].as_strided(
        (N, N - 1, N), x.stride(), x.storage_offset() + N
    ),
    "as_strided as it is, the batch second": lambda x: (
        x.transpose(0, 1).contiguous().as_strided((N, N, N), (N * N, N, 1))
    ),
    "sorted within each sample": lambda x: x.sort().values,
    # (HF's shift_tokens_right, each sample's entries all written)
    "assigned into a fresh tensor, shifted along time": assigned(
        lambda x: x.shape,
        ((slice(None), slice(1, None)), lambda x: x[:, :-1]),
        ((slice(None), slice(None, 1)), lambda x: x[:, -1:]),
    ),
    "assigned behind an ellipsis": assigned(
        lambda x: x.shape,
        ((Ellipsis, slice(1, None)), lambda x: x[..., :-1]),
        ((Ellipsis, 0), lambda x: x[..., -1]),
    ),
    "assigned, the batch second": assigned(lambda x: x.shape, (slice(None), lambda x: x.mT)),
    "assigned into a moved batch": assigned(
        lambda x: (N, N, N), ((slice(None),), lambda x: x.transpose(0, 1))
    ),
    "assigned below a new dimension": assigned(lambda x: (1, N, N, N), (0, lambda x: x)),
    "written into views of a fresh tensor": _written_into_a_view,
    "written into a view of a tensor that carries the batch": _written_into_a_view_of_itself,
    "written into a fresh tensor step by step": _written_step_by_step,
    "assigned through a view of a fresh tensor": _assigned_through_a_view,
    "assigned beside itself": assigned(
        lambda x: (N, N, N, 2), ((..., 0), lambda x: x), ((..., 1), lambda x: x)
    ),
    "tuple index before the samples": lambda x: x.transpose(0, 1)[(0, 1), ...],
    "baddbmm by keyword": lambda x: x[:, :1].baddbmm(batch1=x[..., :2], batch2=x[:, :2], alpha=0),
    "matmul by keyword": lambda x: torch.matmul(input=x, other=torch.eye(N, dtype=x.dtype)),
    # (as many elements of every sample: each sample's rows together, N groups of them)
    "boolean mask, as many per sample": lambda x: x[x[:, :, 0] >= 0].view(N, N, N),
    "boolean mask over the first two dimensions": lambda x: x[torch.eye(N, dtype=torch.bool)],
    "list index after an ellipsis": lambda x: x[..., [-2], :],
    "list index beside the samples": lambda x: x[:, [0, 2]],
    "tensor index after an ellipsis": lambda x: x[..., torch.tensor([1, 0])],
    # (the largest magnitude: each sample's value stays its index)
    "vector norm over other dimensions": lambda x: torch.linalg.vector_norm(x, inf, (1, 2), True),
    "vector norm by keyword": lambda x: torch.linalg.vector_norm(x, ord=inf, dim=-1),
    # (the other tensor gives the dtype alone; its batch, of another shape, is not the output's)
    "type_as another batched tensor": lambda x: x[:, 0].float().type_as(x),
    "to another batched tensor": lambda x: x[:, :, 0].float().to(x),
    "view": lambda x: x.view(N, N * N),
    "flatten samples": lambda x: x.reshape(N * N, N),
    "flatten then back": lambda x: x.reshape(-1, N).view(N, N, N),
    "transpose": lambda x: x.transpose(0, 2),
    "permute": lambda x: x.permute(1, 2, 0),
    "movedim": lambda x: x.movedim(0, -1),
    "mT": lambda x: x.mT,
    "unsqueeze": lambda x: x.unsqueeze(0),
    "select other": lambda x: x.select(1, 2),
    "narrow other": lambda x: x.narrow(2, 1, 2),
    "split other": lambda x: x.split(2, 1),
    "chunk other": lambda x: x.chunk(2, 2),
    "unbind other": lambda x: x.unbind(1),
    "getitem": lambda x: x[:, 1:, None, 0],
    "getitem ellipsis": lambda x: x[..., :2],
    "arange index": lambda x: x[torch.arange(N)[:, None], torch.tensor([[0, 2]])],
    "cat other": lambda x: torch.cat([x, x], dim=1),
    "stack": lambda x: torch.stack([x, x], dim=0),
    "repeat other": lambda x: x.repeat(1, 2, 1),
    "expand": lambda x: x.unsqueeze(1).expand(N, 2, N, N),
    "sum other": lambda x: x.sum(1) / N,
    "mean keepdim": lambda x: x.mean((1, 2), keepdim=True),
    "softmax other": lambda x: x * F.softmax(x, -1) * N,
    "matmul": lambda x: x @ torch.eye(N, dtype=x.dtype),
    "matmul right": lambda x: torch.eye(N, dtype=x.dtype)[:1] @ x,
    "einsum": lambda x: torch.einsum("ntd,de->etn", x, torch.eye(N, dtype=x.dtype)),
    "linear": lambda x: F.linear(x, torch.eye(N, dtype=x.dtype)),
    "elementwise": lambda x: torch.where(x >= 0, x, -x) * torch.ones(N, 1),
    "matmul vector": lambda x: x @ torch.ones(N, dtype=x.dtype) / N,
    "vector matmul": lambda x: torch.ones(N, dtype=x.dtype) @ x.transpose(1, 2) / N,
    "einsum list": lambda x: torch.einsum("ed,ntd->nte", [torch.eye(N, dtype=x.dtype), x]),
    "einsum with an ellipsis": lambda x: torch.einsum(
        "...d,de->...e", x, torch.eye(N, dtype=x.dtype)
    ),
    "einsum with the batch in an ellipsis": lambda x: torch.einsum("...td->t...d", x),
    "einsum with an implicit output": lambda x: torch.einsum(
        "ntd,de", x, torch.eye(N, dtype=x.dtype)
    ),
    "rows of a table at the samples' indices": lambda x: TABLE[x[:, :, 0].long()],
    "quantile with the batch last, keepdim by position": lambda x: torch.quantile(
        x.movedim(0, 2), 0.5, 0, True
    ),
    "rows of a table at the samples' indices, spelled [ids, :]": lambda x: TABLE[
        x[:, :, 0].long(), :
    ],
    "a table's rows selected at the samples' indices": lambda x: TABLE.index_select(
        0, x[:, 0, 0].long()
    ),
    "gathered at each sample's own index": lambda x: x.gather(2, x.long()[:, :, :1] * 0),
    "repeat_interleave samples": lambda x: x.repeat_interleave(2, dim=0),
    "repeat_interleave other": lambda x: x.repeat_interleave(2, dim=1),
    "quantile other": lambda x: torch.quantile(x, 0.5, dim=2),
    "quantiles other": lambda x: torch.quantile(x, torch.tensor([0.2, 0.5]).double(), dim=1),
    "nanmedian other": lambda x: x.nanmedian(dim=1).values,
    "mode other": lambda x: x.mode(dim=2).values,
    "index_select other": lambda x: x.index_select(2, torch.tensor([0, 2])),
    "gather other": lambda x: x.gather(1, torch.zeros(N, 1, N, dtype=torch.long)),
    "topk other": lambda x: x.topk(2, dim=2).values,
    "max of two": lambda x: torch.max(x, torch.zeros(N, N)),
    "sum axis": lambda x: x.sum(axis=1) / N,
    "outer": lambda x: torch.outer(x[:, 0, 0], torch.ones(3, dtype=x.dtype)),
    "elementwise chain": lambda x: (F.dropout(torch.relu(2 * x + 1).contiguous(), 0.0) - 1) / 2,
    "layer norm": lambda x: x + 0 * F.layer_norm(x, (N,)),
    "group norm": lambda x: x + 0 * F.group_norm(x, 2),
    "conv": lambda x: x + 0 * F.conv1d(x, torch.ones(N, N, 1, dtype=x.dtype)),
    "pad other": lambda x: F.pad(x, (1, 1))[..., 1:-1],
    # the batch moved off dimension 0 first (sequence-first layouts)
    "moved then sliced": lambda x: x.transpose(0, 1)[:, :, 1:],
    "moved then flattened": lambda x: x.transpose(0, 1).reshape(N, N * N),
    "moved then summed": lambda x: x.transpose(0, 1).sum(0) / N,
    "moved then split": lambda x: x.transpose(0, 1).split(2, 0),
    "moved then linear": lambda x: F.linear(x.transpose(0, 1), torch.eye(N, dtype=x.dtype)),
    # samples reordered, then put back in order (what a packed sequence does)
    "permuted and back": lambda x: x.index_select(0, PERM).index_select(0, PERM.argsort()),
    "permuted and back, keywords": lambda x: torch.index_select(
        torch.index_select(x, dim=0, index=PERM), dim=0, index=PERM.argsort()
    ),
    "indexed and back": lambda x: x[PERM][PERM.argsort()],
    "permuted lengths and back": lambda x: (
        x
        * pad(pack(x, LENGTHS, enforce_sorted=False))[1][:, None, None].to(x.dtype)
        / pad(pack(x, LENGTHS, enforce_sorted=False))[1][:, None, None]
    ),
    "packed and padded back": lambda x: pad(pack(x, LENGTHS, enforce_sorted=False))[0][:, :1],
    "packed and padded back, sequence first": lambda x: pad(
        pack(x.transpose(0, 1), LENGTHS, batch_first=False, enforce_sorted=False),
        batch_first=False,
    )[0][:1],
    "packed, elementwise, padded back": lambda x: pad(
        torch.nn.utils.rnn.PackedSequence(*[*pack(x, LENGTHS, enforce_sorted=False)])._replace(
            data=pack(x, LENGTHS, enforce_sorted=False).data * 1
        )
    )[0][:, :1],
    "kron with the batch as the outer factor": lambda x: torch.kron(x, torch.ones(1, 1, 2)),
    "kron beside a constant's single row": lambda x: torch.kron(torch.ones(1, 2, 1), x),
    "tensordot over features": lambda x: torch.tensordot(x, torch.ones(N, N, 2).double() / N**2, 2),
    "tensordot, the batch behind": lambda x: torch.tensordot(
        torch.ones(2, N).double() / N, x, ([1], [1])
    ),
    "the batch's parts put back together": lambda x: torch.cat([x[:1], x[1:3], x[3:]]),
    "all of them by a slice": lambda x: x[:N],
    "all of them by split": lambda x: x.split(N)[0],
    "all of them by narrow": lambda x: x.narrow(0, 0, N),
    "all of them by gather": lambda x: x[:, 0, 0].gather(0, torch.arange(N)),
    "all of them by masked_select": lambda x: x[:, 0, 0].masked_select(torch.ones(N).bool()),
    "flipped twice": lambda x: x.flip(0).flip(0),
    "rolled and back": lambda x: x.roll(1, 0).roll(-1, 0),
    "samples in groups, then put back": lambda x: x.view(2, 2, N, N).relu().view(N, N, N),
    "samples in groups, then flattened": lambda x: x.unflatten(0, (2, 2)).flatten(0, 1),
    "samples in groups with features, then back": lambda x: x.view(2, -1).view(N, N, N),
    "flipped, and back by flipud": lambda x: x.flip(0).flipud(),
    "parts put together, by keyword": lambda x: torch.cat(tensors=[x[:2], x[2:]]),
    "parts stacked on top of each other": lambda x: torch.vstack([x[:2], x[2:]]),
    "a pair's halves side by side, then back": lambda x: torch.stack([x[:2], x[2:]], 1).flatten(
        0, 1
    )[torch.tensor([0, 2, 1, 3])],
    "keyword transpose (replayed on the samples' ids)": lambda x: (
        x.transpose(dim0=0, dim1=1).contiguous().view(N, N, N)[1:]
    ),
}


def _index_reduced(x, keywords=False, within=False):
    index = torch.zeros(N, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (index_reduce is in beta)
        if within:  # (along time, into 2 places)
            return torch.ones(N, 2, N, dtype=x.dtype).index_reduce(
                1, torch.tensor([0, 1, 0, 1]), x, "prod"
            )
        if keywords:
            return torch.zeros_like(x).index_reduce(dim=0, index=index, source=x, reduce="prod")
        return x.index_reduce(0, index, x, "prod")


_MASK = torch.arange(N**3).view(N, N, N) % 3 == 0


LOSE = {
    "pixel shuffle of the samples as channels of frames": lambda x: F.pixel_shuffle(
        x[None].expand(2, N, N, N).unsqueeze(1), 2
    ),
    "vectors put end to end (hstack)": lambda x: torch.hstack([x[:, 0, 0], x[:, 0, 1]]),
    "matrices put one below the other (vstack)": lambda x: torch.vstack([x[:, 0], x[:, 1]]),
    "a softmax left to its legacy dimension, the first of a 3-d input": lambda x: _implicit(
        F.softmax, x
    ),
    "a log-softmax left to its legacy dimension of a vector": lambda x: _implicit(
        F.log_softmax, x[:, 0, 0]
    ),
    "power-average pooling along the batch": lambda x: F.lp_pool1d(x.transpose(0, 2), 2, 2),
    "max values put back along the batch": lambda x: F.max_unpool1d(
        *F.max_pool1d(x.transpose(0, 2), 2, return_indices=True), 2
    ),
    # unbatched calls, whose channels are the samples (a batch of grayscale images [N, H, W]
    # into a convolution with N input channels: one image of N channels)
    "an unbatched conv2d": lambda x: F.conv2d(x, torch.ones(N, N, 1, 1, dtype=x.dtype)),
    "an unbatched conv1d": lambda x: F.conv1d(x[:, 0], torch.ones(2, N, 1, dtype=x.dtype)),
    "im2col of an unbatched input": lambda x: F.unfold(x, 2),
    "a pixel shuffle of an unbatched input": lambda x: F.pixel_shuffle(x, 2),
    "fold of an unbatched input": lambda x: F.fold(x[:, 0], (N, N), 2, stride=2),
    "a margin loss of an unbatched input": lambda x: F.multi_margin_loss(
        x[:, 0, 0], torch.tensor(1), reduction="none"
    ),
    "a triplet loss of unbatched inputs": lambda x: F.triplet_margin_loss(
        x[:, 0, 0], x[:, 0, 1], x[:, 1, 0], reduction="none"
    ),
    # an op leanprop does not know adding a dimension: not taken for broadcasting from the
    # right (torch.vander appends one: its rows were taken for features, the samples' powers
    # for the samples)
    "an unknown op adding a dimension": lambda x: torch.diagflat(x[:, 0, 0]),
    # ops acting across the samples that were taken as elementwise (silently wrong results)
    "renorm of sub-tensors that span the samples": lambda x: x.renorm(2, 1, 1.0),
    "as_strided windows across the samples": lambda x: x.as_strided((N, N, N), (N, 1, N)),
    "as_strided rows spanning two samples": lambda x: x.as_strided((N - 1, 2 * N * N), (N * N, 1)),
    "fftshift of every dimension": lambda x: torch.fft.fftshift(x),
    "fftshift of the samples": lambda x: torch.fft.fftshift(x, 0),
    "hfft along the samples": lambda x: torch.fft.hfft(x, N, 0),
    "index_reduce into samples": lambda x: _index_reduced(x),
    "the gradient over every dimension": lambda x: torch.gradient(x)[0],
    "a linear layer with the samples' weights": lambda x: F.linear(x[:, 0], x[:, 0]),
    "a linear layer with the samples' bias": lambda x: F.linear(
        x[:, 0], torch.ones(N, N).double(), x[:, 0, 0]
    ),
    "a convolution with the samples' weights": lambda x: F.conv1d(x, x),
    "a convolution with the samples' bias": lambda x: F.conv1d(
        x, torch.ones(N, N, 1, dtype=x.dtype), x[:, 0, 0]
    ),
    "prelu with the samples' weight": lambda x: F.prelu(x, x[:, 0, 0]),
    "the samples sorted along the batch": lambda x: x.msort(),
    "the samples sorted along the batch, the input by keyword": lambda x: torch.msort(input=x),
    "as_strided_copy windows across the samples": lambda x: torch.as_strided_copy(
        x, (N, N, N), (N, 1, N)
    ),
    "as_strided in place, the samples and features swapped": lambda x: x.clone().as_strided_(
        (N, N, N), (1, N, N * N)
    ),
    "ones scattered along the batch at batched positions": lambda x: torch.zeros(
        N, N, dtype=x.dtype
    ).scatter(0, x[:, 0].argmax(1, keepdim=True), 1.0),
    "as_strided reading past the view": lambda x: x[:, :2].as_strided(x.shape, x.stride()),
    "a sample's place along the batch written over": lambda x: torch.select_scatter(
        x, torch.zeros(N, N, dtype=x.dtype), 0, 1
    ),
    "the samples placed along the batch by slice_scatter": lambda x: torch.slice_scatter(
        torch.zeros(2 * N, N, N, dtype=x.dtype), x, 0, 1, N + 1
    ),
    "the samples scattered onto a diagonal": lambda x: torch.diagonal_scatter(
        torch.zeros(N, N, N, dtype=x.dtype), x[:, 0], 0, 1, 2
    ),
    "masked_scatter of the samples": lambda x: torch.zeros_like(x).masked_scatter(_MASK, x),
    "masked_scatter of the samples by keyword": lambda x: torch.zeros_like(x).masked_scatter(
        _MASK, source=x
    ),
    "as_strided_scatter of the samples": lambda x: torch.as_strided_scatter(
        torch.zeros_like(x), x, (N, N, N), (1, N, N * N)
    ),
    **{
        f"{how} values written into each sample's": _other_values_written(how)
        for how in ("one sample's", "a batch mean", "samples along time", "a view: one sample's")
    },
    "assigned into part of the batch dimension": assigned(
        lambda x: (N + 1, N, N), (slice(1, None), lambda x: x)
    ),
    "assigned by an index tensor": assigned(lambda x: x.shape, (torch.arange(N), lambda x: x)),
    "assigned from one sample": assigned(lambda x: x.shape, (slice(None), lambda x: x[:1])),
    "written into part of a fresh tensor along the batch": _written_into_part_of_the_batch,
    "boolean mask, not as many per sample": lambda x: x[torch.ones(N, N).tril().bool()],
    "boolean mask beside the samples": lambda x: x[:, torch.ones(N, dtype=torch.bool)],
    "list index into the samples": lambda x: x[[0, 1]],
    "list index into the samples after an ellipsis": lambda x: x[..., [0, 1], :, :],
    "vector norm over the samples": lambda x: torch.linalg.vector_norm(x, 2, (0, 2)),
    "vector norm of everything": lambda x: torch.linalg.vector_norm(x),
    "permuted": lambda x: x.index_select(0, PERM),
    "permuted, flattened, back": lambda x: x.index_select(0, PERM).reshape(N * N, N),
    "permuted plus in order, then back": lambda x: (x.index_select(0, PERM) + x).index_select(
        0, PERM.argsort()
    ),
    "packed data": lambda x: pack(x, LENGTHS, enforce_sorted=False).data,
    "packed data mixed over rows": lambda x: pack(x, LENGTHS, enforce_sorted=False).data.cumsum(0),
    "slice samples": lambda x: x[1:],
    "index sample": lambda x: x[0],
    "reordered index": lambda x: x[torch.tensor([1, 0, 2, 3])],
    "sum samples": lambda x: x.sum(0),
    "sum all": lambda x: x.sum(),
    "softmax samples": lambda x: F.softmax(x, 0),
    "cat samples": lambda x: torch.cat([x, x]),
    "split samples": lambda x: x.split(2),
    "flip samples": lambda x: x.flip(0),
    "matmul over samples": lambda x: x.flatten(1).T @ x.flatten(1),
    "moved, then summed over": lambda x: x.transpose(0, 1).sum(1),
    "split the batch": lambda x: x.reshape(2, 2, N, N),
    "unknown op": lambda x: torch.cartesian_prod(x[:, 0, 0], x[:, 0, 0]),
    "kron, the batch as the inner factor": lambda x: torch.kron(torch.ones(2, 1, 1), x),
    "tensordot over the samples": lambda x: torch.tensordot(x, x, ([0], [0])),
    "einsum over the samples with an ellipsis": lambda x: torch.einsum("n...,n...->...", x, x),
    "einsum over the samples, implicitly": lambda x: torch.einsum("ntd,ntd", x, x),
    "addbmm over samples": lambda x: torch.addbmm(torch.zeros(N, N, dtype=x.dtype), x, x),
    "index_select samples": lambda x: x.index_select(0, torch.arange(N).flip(0)),
    "gather samples": lambda x: x.gather(0, torch.zeros(1, N, N, dtype=torch.long)),
    "topk samples": lambda x: x.topk(N, dim=0).values,
    "unfold samples": lambda x: x.unfold(0, 2, 1),
    "layer norm over samples": lambda x: F.layer_norm(x.transpose(0, 2), (N,)),
    "conv, batch elsewhere": lambda x: F.conv1d(x.transpose(0, 1), torch.ones_like(x[:, :, :1])),
    "pad samples": lambda x: F.pad(x, (0, 0, 0, 0, 1, 1)),
    "std unbiased flag": lambda x: x.std(True),
    "sum over no dims": lambda x: x.sum(dim=[]),
    "batched index on samples": lambda x: x[x[:, 0, 0].long().flip(0)],
}


@pytest.mark.parametrize("name", sorted(KEEP))
def test_batch_followed_exactly(name):
    for out, info in follow(KEEP[name]):
        assert isinstance(info, BatchDim), f"{name}: {info}"
        front = to_front(out, info, N)
        for n in range(N):
            assert bool((front[n] == n).all()), f"{name}: dimension {info} is not the batch"


MOVED = {  # ops that change each sample's values, and where they leave the batch
    # (a dimension appended: as many classes or powers as samples, taken for broadcasting)
    "one-hot of each sample's id": (lambda x: F.one_hot(x[:, 0, 0].long(), N), BatchDim(0)),
    "each sample's Vandermonde row": (lambda x: torch.vander(x[:, 0, 0]), BatchDim(0)),
    "conv_tbc with the batch second": (
        lambda x: torch.conv_tbc(x.transpose(0, 1).contiguous(), torch.ones(1, N, N, dtype=x.dtype),
                                 torch.zeros(N, dtype=x.dtype)),
        BatchDim(1),
    ),
    "ctc losses of each sample": (
        lambda x: F.ctc_loss(x.transpose(0, 1).log_softmax(2), torch.ones(N, 2, dtype=torch.long),
                             torch.full((N,), N), torch.full((N,), 2), reduction="none"),
        BatchDim(0),
    ),
    "ctc loss with the batch first": (
        lambda x: F.ctc_loss(x.log_softmax(2), torch.ones(N, 2, dtype=torch.long),
                             torch.full((N,), N), torch.full((N,), 2), reduction="none"),
        Lost,
    ),
    "outer products of two samples' vectors (addr)": (
        lambda x: torch.addr(torch.zeros(N, N, dtype=x.dtype), x[:, 0, 0], x[:, 0, 1]),
        Lost,
    ),
    "addr of each sample's row and a constant": (
        lambda x: torch.addr(torch.zeros(N, 3, dtype=x.dtype), x[:, 0, 0],
                             torch.ones(3, dtype=x.dtype)),
        BatchDim(0),
    ),
    "conv_tbc over the samples": (
        lambda x: torch.conv_tbc(x, torch.ones(3, N, N, dtype=x.dtype),
                                 torch.zeros(N, dtype=x.dtype), 1),
        Lost,
    ),
    "each sample's determinant": (lambda x: torch.linalg.det(x), BatchDim(0)),
    "each sample's inverse": (lambda x: torch.inverse(x + 9 * torch.eye(N)), BatchDim(0)),
    "each sample's singular values": (lambda x: torch.linalg.svd(x)[1], BatchDim(0)),
    "each time step's matrix": (lambda x: torch.linalg.det(x.unsqueeze(-1) * x[..., None, :]),
                                BatchDim(0)),
    "the batch behind the matrices": (lambda x: torch.linalg.inv((x.movedim(0, 1)[..., None] + 1)
                                      * torch.eye(N)), BatchDim(1)),
    "each sample's matrix norm": (lambda x: torch.linalg.matrix_norm(x), BatchDim(0)),
    "each sample's matrix norm by linalg.norm": (
        lambda x: torch.linalg.norm(x, "nuc", (1, 2)), BatchDim(0)),
    "a norm over features": (lambda x: torch.linalg.norm(x, dim=-1), BatchDim(0)),
    "cosine similarities within each sample": (
        lambda x: F.cosine_similarity(x, x + 1, dim=2), BatchDim(0)),
    "cosine similarities, broadcast": (
        lambda x: F.cosine_similarity(x.transpose(0, 1), torch.ones(N), dim=-1), BatchDim(1)),
    "pairwise distances, keepdim": (
        lambda x: F.pairwise_distance(x, x + 1, keepdim=True), BatchDim(0)),
    "a 2-d spectrum of each sample": (lambda x: torch.fft.fft2(x).abs(), BatchDim(0)),
    "an n-d spectrum over other dimensions": (
        lambda x: torch.fft.rfftn(x, dim=(1, 2)).abs(), BatchDim(0)),
    "the matrix norm over other dimensions": (
        lambda x: torch.linalg.matrix_norm(x, dim=(0, 2)), Lost),
    "distances to a codebook": (lambda x: torch.cdist(x, TABLE[:, None]), BatchDim(0)),
    "distances of a codebook to each sample": (lambda x: torch.cdist(TABLE, x[:, 0]),
                                               BatchDim(1)),
    "an LSTM cell's step": (  # (a state of another size than the input's features)
        lambda x: torch.lstm_cell(x[:, 0], (x[:, 1, :2], x[:, 2, :2]), CELL, CELL[:, :2])[1],
        BatchDim(0)),
    "a GRU cell's step from a zero state": (
        lambda x: torch.gru_cell(x[:, 0], x.new_zeros(N, 2), CELL[:6], CELL[:6, :2]),
        BatchDim(0)),
    "a GRU cell's step, the batch second": (
        lambda x: torch.gru_cell(x[:, 0].T, x[:, 1, :2], CELL[:6], CELL[:6, :2]), Lost),
    "differences over time": (lambda x: x.diff(dim=1), BatchDim(0)),
    "a linear layer's output features from the samples' weights": (
        lambda x: F.linear(torch.ones(2, N, dtype=x.dtype), x[:, 0]), BatchDim(1)),
    "a bilinear layer's output features from the samples' weights": (
        lambda x: F.bilinear(torch.ones(2, N, dtype=x.dtype), torch.ones(2, N, dtype=x.dtype), x),
        BatchDim(1)),
    "a norm's channels from the samples' weight": (
        lambda x: F.group_norm(torch.ones(2, N, 3, dtype=x.dtype), 1, x[:, 0, 0]), BatchDim(1)),
    "a convolution's output channels from the samples' weights": (
        lambda x: F.conv1d(torch.ones(2, N, 3, dtype=x.dtype), x[:, :, :1]), BatchDim(1)),
    "a transposed convolution's output channels from the samples' weights": (
        lambda x: F.conv_transpose1d(
            torch.ones(2, N, 3, dtype=x.dtype), x[:, :, :1].transpose(0, 1)),
        BatchDim(1)),
    "a transposed convolution contracting the samples of its weight": (
        lambda x: F.conv_transpose1d(torch.ones(2, N, 3, dtype=x.dtype), x[:, :, :1]), Lost),
    "a linear layer's bias of each sample broadcast over the features": (  # (bias [N, 1])
        lambda x: F.linear(torch.ones(N, N, dtype=x.dtype), torch.ones(N, N, dtype=x.dtype),
                           x[:, :1, 0]), BatchDim(0)),
    "a linear layer's bias of each sample": (
        lambda x: F.linear(x[:, 0], torch.ones(N, N, dtype=x.dtype), x[:, 1]), BatchDim(0)),
    "each sample written into a slice of its own": (
        lambda x: torch.select_scatter(torch.zeros(N, 2, N, N, dtype=x.dtype), x, 1, 0),
        BatchDim(0)),
    "each sample written into a slice of its own, the batch second": (
        lambda x: torch.select_scatter(torch.zeros(2, N, N, N, dtype=x.dtype), x, 0, 1),
        BatchDim(1)),
    "a slice of each sample scattered into zeros": (
        lambda x: torch.slice_scatter(torch.zeros(N, N, 2 * N, dtype=x.dtype), x, 2, 0, N),
        BatchDim(0)),
    "a transpose copied": (lambda x: torch.transpose_copy(x, 0, 1), BatchDim(1)),
    "a mixture of experts' gates scattered into each sample's row": (
        lambda x: torch.zeros(N, N, dtype=x.dtype).scatter(
            1, x[:, 0].topk(2, dim=1).indices, x[:, 0].topk(2, dim=1).values.softmax(1)),
        BatchDim(0)),
    "nothing of the samples scattered by an empty index": (
        lambda x: torch.zeros(N, N, dtype=x.dtype).scatter(
            1, torch.zeros(N, 0, dtype=torch.long), x[:, 0, :0]), Lost),
    "the samples' values scattered into some rows": (
        lambda x: torch.zeros(2 * N, N, dtype=x.dtype).scatter(
            1, torch.zeros(N, 1, dtype=torch.long), x[:, 0, :1]), Lost),
    "a permutation copied": (lambda x: torch.permute_copy(x, (2, 0, 1)), BatchDim(1)),
    "a conjugate transpose": (lambda x: x[:, 0].H, BatchDim(1)),
    "sub-tensors renormalised, the input by keyword": (
        lambda x: torch.renorm(input=x, p=2, dim=1, maxnorm=0.5), Lost),
    "a linear layer over the batch, the input by keyword": (
        lambda x: F.linear(input=x[:, 0].T, weight=torch.ones(2, N, dtype=x.dtype)), Lost),
    "each sample's values multiplied together within it": (
        lambda x: _index_reduced(x, within=True), BatchDim(0)),
    "prelu's channels from the samples' weight": (
        lambda x: F.prelu(torch.ones(2, N, 3, dtype=x.dtype), x[:, 0, 0]), BatchDim(1)),
    "differences along the batch": (lambda x: x.diff(dim=0), Lost),
    "power-average pooling over time": (lambda x: F.lp_pool1d(x, 2, 2), BatchDim(0)),
    "a depthwise convolution of the samples as channels": (
        lambda x: F.conv1d(x[:, 0], torch.ones(2 * N, 1, 2, dtype=x.dtype), groups=N),
        BatchDim(0, 2)),
    "samples flattened into a grouped convolution's channels": (
        lambda x: F.conv2d(x.reshape(1, N * N, N)[..., None], torch.ones(N, N, 1, 1,
                           dtype=x.dtype), groups=N), BatchDim(1)),
    "a convolution mixing the samples' channels in a group": (
        lambda x: F.conv1d(x[:, 0], torch.ones(2, N // 2, 2, dtype=x.dtype), groups=2), Lost),
    "the LM head's loss of each token, rows flattened": (
        lambda x: __import__("leanprop").chunked_linear_cross_entropy(
            x.reshape(N * N, N), torch.ones(5, N, dtype=x.dtype),
            torch.zeros(N, N, dtype=torch.long), reduction="none"),
        BatchDim(0)),
    "cross products without a dimension, along the first of size 3": (
        lambda x: _implicit(lambda t: torch.cross(t, t.roll(1, 1)), x[:, :3]), BatchDim(0)),
    "cross products without a dimension, broadcast": (
        lambda x: _implicit(lambda t: torch.cross(torch.ones(1, 3, 1, dtype=t.dtype), t),
                            x[:, :3]), BatchDim(0)),
    "bags of ids weighed by each sample's weights": (
        lambda x: F.embedding_bag(torch.zeros(N, 2, dtype=torch.long), TABLE,
                                  per_sample_weights=x[:, 0, :2], mode="sum"), BatchDim(0)),
    "bags by offsets weighed by the samples' weights": (
        lambda x: F.embedding_bag(torch.zeros(N, dtype=torch.long), TABLE, torch.arange(N),
                                  per_sample_weights=x[:, 0, 0], mode="sum"), Lost),
    "power-average pooling in 3-d": (
        lambda x: F.lp_pool3d(x[:, None, None].expand(N, 1, 2, N, N), 2, 2), BatchDim(0)),
    "max values put back at their positions (max_unpool1d)": (
        lambda x: F.max_unpool1d(*F.max_pool1d(x, 2, return_indices=True), 2), BatchDim(0)),
    "max values put back in 2-d": (
        lambda x: F.max_unpool2d(*F.max_pool2d(x[:, None], 2, return_indices=True), 2),
        BatchDim(0)),
    "max values put back in 3-d": (
        lambda x: F.max_unpool3d(*F.max_pool3d(x[:, None, None].expand(N, 1, 2, N, N), 2,
                                               return_indices=True), 2), BatchDim(0)),
    "each sample's sampling grid from its transform": (
        lambda x: F.affine_grid(x[:, :2, :3], [N, 1, 5, 5], align_corners=False), BatchDim(0)),
    "each sample's 3-d sampling grid": (
        lambda x: F.affine_grid(x[:, :3], [N, 1, 2, 3, 3], align_corners=False), BatchDim(0)),
    "each sample's polynomial basis (linalg.vander)": (
        lambda x: torch.linalg.vander(x[:, 0, 0], N=3), BatchDim(0)),
    "the polynomial basis of each sample's features, the batch second": (
        lambda x: torch.linalg.vander(x[:, 0].T), BatchDim(1)),
    "a softmax left to its legacy dimension, the second of a matrix": (
        lambda x: _implicit(F.softmax, x[:, 0]), BatchDim(0)),
    "a softmin left to its legacy dimension": (
        lambda x: _implicit(F.softmin, x[:, 0]), BatchDim(0)),
    "padded along time, the batch second": (
        lambda x: F.pad(x.transpose(0, 1), (0, 0, 0, 0, 1, 1)), BatchDim(1)),
}  # fmt: skip
TABLE = torch.arange(N, dtype=torch.float64)[:, None].expand(N, N).clone()
SOLVE = 3 * torch.eye(N, dtype=torch.float64) + 0.1 * torch.arange(N * N).view(N, N) / N**2
CELL = torch.full((8, N), 0.1, dtype=torch.float64)  # (an RNN cell's weights, H = 2)


def test_a_batch_of_two_taken_as_complex_pairs_is_lost():
    """``view_as_complex`` of a tensor whose last dimension is the batch (two samples): each
    complex number holds both samples; the complex views of other dimensions keep it."""
    tracker = BatchTracker(())
    tracker.n = 2
    x = torch.arange(2, dtype=torch.float64).expand(3, 2).clone()
    tracker.mark(x, BatchDim(1))
    with Follow(tracker):
        pairs = torch.view_as_complex(x)
        kept = torch.view_as_real(torch.view_as_complex(torch.stack([x.T, x.T], -1)))
    assert isinstance(tracker.info(pairs), Lost)
    assert tracker.info(kept) == BatchDim(0)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_batch_followed_through_ops_that_change_the_values(name):
    op, expected = MOVED[name]
    (_, info), *_ = follow(op)
    if expected is Lost:
        assert isinstance(info, Lost), f"{name}: {info}"
    else:
        assert info == expected, f"{name}: {info}"


@pytest.mark.parametrize("name", sorted(LOSE))
def test_batch_lost_where_samples_are_selected_or_mixed(name):
    for _out, info in follow(LOSE[name]):
        assert isinstance(info, Lost), f"{name}: {info}"


PICKS = {  # picks of the samples, and which sample each position along their dimension holds
    "a slice": (lambda x: x[1:3], [1, 2]),
    "a slice of a slice": (lambda x: x[1:][1:], [2, 3]),
    "a slice of a slice, by step": (lambda x: x[::2][1:], [2]),
    "a list index": (lambda x: x[[3, 1]], [3, 1]),
    "an index tensor into a slice": (lambda x: x[1:][torch.tensor([2, -3])], [3, 1]),
    "a mask of a slice": (lambda x: x[1:][torch.tensor([True, False, True])], [1, 3]),
    "split_with_sizes": (lambda x: x.split_with_sizes([1, 3])[1], [1, 2, 3]),
    "tensor_split by sections": (lambda x: torch.tensor_split(x, 3)[1], [2]),
    "tensor_split by sections, the first": (lambda x: torch.tensor_split(x, 3)[0], [0, 1]),
    "tensor_split by indices": (lambda x: torch.tensor_split(x, [1, -1])[1], [1, 2]),
    "tensor_split by an index tensor": (
        lambda x: torch.tensor_split(x, torch.tensor([3]))[1], [3]),
    "vsplit": (lambda x: torch.vsplit(x, [3])[0], [0, 1, 2]),
    "hsplit, the batch second": (lambda x: torch.hsplit(x.transpose(0, 1), 2)[1], [2, 3]),
    "dsplit, the batch third": (lambda x: torch.dsplit(x.movedim(0, 2), [1])[1], [1, 2, 3]),
    "chunk, then moved": (lambda x: x.chunk(2)[1].transpose(0, 2), [2, 3]),
    "a slice flipped": (lambda x: x[:3].flip(0), [2, 1, 0]),
    "a slice rolled": (lambda x: x[1:].roll(1, 0), [3, 1, 2]),
    "a slice permuted": (lambda x: x[:3].index_select(0, torch.tensor([2, 0, 1])), [2, 0, 1]),
    "parts put together in another order": (lambda x: torch.cat([x[2:], x[:1]]), [2, 3, 0]),
    "gathered losses": (lambda x: x[:, 0, 0].gather(0, torch.tensor([3, 3, 0])), [3, 3, 0]),
    "taken losses": (lambda x: x[:, 0, 0].take(torch.tensor([1, -1])), [1, 3]),
    "losses by masked_select": (
        lambda x: x[:, 0, 0].masked_select(torch.tensor([False, True, True, False])), [1, 2]),
    "a slice through a layer's ops": (
        lambda x: (x[2:] @ torch.ones(N, N).double() / N).relu(), [2, 3]),
    "a flipped batch's first half": (lambda x: x.flip(0)[:2], [3, 2]),
    "a rolled batch's second chunk": (lambda x: x.roll(1, 0).chunk(2)[1], [1, 2]),
    "a permuted batch's first split": (lambda x: x[PERM].split(2)[0], [2, 0]),
    "flipud, then a slice": (lambda x: x.flipud()[:2], [3, 2]),
    "one of each group, unbound": (lambda x: x.view(2, 2, N, N).unbind(1)[1], [1, 3]),
    "parts put together by keyword": (lambda x: torch.cat(tensors=[x[3:], x[:1]]), [3, 0]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PICKS))
def test_picks_say_which_samples_each_position_holds(name):
    """A pick of the samples is followed as a batch of them: its ``picks`` say which sample
    each position along its dimension holds (the probe holds sample n's index n)."""
    op, expected = PICKS[name]
    ((out, info),) = follow(op)
    assert type(info) is Selected and list(info.picks) == expected, f"{name}: {info}"
    if len(expected) == 1:  # (one sample: in no dimension)
        assert info.dim is None and bool((out == expected[0]).all()), f"{name}: {info}"
        return
    front = out.movedim(info.dim, 0)
    assert [int(v) for v in front.reshape(len(front), -1)[:, 0]] == expected
    for j, n in enumerate(expected):
        assert bool((front[j] == n).all()), f"{name}: position {j} is not sample {n}"


@pytest.mark.parametrize("name", [*KEEP, *LOSE])
def test_ops_on_batched_operands_alone_are_followed_alike_the_quick_way(name):
    """The op interception follows an op whose operands carry the batch or are constants
    (no parameter among them) with ``batched_only`` + ``propagate_batched``: every op gives
    what ``propagate`` gives."""
    op = {**KEEP, **LOSE}[name]
    torch.manual_seed(0)
    careful = [info for _, info in follow(op)]
    torch.manual_seed(0)
    quick = [info for _, info in follow(op, quick=True)]
    assert quick == careful


def test_ops_on_parameters_are_not_taken_the_quick_way():
    """An operand that is a tracked parameter, or derives from one, sends the op the careful
    way (``batched_only`` answers None): such an op may be a use to capture."""
    w = torch.nn.Parameter(torch.randn(N))
    tracker = BatchTracker([w])
    tracker.n = N
    x = torch.randn(N, N)
    tracker.mark(x, BatchDim(0))
    derived = w * 2
    tracker.mark_derived(derived, frozenset({w}))
    assert tracker.batched_only((x, w), {}) is None
    assert tracker.batched_only((x,), {"other": derived}) is None
    assert tracker.batched_only(([x, derived],), {}) is None
    assert tracker.batched_only((x, torch.randn(N)), {}) == [(0, x, BatchDim(0))]
    assert tracker.batched_only((torch.randn(N),), {}) == []


def test_merged_infos_prefer_sums_of_samples_in_a_fixed_order():
    """Joining a sum over samples with another lost batch gave whichever a set listed first
    (PYTHONHASHSEED decided whether a later penalty was watched)."""
    infos = [Lost("z"), Combined("b"), Lost("a"), Combined("a")]
    for k in range(len(infos)):
        merged = merge_infos(set(infos[k:] + infos[:k]))
        assert merged == Combined("a")


def test_elementwise_names_are_taken_by_no_branch():
    """``result_dim`` sends the names in ``_ELEMENTWISE`` to ``_elementwise`` before its other
    branches (the hot path): none of them may be a name some branch handles otherwise."""
    rules = importlib.import_module("leanprop.per_sample.batch.rules")
    source = inspect.getsource(rules.result_dim).split("_ELEMENTWISE:", 1)[1]
    literals = set(re.findall(r'"([a-z_0-9]+)"', source))
    sets = [v for k, v in vars(rules).items() if k.isupper() and k in source]
    named = literals.union(*(s for s in sets if isinstance(s, set | frozenset | dict | tuple)))
    assert sets and "linear" in named and "view" in named  # (the search reads the branches)
    assert not (rules._ELEMENTWISE & named)


CODEBOOK = torch.randn(5, N, dtype=torch.float64, requires_grad=True)


def mask_of(x):  # (a mask of the samples from their values, without grad)
    return (x[:, 0, 0].detach() > 0).double()


WEIGHTS = torch.randn(N, dtype=torch.float64, requires_grad=True)
KERNEL = torch.ones(1, N, 2, dtype=torch.float64)


def _mixed(op):
    """Why ``op(x, y)``'s result mixes samples (x ``[N, N, N]`` requires grad, y labels)."""
    tracker = BatchTracker(())
    tracker.n = N
    x = torch.randn(N, N, N, dtype=torch.float64, requires_grad=True) * 1
    tracker.mark(x, BatchDim(0))
    y = torch.arange(N).flip(0)
    with Follow(tracker):
        out = op(x, y)
    return tracker.mixed(out)


PER_SAMPLE_LOSSES = {  # each term depends on one sample: per-sample gradients are defined
    "a mean squared error against the batch's own targets, reduced": lambda x, y: F.mse_loss(
        x[:, 0], x.detach()[:, 1]
    ),
    "a binary cross-entropy with per-sample weights [N, 1]": lambda x, y: (
        F.binary_cross_entropy_with_logits(
            x[:, 0], x.detach()[:, 1].sigmoid(), weight=x.detach()[:, 0, :1].abs()
        )
    ),
    "a flipped batch flattened, elementwise": lambda x, y: x.flip(0).reshape(-1).sin().sum(),
    "a per-sample weight into a grouped convolution": lambda x, y: F.conv1d(
        x[:, :2, :2].reshape(1, 2 * N, 2), x[:, :2, :1].reshape(2 * N, 1, 1), groups=2 * N
    ).sum(),
    "a CTC loss summed, its targets the input's": lambda x, y: F.ctc_loss(
        x.transpose(0, 1).log_softmax(2),
        x.detach()[:, 0, :2].long().clamp(1, 2),
        torch.full((N,), N),
        torch.full((N,), 2),
        reduction="sum",
    ),
    "token losses weighed by the input's weights": lambda x, y: (
        x.square().sum(2).T @ x.detach()[:, 0, 0]
    ).sum(),
    "a term without grad, then the loss added to it in place": lambda x, y: _added_in_place(x),
    "one of two tensors made 2-d": lambda x, y: (
        torch.atleast_2d(x[:, 0, 0], x.softmax(0)[:, 0, 0])[0].sin().sum()
    ),
    "vecdot along features named dim=0": lambda x, y: (
        torch.linalg.vecdot(x[:, 0].T, x[:, 1].T, dim=0).sin().sum()
    ),
    "each sample's trace, by keywords": lambda x, y: (
        x.diagonal(dim1=-2, dim2=-1).sum(-1).sin().sum()
    ),
    "transposed by keywords": lambda x, y: x.transpose(dim0=1, dim1=2).sin().sum(),
    "permuted by keyword": lambda x, y: x.permute(dims=(0, 2, 1)).sin().sum(),
    "tiled by fewer repeats than dimensions": lambda x, y: x.tile(2).sin().sum(),
    "a masked token loss (masked_select)": lambda x, y: torch.masked_select(
        x.square(), x.detach() > 0
    ).sum(),
    "each sample's spectrogram": lambda x, y: (
        torch.stft(x[:, 0], 4, window=torch.ones(4, dtype=x.dtype), return_complex=True)
        .abs()
        .sin()
        .sum()
    ),
    "trapezoid over time": lambda x, y: torch.trapezoid(x, dim=1).sin().sum(),
    "running trapezoids over time": lambda x, y: torch.cumulative_trapezoid(x, dim=2).sin().sum(),
    "sum_to_size over time": lambda x, y: x.sum_to_size(N, 1, N).sin().sum(),
    "a product of matrices from each sample's rows": lambda x, y: (
        torch.linalg.multi_dot(
            [x[:, 0], torch.ones(N, 2, dtype=x.dtype), torch.ones(2, 3, dtype=x.dtype)]
        )
        .sin()
        .sum()
    ),
    "a bilinear form of the batch and a constant, summed": lambda x, y: F.bilinear(
        x[:, 0].T, torch.ones(N, 2, dtype=x.dtype), torch.ones(3, N, 2, dtype=x.dtype)
    ).sum(),
    "each sample's matrix through cholesky_inverse": lambda x, y: (
        torch.cholesky_inverse(torch.eye(N, dtype=x.dtype) + 0.1 * x.tril()).sin().sum()
    ),
    "each sample's triangular solve": lambda x, y: (
        torch.linalg.solve_triangular(SOLVE.triu(), x, upper=True).sin().sum()
    ),
    "inner products with a constant": lambda x, y: (
        torch.inner(x[:, 0], torch.ones(N, dtype=x.dtype)).sin().sum()
    ),
    "inner products of constants with the samples": lambda x, y: (
        torch.inner(torch.ones(2, N, dtype=x.dtype), x[:, 0]).sin().sum()
    ),
    "each sample's vecdot": lambda x, y: torch.linalg.vecdot(x[:, 0], x[:, 1]).sin().sum(),
    "ravelled, then viewed back": lambda x, y: x[:, 0].ravel().view(N, N).sin().sum(),
    "bags of each sample's weighted ids": lambda x, y: (
        F.embedding_bag(
            torch.zeros(N, 2, dtype=torch.long), TABLE, per_sample_weights=x[:, 0, :2], mode="sum"
        )
        .sin()
        .sum()
    ),
    "a linear layer over the batch, summed": lambda x, y: F.linear(
        x[:, 0].T, torch.ones(3, N, dtype=x.dtype)
    ).sum(),
    "sum": lambda x, y: x.square().sum(),
    "mean of per-sample sums": lambda x, y: x.flatten(1).square().sum(1).mean(),
    "cross-entropy": lambda x, y: F.cross_entropy(x[:, :, 0], y),
    "masked, over the count": lambda x, y: (
        (F.cross_entropy(x[:, :, 0], y, reduction="none") * (y > 0)).sum() / (y > 0).sum()
    ),
    "boolean-mask selection": lambda x, y: F.cross_entropy(x[:, :, 0][y > 1], y[y > 1]),
    "labels of other samples": lambda x, y: (x[:, 0, 0] * y.flip(0)).sum(),
    "a function of the summed loss": lambda x, y: x.square().sum() ** 2,
    "reordered with its labels": lambda x, y: F.cross_entropy(x[:, :, 0].flip(0), y.flip(0)),
    "per-sample losses sorted and summed": lambda x, y: x.square().sum((1, 2)).sort().values.sum(),
    "hard-example mining": lambda x, y: (
        F.cross_entropy(x[:, :, 0], y, reduction="none").sort(descending=True).values[:3].mean()
    ),
    "a reordered value squared": lambda x, y: x.flip(0).flip(0).square().sum(),
    # (functions of what the batch's values are, each term one sample's)
    "distances to a codebook": lambda x, y: torch.cdist(x[:, 0], CODEBOOK).amin(1).sum(),
    "distances within each sample": lambda x, y: torch.cdist(x, x).sum(),
    "per-sample dice": lambda x, y: (
        (x.sigmoid() * (y[:, None, None] > 1)).sum((1, 2)) / (x.sigmoid().sum((1, 2)) + 1)
    ).mean(),
    "per-sample determinants": lambda x, y: torch.linalg.det(x).sum(),
    "per-sample inverses": lambda x, y: torch.inverse(x + 9 * torch.eye(N)).sum(),
    "per-sample matrix norms": lambda x, y: torch.linalg.matrix_norm(x).square().sum(),
    "a layer norm over each sample's features": lambda x, y: F.layer_norm(x, (N,)).sum(),
    "differences along time": lambda x, y: x.diff(dim=2).square().sum(),
    "a spectrum along time": lambda x, y: torch.fft.rfft(x, dim=-1).abs().sum(),
    "a quantile of the losses": lambda x, y: torch.quantile(x.square().sum((1, 2)), 0.7),
    "the norm of everything": lambda x, y: x.norm(),
    "a function of several summed losses": lambda x, y: (x.square().mean((0, 2)) * WEIGHTS).sum(),
    "learned task weights": lambda x, y: (
        torch.exp(-WEIGHTS) * x.square().mean((0, 2)) + WEIGHTS
    ).sum(),
    "the worst group's loss": lambda x, y: (
        torch.zeros(2, dtype=x.dtype).index_add(0, y % 2, x.square().sum((1, 2))) / 2
    ).amax(),
    "a selection over the batch squared": lambda x, y: x.amax(0).square().sum(),
    "summed over the batch, by counts": lambda x, y: (
        x.square().sum(0) / x.detach().abs().sum(0)
    ).sum(),
    "a mean with learned weights (two summed values)": lambda x, y: (
        (x.square().sum((1, 2)) * x[:, 0, 0].sigmoid()).sum() / x[:, 0, 0].sigmoid().sum()
    ),
    "several targets per sample": lambda x, y: F.cross_entropy(
        x[:, :, 0].repeat_interleave(2, dim=0), y.repeat_interleave(2)
    ),
    "the median over the batch": lambda x, y: x.nanmedian(dim=0).values.square().sum(),
    "a quantile over the batch squared": lambda x, y: torch.quantile(x, 0.75, 0).square().sum(),
    "centred by a detached mean": lambda x, y: (x - x.mean(0).detach()).square().sum(),
    "scaled by a detached batch statistic": lambda x, y: (
        (x / x.detach().abs().mean(0)).square().sum()
    ),
    "weights over a token count, clamped": lambda x, y: (
        (x.square().sum((1, 2)) * mask_of(x) / mask_of(x).sum()).clamp(max=10).sum()
    ),
    "stacked scalar losses": lambda x, y: (
        torch.stack([x.square().mean(), x.abs().mean()]).log().sum()
    ),
    "an expanded total squared": lambda x, y: x.square().mean().expand(2).square().sum(),
    "interpolated with the samples as channels": lambda x, y: (
        F.interpolate(x.transpose(0, 1), scale_factor=2).square().sum()
    ),
    "differences with a batched prepend": lambda x, y: (
        torch.diff(x, 1, 2, x[..., :1]).square().sum() + torch.diff(x, 1, 2, prepend=x).sum()
    ),
    "a hinge on each class's mean loss": lambda x, y: (
        F.relu(x.square().mean((0, 2)) - 1).sum() + x.mean(0).clamp(-1, 1).abs().sum()
    ),
    "a view against its detached partner": lambda x, y: (
        -F.cosine_similarity(x[: N // 2, 0], x[N // 2 :, 0].detach()).sum()
    ),
    "the same samples, picked twice": lambda x, y: (
        x[1:3]
        * x.narrow(0, 1, 2)
        * x.split([1, 2, 1])[1]
        * x[torch.tensor([False, True, True, False])]
    ).sum(),
    "the same mask twice": lambda x, y: (x[y > 1] * x[y > 1]).sum(),
    "one sample, indexed and selected": lambda x, y: (x[-1] * x.select(0, N - 1)).sum(),
    "a loss for each part": lambda x, y: (
        F.cross_entropy(x[: N // 2, :, 0], y[: N // 2]) + x[N // 2 :].square().sum()
    ),
    "the batch's parts put back together": lambda x, y: (
        torch.cat([x[:2], x[2:] * 2]).square().sum()
    ),
    "the batch's parts put back together, then met with it": lambda x, y: (
        torch.cat([x[:2], x[2:]]) * x
    ).sum(),
    "the same samples by index tensor and by slice": lambda x, y: (
        x[torch.tensor([1, 2])] * x[1:3] * x[torch.tensor([-3, 2])]
    ).sum(),
    "per-sample losses stacked and averaged": lambda x, y: torch.stack(
        [x[i].square().sum() for i in range(N)]
    ).mean(),
    "each sample beside itself": lambda x, y: torch.stack([x, x.exp()], 1).logsumexp(1).sum(),
    "an expert-balance loss": lambda x, y: (
        x[:, 0].softmax(-1).mean(0) * torch.linspace(0, 1, N, dtype=x.dtype)
    ).sum(),
    "a pick of a pick, and the same samples by a slice": lambda x, y: (
        x[:3][1:] * x[1:3] * x[1:][:2]
    ).sum(),
    "chunk and tensor_split alike": lambda x, y: (
        x.chunk(2)[1] * torch.tensor_split(x, 2)[1]
    ).sum(),
    "all of the batch by a slice, met with it": lambda x, y: (x[:N] * x.narrow(0, 0, N) * x).sum(),
    "flipped twice, met with it": lambda x, y: (x.flip(0).flip(0) * x).sum(),
    "a part's samples reordered with their labels": lambda x, y: F.cross_entropy(
        x[:3, :, 0].flip(0), torch.arange(3).flip(0)
    ),
    "per-sample losses gathered in order": lambda x, y: (
        x.square().sum((1, 2)).gather(0, torch.arange(N)) * x[:, 0, 0]
    ).sum(),
    "samples in groups, squared": lambda x, y: x.view(2, 2, N, N).square().sum(),
    "each group's mean loss, averaged": lambda x, y: (
        x.square().sum((1, 2)).view(2, 2).mean(1).mean()
    ),
    "the worst group's mean loss": lambda x, y: x.square().sum((1, 2)).view(2, 2).mean(1).amax(),
    "samples in groups, put back, met with the batch": lambda x, y: (
        x.view(2, 2, N, N).relu().view(N, N, N) * x
    ).sum(),
    "each sample's features in groups": lambda x, y: x.view(2, 2, N, N).sum((2, 3)).exp().sum(),
    "per-part losses stacked and averaged": lambda x, y: torch.stack(
        [
            F.cross_entropy(x[:2, :, 0], y[:2], reduction="none"),
            F.cross_entropy(x[2:, :, 0], y[2:], reduction="none"),
        ]
    ).mean(),
    "parts side by side, squared": lambda x, y: torch.cat([x[:2], x[2:]], 1).square().sum(),
    "the worse half": lambda x, y: torch.stack(x.sum((1, 2)).chunk(2)).sum(1).amax(),
    "a flipped batch's halves put back, with flipped labels": lambda x, y: F.cross_entropy(
        torch.cat([x.flip(0)[:2], x.flip(0)[2:]])[:, :, 0], y.flip(0)
    ),
    "samples flattened with time, the same parts by narrow and a slice": lambda x, y: (
        x.flatten(0, 1).narrow(0, 0, 2 * N) * x.flatten(0, 1)[: 2 * N]
    ).sum(),
    "positions of one sample stacked, softmaxed": lambda x, y: (
        torch.stack([x.flatten(0, 1)[0], x.flatten(0, 1)[1]]).softmax(0) * 2
    ).sum(),
    "the maximum within each group, squared": lambda x, y: (
        x.view(2, 2, N, N).amax(1).square().sum()
    ),
    "values chosen from different samples, weighed linearly": lambda x, y: (
        x.amax(0) @ torch.ones(N, dtype=x.dtype)
    ).sum(),
}
MIXING_LOSSES = {  # a sample's term reads other samples' values
    "a mean squared error against the flipped batch's targets, reduced": lambda x, y: F.mse_loss(
        x[:, 0], x.detach()[:, 0].flip(0)
    ),
    "a binary cross-entropy with per-sample weights [N] along the classes": lambda x, y: (
        F.binary_cross_entropy_with_logits(
            x[:, 0], x.detach()[:, 1].sigmoid(), weight=x.detach()[:, 0, 0].abs()
        )
    ),
    "a binary cross-entropy with a pos_weight [N] along the classes": lambda x, y: (
        F.binary_cross_entropy_with_logits(
            x[:, 0],
            x.detach()[:, 1].sigmoid(),
            pos_weight=x.detach()[:, 0, 0].abs(),
            reduction="none",
        ).sum()
    ),
    "torch's binary cross-entropy with a pos_weight [N] passed by position": lambda x, y: (
        torch.binary_cross_entropy_with_logits(
            x[:, 0], x.detach()[:, 1].sigmoid(), None, x.detach()[:, 0, 0].abs()
        )
    ),
    "a binary cross-entropy with its weight [N] passed by position": lambda x, y: (
        F.binary_cross_entropy(x[:, 0].sigmoid(), x.detach()[:, 1].sigmoid(), x.detach()[:, 0, 0])
    ),
    "a rolled batch flattened, times the batch flattened": lambda x, y: (
        (x.roll(1, 0).reshape(-1) * x.reshape(-1)).sin().sum()
    ),
    "a per-sample weight reordered into a grouped convolution": lambda x, y: F.conv1d(
        x[:, :2, :2].reshape(1, 2 * N, 2), x[:, :2, :1].flip(0).reshape(2 * N, 1, 1), groups=2 * N
    ).sum(),
    "a masked selection softmaxed over its values": lambda x, y: (
        torch.masked_select(x, x.detach() > 0).softmax(0) * 2
    ).sum(),
    "values taken by flat positions, softmaxed": lambda x, y: (
        torch.take(x, torch.arange(6)).softmax(0) * 2
    ).sum(),
    "a reshape splitting the batch, softmaxed across it": lambda x, y: (
        x[:, 0, :2].reshape(2, N).softmax(1) * 2
    ).sum(),
    "a softmax over the batch copied into a view of a buffer": lambda x, y: (
        _copied_into_a_view(x.softmax(0)).sin().sum()
    ),
    "predictions [N, 1] against targets [N] (a broadcast mse)": lambda x, y: _implicit(
        lambda t: F.mse_loss(t[:, 0, :1], t[:, 0, 1]), x
    ),
    "predictions [N, 1] against the input's targets [N]": lambda x, y: _implicit(
        lambda t: F.mse_loss(t[:, 0, :1], t.detach()[:, 0, 1]), x
    ),
    "a product of matrices by keyword, contracting the batch": lambda x, y: (
        torch.linalg.multi_dot(tensors=[torch.ones(2, N, dtype=x.dtype), x[:, 0]]).sin().sum()
    ),
    "vecdot along the batch, named dim=0": lambda x, y: (
        torch.linalg.vecdot(x[:, 0], x[:, 1], dim=0).sin().sum()
    ),
    "a flip transposed by keywords, softmaxed": lambda x, y: (
        x.flip(0).transpose(dim0=0, dim1=1).softmax(1) * 2
    ).sum(),
    "a roll permuted by keyword, softmaxed": lambda x, y: (
        x.roll(1, 0).permute(dims=(1, 0, 2)).softmax(1) * 2
    ).sum(),
    "power-average pooling of an unbatched input whose positions are the samples": lambda x, y: (
        F.lp_pool1d(x[:, 0].T, 2, 2).sum()
    ),
    "average pooling of the samples as positions, then a non-linearity": lambda x, y: (
        F.avg_pool1d(x[:, 0].T, 2).sin().sum()
    ),
    "sum_to_size over the batch": lambda x, y: x.sum_to_size(1, N, N).sin().sum(),
    "trapezoid over the batch": lambda x, y: torch.trapezoid(x, dim=0).sin().sum(),
    "a spectrogram of the batch as one signal": lambda x, y: (
        torch.stft(x[:, 0, 0], 2, 1, window=torch.ones(2, dtype=x.dtype), return_complex=True)
        .abs()
        .sin()
        .sum()
    ),
    "each sample's values against another sample's data, without grad": lambda x, y: (
        (x * x.detach().flip(0)).sin().sum()
    ),
    "a solve with the samples as the rows of its right side": lambda x, y: (
        torch.linalg.solve(SOLVE, x[:, 0]).sin().sum()
    ),
    "a triangular solve of the samples' rows": lambda x, y: (
        torch.linalg.solve_triangular(SOLVE.triu(), x[:, 0], upper=True).sin().sum()
    ),
    "a Cholesky solve of the samples' rows": lambda x, y: (
        torch.cholesky_solve(x[:, 0], torch.linalg.cholesky(SOLVE @ SOLVE.T)).sin().sum()
    ),
    "the batch's matrix inverted through cholesky_inverse": lambda x, y: (
        torch.cholesky_inverse(torch.eye(N, dtype=x.dtype) + 0.1 * x[:, 0].tril()).sin().sum()
    ),
    "the batch as one matrix (tensorinv)": lambda x, y: (
        torch.linalg.tensorinv(x[:, 0] + 3 * torch.eye(N, dtype=x.dtype), 1).sin().sum()
    ),
    "inner products of the samples": lambda x, y: torch.inner(x[:, 0], x[:, 0]).sin().sum(),
    "vecdot over the batch, then a non-linearity": lambda x, y: (
        torch.linalg.vecdot(x[:, 0].T, x[:, 0].T).sin().sum()
    ),
    "an unknown op's values summed along a dimension": lambda x, y: (
        torch.block_diag(x[:, 0], x[:, 1]).sum(0).sin().sum()
    ),
    "an unknown op adding dimensions": lambda x, y: (
        torch.cartesian_prod(x[:, 0, 0], x[:, 0, 1]).sin().sum()
    ),
    "a bilinear form over the batch": lambda x, y: F.bilinear(
        x[:, 0].T, x[:, 0].T, torch.ones(2, N, N, dtype=x.dtype)
    ).sum(),
    "a linear layer over the flattened batch, then a non-linearity": lambda x, y: (
        F.linear(x[:, 0].flatten(), torch.ones(3, N * N, dtype=x.dtype)).sin().sum()
    ),
    "halves of the ravelled batch added, then a non-linearity": lambda x, y: (
        torch.stack(x[:, 0].ravel().chunk(2)).sum(0).sin().sum()
    ),
    "bags of several samples' weights, squared": lambda x, y: (
        F.embedding_bag(
            torch.zeros(N, dtype=torch.long),
            TABLE,
            torch.tensor([0, 2]),
            per_sample_weights=x[:, 0, 0],
            mode="sum",
        )
        .square()
        .sum()
    ),
    "multi_dot contracting the batch, then a non-linearity": lambda x, y: (
        torch.linalg.multi_dot([torch.ones(2, N, dtype=x.dtype), x[:, 0], x[0]]).sin().sum()
    ),
    "an RNN stepping over the batch": lambda x, y: (
        torch.rnn_tanh(
            x,
            torch.zeros(1, N, 2, dtype=x.dtype),
            [CELL[:2], CELL[:2, :2]],
            False,
            1,
            0.0,
            False,
            False,
            False,
        )[0]
        .sin()
        .sum()
    ),
    "centred over the batch": lambda x, y: (x - x.mean(0)).square().sum(),
    "normalised over the batch": lambda x, y: (x / x.norm(dim=0, keepdim=True)).sum(),
    "softmax over the batch": lambda x, y: (x.softmax(0) * x).sum(),
    "contrastive (o @ o.T)": lambda x, y: F.cross_entropy(x[:, :, 0] @ x[:, :, 0].T, y),
    "flipped over the batch": lambda x, y: (x.flip(0) * x).sum(),
    "reordered by an index": lambda x, y: (x[torch.tensor([1, 0, 2, 3])] * x).sum(),
    "all pairs, by einsum": lambda x, y: torch.einsum("nd,md->nm", x[:, 0], x[:, 0]).exp().sum(),
    "all pairs, by broadcasting": lambda x, y: F.cosine_similarity(
        x[:, None, 0], x[None, :, 0], dim=-1
    ).sum(),
    "a loss between samples": lambda x, y: F.mse_loss(x, x.flip(0)),
    "a running sum": lambda x, y: x.cumsum(0).square().sum(),
    # (statistics and matrices over the samples; functions of sums that keep more than one
    # value: the samples meet in each)
    "distances between samples": lambda x, y: torch.cdist(x[:, 0], x[:, 0]).sum(),
    "all pairwise distances": lambda x, y: torch.pdist(x[:, 0]).sum(),
    "a covariance over the batch": lambda x, y: torch.cov(x[:, 0].T).square().sum(),
    "a correlation over the batch": lambda x, y: torch.corrcoef(x[:, 0].T).square().sum(),
    "a standard deviation over the batch": lambda x, y: x.std(0).sum(),
    "the standard deviation of everything": lambda x, y: x.std(),
    "a variance over the batch": lambda x, y: torch.var_mean(x, 0)[0].sum(),
    "a log-sum-exp over the batch": lambda x, y: x.logsumexp(0).sum(),
    "a norm over the batch": lambda x, y: x.norm(dim=0).sum(),
    "a product over the batch": lambda x, y: x.prod(0).sum(),
    "a determinant over the batch": lambda x, y: torch.linalg.det(x[:, 0]),
    "an inverse over the batch": lambda x, y: torch.inverse(x[:, 0] + 9 * torch.eye(N)).sum(),
    "singular values over the batch": lambda x, y: torch.linalg.svdvals(x[:, 0]).sum(),
    "a nuclear norm over the batch": lambda x, y: torch.linalg.matrix_norm(x[:, 0], ord="nuc"),
    "a layer norm over the batch": lambda x, y: F.layer_norm(x[:, 0].T, (N,)).square().sum(),
    "a group norm over the batch": lambda x, y: F.group_norm(x.transpose(0, 1), 1).square().sum(),
    "a convolution over the batch": lambda x, y: F.conv1d(x[:, 0].T[None], KERNEL).square().sum(),
    "differences of samples": lambda x, y: x.diff(dim=0).square().sum(),
    "a spectrum over the batch": lambda x, y: torch.fft.rfft(x, dim=0).abs().sum(),
    "a batch sum squared": lambda x, y: x.sum(0).square().sum(),
    "a batch mean's inverse": lambda x, y: (1 / x.mean(0)).sum(),
    "a Gram matrix by einsum": lambda x, y: torch.einsum("nij,nkj->ik", x, x).square().sum(),
    "samples added into groups, squared": lambda x, y: (
        torch.zeros(2, N, N, dtype=x.dtype).index_add(0, y % 2, x).square().sum()
    ),
    "a softmax over the batch by torch.special": lambda x, y: (
        torch.special.softmax(x, 0) * x
    ).sum(),
    "a gumbel softmax over the batch": lambda x, y: (F.gumbel_softmax(x, dim=0) * x).sum(),
    "a log-sum-exp over the batch by torch.special": lambda x, y: torch.special.logsumexp(
        x, 0
    ).sum(),
    "an op leanprop does not know, along the batch": lambda x, y: (
        torch.cumulative_trapezoid(x, dim=0).square().sum()
    ),
    "all pairs, by einsum with an ellipsis": lambda x, y: (
        torch.einsum("n...,m...->nm", x, x).exp().sum()
    ),
    "a pair's halves (preference losses)": lambda x, y: F.logsigmoid(
        x.sum((1, 2))[: N // 2] - x.sum((1, 2))[N // 2 :]
    ).mean(),
    "two views chunked and compared": lambda x, y: F.cosine_similarity(*x[:, 0].chunk(2)).sum(),
    "positives ranked against negatives": lambda x, y: (
        (x[y > 1][:, None, 0, 0] - x[y <= 1][None, :, 0, 0]).relu().mean()
    ),
    "neighbours along the batch": lambda x, y: (x[1:] - x[:-1]).square().sum(),
    "one sample against another": lambda x, y: (x.select(0, 1) * x.unbind(0)[2]).sum(),
    "a softmax over the batch with a detached max": lambda x, y: (
        (x - x.amax(0).detach()).exp() / (x - x.amax(0).detach()).exp().sum(0)
    ).sum(),
    "a batch sum less a detached max, squared": lambda x, y: (
        (x.sum(0) - x.amax(0).detach()).square().sum()
    ),
    "samples added into groups by scatter_reduce": lambda x, y: (
        torch.zeros(2, N, N)
        .double()
        .scatter_reduce(0, (y % 2)[:, None, None].expand(N, N, N), x, reduce="sum")
        .square()
        .sum()
    ),
    "samples added into groups, source by keyword": lambda x, y: (
        torch.zeros(2, N, N).double().index_add(0, y % 2, source=x).square().sum()
    ),
    "a spectrum over the batch, dim by position": lambda x, y: (
        torch.fft.rfft(x, None, 0).abs().sum()
    ),
    "a 2-d spectrum over the batch": lambda x, y: torch.fft.fft2(x.transpose(0, 2)).abs().sum(),
    "contrastive, normalised by linalg.norm": lambda x, y: F.cross_entropy(
        (x[:, 0] / torch.linalg.norm(x[:, 0], dim=-1, keepdim=True))
        @ (x[:, 0] / torch.linalg.norm(x[:, 0], dim=-1, keepdim=True)).T,
        y,
    ),
    "cosine similarities softmaxed over the batch": lambda x, y: (
        F.cosine_similarity(x[:, 0], x[:, 1]).softmax(0) * x[:, 0, 0]
    ).sum(),
    "an inverse of samples, with its info": lambda x, y: torch.linalg.inv_ex(
        x[:, 0] + 9 * torch.eye(N)
    )[0].sum(),
    "each sample beside another, then a loss over them": lambda x, y: F.cross_entropy(
        torch.stack([x[:, 0, 0], x[:, 0, 0].flip(0)], 1), torch.zeros(N, dtype=torch.long)
    ),
    "in-batch negatives beside the positives": lambda x, y: F.cross_entropy(
        torch.cat([x[:, 0, :1], x[:, 1, :1].roll(1, 0)], 1), torch.zeros(N, dtype=torch.long)
    ),
    "per-sample losses stacked, then a log-sum-exp": lambda x, y: torch.stack(
        [x[i].square().sum() for i in range(N)]
    ).logsumexp(0),
    "views concatenated along the batch, then contrasted": lambda x, y: F.cross_entropy(
        torch.cat([x[:, 0], x[:, 1]]) @ torch.cat([x[:, 0], x[:, 1]]).T, torch.arange(2 * N)
    ),
    "a detached statistic concatenated along the batch, softmaxed": lambda x, y: (
        torch.cat([x.mean(0, keepdim=True).detach(), x]).softmax(0)[1:] * x
    ).sum(),
    "a pair's halves picked by index tensors": lambda x, y: F.logsigmoid(
        x.sum((1, 2))[torch.tensor([0, 2])] - x.sum((1, 2)).index_select(0, torch.tensor([1, 3]))
    ).mean(),
    "batch dice": lambda x, y: (
        2 * (x.sigmoid() * (y[:, None, None] > 1)).sum((0, 2)) / (x.sigmoid().sum((0, 2)) + 1)
    ).mean(),
    "a pair's halves by list indices": lambda x, y: F.logsigmoid(
        x.sum((1, 2))[[0, 1]] - x.sum((1, 2))[[2, 3]]
    ).mean(),
    "a pair's halves by gather": lambda x, y: F.logsigmoid(
        x.sum((1, 2)).gather(0, torch.tensor([0, 1]))
        - x.sum((1, 2)).gather(0, torch.tensor([2, 3]))
    ).mean(),
    "a pair's halves by take": lambda x, y: F.logsigmoid(
        x.sum((1, 2)).take(torch.tensor([0, 1])) - x.sum((1, 2)).take(torch.tensor([2, 3]))
    ).mean(),
    "a pair's halves by masked_select": lambda x, y: F.logsigmoid(
        x.sum((1, 2)).masked_select(y > 1) - x.sum((1, 2)).masked_select(y <= 1)
    ).mean(),
    "a pair's halves by split_with_sizes": lambda x, y: F.logsigmoid(
        torch.sub(*x.sum((1, 2)).split_with_sizes([2, 2]))
    ).mean(),
    "a pair's halves by vsplit": lambda x, y: (torch.vsplit(x, 2)[0] * torch.vsplit(x, 2)[1]).sum(),
    "a pair's halves side by side, then a loss over each pair": lambda x, y: F.cross_entropy(
        torch.stack([x.sum((1, 2))[:2], x.sum((1, 2))[2:]], 1), torch.zeros(2, dtype=torch.long)
    ),
    "a pair's halves concatenated beside each other": lambda x, y: (
        torch.cat([x[:2], x[2:]], 1).softmax(1) * 2
    ).sum(),
    "a pick's samples against each other": lambda x, y: (x[:2] * x[:2].flip(0)).sum(),
    "a pick's samples rolled against each other": lambda x, y: (x[1:] * x[1:].roll(1, 0)).sum(),
    "a pick of a pick against another": lambda x, y: (x[:3][1:2] * x[2:][:1]).sum(),
    "a softmax over a pick's samples": lambda x, y: (x[:3].softmax(0) * x[:3]).sum(),
    "a standard deviation over a pick's samples": lambda x, y: x[1:].std(0).sum(),
    "a pick's sum squared": lambda x, y: x[:2].sum(0).square().sum(),
    "rolled by different shifts": lambda x, y: (x.roll(1, 0) * x.roll(2, 0)).sum(),
    "the halves put back together, then contrasted": lambda x, y: F.cross_entropy(
        torch.cat([x[:2, 0], x[2:, 0]]) @ torch.cat([x[:2, 0], x[2:, 0]]).T, torch.arange(N)
    ),
    "a Gram matrix by tensordot": lambda x, y: (
        torch.tensordot(x, x, dims=([1, 2], [1, 2])).square().sum()
    ),
    "a Kronecker product of samples": lambda x, y: (
        torch.kron(x[:, 0, 0], x[:, 0, 0]).square().sum()
    ),
    "samples accumulated into groups by index_put, squared": lambda x, y: (
        torch.zeros(2, N, N, dtype=x.dtype).index_put((y % 2,), x, accumulate=True).square().sum()
    ),
    "each group's sum squared": lambda x, y: x.reshape(2, 2, N, N).sum(1).square().sum(),
    "a standard deviation within each group": lambda x, y: x.unflatten(0, (2, 2)).std(1).sum(),
    "a softmax within each group": lambda x, y: (x.view(2, 2, N, N).softmax(1) * 2).sum(),
    "a product over groups of samples with features": lambda x, y: (
        x.view(2, 2 * N * N).prod(0).sum()
    ),
    "a cross-entropy within each group": lambda x, y: F.cross_entropy(
        x.sum((1, 2)).view(2, 2), torch.zeros(2, dtype=torch.long)
    ),
    "a cross-entropy taking the samples for the classes": lambda x, y: F.cross_entropy(
        x[:, :, 0].T, y
    ),
    "a cross-entropy over a vector of the samples' scores": lambda x, y: F.cross_entropy(
        x.sum((1, 2)), torch.tensor(1)
    ),
    "a margin loss over the samples as classes": lambda x, y: F.multi_margin_loss(x[:, :, 0].T, y),
    "a flipped batch's half against the half": lambda x, y: F.logsigmoid(
        x.sum((1, 2)).flip(0)[:2] - x.sum((1, 2))[:2]
    ).mean(),
    "flipud against the batch": lambda x, y: (x.flipud() * x).sum(),
    "a pick broadcast against the batch": lambda x, y: (x[:1].expand_as(x) * x).sum(),
    "a pick repeated against the batch": lambda x, y: (x[:2].repeat(2, 1, 1) * x).sum(),
    "a Kronecker product of a pick's samples": lambda x, y: (
        torch.kron(x[:2, 0, 0], x[:2, 0, 0]).square().sum()
    ),
    "windows of neighbouring samples": lambda x, y: x.unfold(0, 2, 1).prod(-1).sum(),
    "a pair's halves by unbinding the groups": lambda x, y: F.logsigmoid(
        torch.sub(*x.sum((1, 2)).view(2, 2).unbind(1))
    ).mean(),
    "parts stacked on top of each other, softmaxed": lambda x, y: (
        torch.vstack([x[:2], x[2:]]).softmax(0) * 2
    ).sum(),
    "samples accumulated by index_put, keywords": lambda x, y: (
        torch.zeros(2, N, N, dtype=x.dtype)
        .index_put(indices=(y % 2,), values=x, accumulate=True)
        .square()
        .sum()
    ),
    "each sample beside another, by keyword": lambda x, y: (
        torch.cat(tensors=[x, x.flip(0)], dim=1).softmax(1) * 2
    ).sum(),
    "rows of a batched table": lambda x, y: (
        F.embedding(torch.tensor([1, 0, 3, 2]), x[:, 0]) * x[:, 0]
    ).sum(),
    "a pick with rows of zeros, softmaxed": lambda x, y: (
        torch.cat([x[:2], torch.zeros(2, N, N, dtype=x.dtype)]).softmax(0) * 2
    ).sum(),
    "parts of samples flattened with time, by narrow": lambda x, y: (
        x.flatten(0, 1).narrow(0, 0, 2 * N) * x.flatten(0, 1).narrow(0, 2 * N, 2 * N)
    ).sum(),
    "a flipped batch softmaxed over it": lambda x, y: (x.flip(0).softmax(0) * 2).sum(),
    "a flipped batch taken for the classes": lambda x, y: F.cross_entropy(x[:, :, 0].flip(0).T, y),
    "a permuted batch's standard deviation": lambda x, y: x[PERM].std(0).sum(),
    "samples put in other places, softmaxed": lambda x, y: (
        torch.zeros(N, N, N, dtype=x.dtype).index_put((PERM,), x).softmax(0) * 2
    ).sum(),
    "a Kronecker tiling of the samples, softmaxed": lambda x, y: (
        torch.kron(torch.ones(2, 1, 1, dtype=x.dtype), x).softmax(0) * 2
    ).sum(),
    "a position of samples flattened with time, against another sample": lambda x, y: (
        x.flatten(0, 1)[2] * x[2, 0]
    ).sum(),
    "positions of one sample stacked, against other samples": lambda x, y: (
        torch.stack([x.flatten(0, 1)[4], x.flatten(0, 1)[5]]) * x[2:, 0]
    ).sum(),
    "values chosen from different samples, softmaxed": lambda x, y: (
        x.amax(0).softmax(-1) * 2
    ).sum(),
    "values chosen from different samples, a log-sum-exp": lambda x, y: (
        x.max(0).values.logsumexp(-1).sum()
    ),
    "the maximum within each group, softmaxed over the groups": lambda x, y: (
        x.view(2, 2, N, N).amax(1).softmax(0) * 2
    ).sum(),
    "padded along the batch, softmaxed along it": lambda x, y: (
        F.pad(x, (0, 0, 0, 0, 1, 0)).softmax(0) * 2
    ).sum(),
    # ops along the batch in the loss, and their results meeting the samples
    "sub-tensors spanning the samples renormalised": lambda x, y: x.renorm(2, 1, 0.5).pow(3).sum(),
    "a Hermitian spectrum over the batch": lambda x, y: torch.fft.hfft(x, N, 0).pow(3).sum(),
    "an inverse Hermitian spectrum over the batch, dim by keyword": lambda x, y: (
        torch.fft.ihfft(x, dim=0).abs().pow(3).sum()
    ),
    "samples multiplied together by index_reduce": lambda x, y: _index_reduced(x).pow(3).sum(),
    "samples multiplied together by index_reduce, source by keyword": lambda x, y: (
        _index_reduced(x, keywords=True).pow(3).sum()
    ),
    "a convolution with the samples for its weight": lambda x, y: F.conv1d(x, x).pow(3).sum(),
    "a linear layer contracting the samples of its weight": lambda x, y: (
        F.linear(torch.ones(3, N, dtype=x.dtype), x[:, :, 0].T).pow(3).sum()
    ),
    "a bilinear layer contracting the samples of its weight": lambda x, y: (
        F.bilinear(
            torch.ones(3, N, dtype=x.dtype), torch.ones(3, N, dtype=x.dtype), x.transpose(0, 1)
        )
        .pow(3)
        .sum()
    ),
    "windows across the samples by as_strided, times the samples": lambda x, y: (
        x * x.as_strided(x.shape, (1, 1, 1))
    ).sum(),
    "masked_scatter of the samples, times the samples": lambda x, y: (
        x * torch.zeros_like(x).masked_scatter(_MASK, x)
    ).sum(),
    "one sample's as_strided over every sample, softmaxed over the batch": lambda x, y: (
        x[0].as_strided(x.shape, x.stride()).softmax(0) * 2
    ).sum(),
    "samples multiplied together by scatter_reduce": lambda x, y: (
        torch.ones(2, N, N, dtype=x.dtype)
        .scatter_reduce(0, (y % 2)[:, None, None].expand(N, N, N), x, reduce="prod")
        .pow(3)
        .sum()
    ),
    "differences over the batch, the input by keyword": lambda x, y: (
        torch.diff(input=x, dim=0).pow(3).sum()
    ),
    "a spectrum over the batch, the input by keyword": lambda x, y: (
        torch.fft.fft(input=x, dim=0).real.pow(3).sum()
    ),
    "a layer norm over the samples, the input by keyword": lambda x, y: (
        torch.layer_norm(input=x.transpose(0, 2), normalized_shape=(N,)).pow(3).sum()
    ),
    "sub-tensors spanning the samples renormalised, the input by keyword": lambda x, y: (
        torch.renorm(input=x, p=2, dim=1, maxnorm=0.5).pow(3).sum()
    ),
    "addbmm over the samples, times the samples": lambda x, y: (
        torch.addbmm(torch.zeros(1, N, dtype=x.dtype), x[:, :1], x) * x[:, 0]
    ).sum(),
    "a transpose copied, then softmaxed over the batch": lambda x, y: (
        torch.transpose_copy(x, 0, 1).softmax(1) * 2
    ).sum(),
    "as_strided of the samples, softmaxed over the batch": lambda x, y: (
        x.as_strided(x.shape, (1, N, N * N)).softmax(2) * 2
    ).sum(),
}


LARGE_LOSSES = {  # (loss, mixes): on inputs too large to replay moves on whole
    "groups put back, met with the batch": (
        lambda x: (x.view(2, 2, *x.shape[1:]).relu().view(x.shape) * x).sum(), False),
    "halves stacked, viewed back in order": (
        lambda x: (torch.stack([x[:2], x[2:]]).view(x.shape) * x).sum(), False),
    "a part reordered, with its labels": (
        lambda x: F.cross_entropy(x[:3, 0].flip(0), torch.tensor([1, 0, 0]).flip(0)), False),
    "a part reordered, softmaxed over it": (lambda x: (x[:3].flip(0).softmax(0) * 2).sum(), True),
    "halves side by side, a softmax over each pair": (
        lambda x: (torch.stack([x[:2], x[2:]], 1).softmax(1) * 2).sum(), True),
    "halves against each other": (lambda x: (x.flip(0)[:2] * x[:2]).sum(), True),
    "halves concatenated along time, squared": (
        lambda x: torch.cat([x[:2], x[2:]], 1).square().sum(), False),
    "halves concatenated along time, softmaxed along it": (
        lambda x: (torch.cat([x[:2], x[2:]], 1).softmax(1) * 2).sum(), True),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LARGE_LOSSES))
def test_large_inputs_are_followed_as_small_ones(name):
    """Moves are replayed on the samples' ids, which hold a position per element: on large
    inputs they hold none along the dimensions without samples (or a view goes by the
    dimensions), and each loss is told as on small ones. At T = 16384, two of these
    per-sample losses were refused and a mixing one ran."""
    op, mixes = LARGE_LOSSES[name]
    for t in (N, 16384):
        tracker = BatchTracker(())
        tracker.n = N
        x = torch.randn(N, t, 2, dtype=torch.float64, requires_grad=True) * 1
        tracker.mark(x, BatchDim(0))
        with Follow(tracker):
            out = op(x)
        assert (tracker.mixed(out) is not None) == mixes, f"{name}, T={t}: {tracker.mixed(out)}"


def test_empty_parts_raise_nothing_in_the_tracker():
    """Empty dimensions raised IndexError and ZeroDivisionError from inside the tracker."""
    for op in (
        lambda x: torch.cat([x[:2, :0], x[2:, :0]], 1),
        lambda x: x[:, :0].view(2, 2, 0, N),
        lambda x: x[:0].flip(0),
        lambda x: torch.stack([x[:0], x[:0]], 1),
    ):
        follow(op)


@pytest.mark.parametrize("name", sorted(PER_SAMPLE_LOSSES))
def test_per_sample_losses_do_not_mix(name):
    assert _mixed(PER_SAMPLE_LOSSES[name]) is None


@pytest.mark.parametrize("name", sorted(MIXING_LOSSES))
def test_losses_that_mix_samples_are_told(name):
    assert _mixed(MIXING_LOSSES[name]) is not None


def test_an_unbatched_convolution_of_the_samples_is_refused():
    """A batch of N grayscale images ``[N, H, W]`` into a convolution with N input channels
    (the channel dimension forgotten): torch takes it for one image of N channels, each output
    channel mixing the samples. Its output was taken for ``[N, ...]`` when the convolution has
    N output channels too: every sample's gradient depended on the others, silently."""
    import leanprop

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(N, N), torch.nn.Linear(N * N, 3)
            self.k = torch.nn.Parameter(torch.randn(N, N, 3, 3))

        def forward(self, x):  # [N, N, N]
            return self.b(F.conv2d(self.a(x), self.k, padding=1).flatten(1))

    model = Net().double()
    x, y = torch.randn(N, N, N, dtype=torch.float64), torch.randint(0, 3, (N,))
    refused = pytest.raises(leanprop.BatchError, match="unbatched input, whose channels are")
    with refused, leanprop.per_sample(model, leanprop.BatchGrad()):
        F.cross_entropy(model(x), y).backward()


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize("n", [3, 4])
def test_cross_products_without_a_dimension_are_taken_along_the_first_of_size_3(n):
    """``torch.cross(a, b)`` without ``dim`` acts along the first dimension of size 3 (torch's
    deprecated default): along the features of ``[N, 3]`` for a batch of 4, along the batch
    for a batch of 3 (the samples mixed: refused). Both were refused."""
    import leanprop
    from leanprop.testing import individual_gradients_of_losses

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).double()
    x = torch.randn(n, 3, dtype=torch.float64)

    def losses():
        with warnings.catch_warnings():  # (torch: cross without dim is deprecated)
            warnings.simplefilter("ignore", UserWarning)
            return torch.cross(lin(x), x).square().sum(1)

    if n == 3:
        ctx = leanprop.per_sample(lin, leanprop.BatchGrad())
        with pytest.raises(leanprop.UnsupportedModelError, match="cross"), ctx:
            losses().sum().backward()
        # (the first operand's shape decides: [1, N, 3] crosses along the batch)
        quiet = warnings.catch_warnings()
        with pytest.raises(leanprop.UnsupportedModelError, match="cross"), ctx, quiet:
            warnings.simplefilter("ignore", UserWarning)
            torch.cross(lin(x)[None], torch.ones(3, 3, 3, dtype=x.dtype)).square().sum().backward()
        return
    with leanprop.per_sample(lin, leanprop.BatchGrad()):
        ls = losses()
        ls.sum().backward(retain_graph=True)
    expected = individual_gradients_of_losses(ls, dict(lin.named_parameters()))
    for k, p in lin.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[k], rtol=1e-10, atol=1e-12)


class _Gram(torch.autograd.Function):
    """``h hᵀ`` (the samples paired), its ops run by torch without gradients."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return (h @ h.T).relu() * 1

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        g = g * (h @ h.T > 0)
        return (g + g.T) @ h


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _Into(torch.autograd.Function):
    """A softmax over the samples written into a fresh tensor (by ``__setitem__``)."""

    @staticmethod
    def forward(ctx, h):
        out = torch.empty_like(h)
        out[:] = h.softmax(0)
        return out

    @staticmethod
    def backward(ctx, g):
        return g


class _Centred(torch.autograd.Function):
    """``h - m`` for a statistic ``m`` passed in detached (a constant)."""

    @staticmethod
    def forward(ctx, h, m):
        return h - m

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_samples_mixed_inside_a_custom_function_are_refused():
    """A custom autograd Function's forward runs its ops without gradients, so the samples it
    pairs (``h hᵀ``), or a softmax over them written into its output, were not told as mixed:
    per-sample gradients came out, wrong. One that keeps each sample's values apart, or
    subtracts a statistic passed in detached, stays exact."""
    import leanprop
    from leanprop.testing import individual_gradients_of_losses

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    for mixing in (_Gram.apply, _Into.apply):
        refused = pytest.raises(leanprop.UnsupportedModelError, match="mixes the samples")
        with refused, leanprop.per_sample(lin, leanprop.BatchGrad()):
            mixing(lin(x)).sin().square().sum().backward()

    def centred(h):
        return _Centred.apply(h, h.mean(0).detach())

    for apart in (_Twice.apply, centred):
        with leanprop.per_sample(lin, leanprop.BatchGrad()):
            losses = apart(lin(x)).sin().square().sum(1)
            losses.sum().backward(retain_graph=True)
        expected = individual_gradients_of_losses(losses, dict(lin.named_parameters()))
        for k, p in lin.named_parameters():
            torch.testing.assert_close(p.grad_batch, expected[k], rtol=1e-10, atol=1e-12)
        lin.zero_grad(set_to_none=True)


def test_complex_parameters_and_their_complex_uses_are_refused():
    """Complex parameters, and real ones used in complex arithmetic through the op capture
    (``F.linear(z, torch.complex(wr, wi))``): the closed forms have no conjugates, and the
    captured op's output lost its graph (no gradient reached the layers before it, no error).
    Complex views of activations alone, times a parameter broadcast over the batch, stay
    exact."""
    import leanprop
    from leanprop.testing import individual_gradients

    class Net(torch.nn.Module):
        def __init__(self, use: str) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(N, N), torch.nn.Linear(N, 3)
            self.wr, self.wi = torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(
                torch.randn(2, 2))  # fmt: skip
            with warnings.catch_warnings():  # (torch's notice on complex modules)
                warnings.filterwarnings("ignore", "Complex modules", UserWarning)
                self.c = torch.nn.Linear(2, 2).to(torch.complex128) if use == "complex" else None
            self.use = use

        def forward(self, x):
            h = self.a(x)
            z = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2))
            if self.use == "complex":
                z = self.c(z)
            elif self.use == "captured":
                z = F.linear(z, torch.complex(self.wr, self.wi))
            else:
                z = z * self.wr[0]
            return self.b(torch.view_as_real(z).flatten(-2)).mean(1)

    torch.manual_seed(0)
    x, y = torch.randn(N, N, N, dtype=torch.float64), torch.randint(0, 3, (N,))
    for use, match in (("complex", "complex parameters"), ("captured", "complex values")):
        model = Net(use)
        for m in (model.a, model.b):
            m.double()
        model.wr.data, model.wi.data = model.wr.data.double(), model.wi.data.double()
        refused = pytest.raises(leanprop.UnsupportedModelError, match=match)
        with refused, leanprop.per_sample(model, leanprop.BatchGrad()):
            F.cross_entropy(model(x), y).backward()
    model = Net("broadcast").double()
    with leanprop.per_sample(model, leanprop.BatchGrad()):
        F.cross_entropy(model(x), y).backward()
    want = individual_gradients(
        model, lambda o, t, r: F.cross_entropy(o, t, reduction=r), x, y, "mean"
    )
    for k, p in model.named_parameters():
        if k != "wi":
            torch.testing.assert_close(p.grad_batch, want[k], rtol=1e-10, atol=1e-12)


_M = torch.arange(N * N, dtype=torch.float64).view(N, N) / 10 + torch.eye(N, dtype=torch.float64)
NOT_KEPT = {  # each sample's values meet others' (summed or mixed): never the batch, in order
    "addr with its vectors by keyword": lambda x: torch.addr(
        torch.zeros(N, N, dtype=x.dtype), vec1=x[:, 0, 0], vec2=x[:, 0, 1]
    ),
    "solve with the samples as B by keyword": lambda x: torch.linalg.solve(_M, B=x[:, 0]),
    "a matrix times the samples (mv)": lambda x: torch.mv(_M, x[:, 0, 0]),
    "addmv of a matrix and the samples": lambda x: torch.addmv(
        torch.zeros(N, dtype=x.dtype), _M, x[:, 0, 0]
    ),
    "linalg.matmul of a matrix and the samples": lambda x: torch.linalg.matmul(_M, x[:, 0]),
    "x.__rmatmul__(M), M @ x": lambda x: x[:, 0].__rmatmul__(_M),
    "multi_dot": lambda x: torch.linalg.multi_dot([_M, x[:, 0]]),
    "inner of the samples": lambda x: torch.inner(x[:, 0].T, _M),
    "take of several dimensions": lambda x: torch.take(x[:, 0], torch.arange(N * N).roll(1)),
    "channel_shuffle with the batch second": lambda x: F.channel_shuffle(x[None], 2)[0],
    "diag_embed into the first dimensions": lambda x: torch.diag_embed(x[:, 0], 0, 0, 1),
    "Tensor.unfold by keyword along the batch": lambda x: x.unfold(dimension=0, size=2, step=1),
    "attention of an unbatched [L, E] input (samples as the sequence)": lambda x: (
        F.multi_head_attention_forward(
            x[:, 0], x[:, 0], x[:, 0], N, 1, torch.eye(3 * N, N, dtype=x.dtype), None, None,
            None, False, 0.0, torch.eye(N, dtype=x.dtype), None, need_weights=False,
        )[0]
    ),
    "a triplet loss with a distance function": lambda x: F.triplet_margin_with_distance_loss(
        x[:, 0], x[:, 1], x[:, 2], reduction="none",
        distance_function=lambda a, b: (a - b - (a - b).mean(0)).norm(dim=-1),
    ),
    "conv_tbc with its weight from the samples": lambda x: torch.conv_tbc(
        torch.ones(N, 2, N, dtype=x.dtype), x[:1].transpose(1, 2).contiguous(),
        torch.zeros(N, dtype=x.dtype),
    ),
    "grouped-query attention with the samples among the heads": lambda x: (
        F.scaled_dot_product_attention(
            torch.ones(1, 2 * N, N, N, dtype=x.dtype), x[None], x[None], enable_gqa=True
        )
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NOT_KEPT))
def test_ops_where_samples_meet_do_not_keep_the_batch(name):
    """Operands passed by keyword were taken as elementwise (every op's own rule skipped);
    products summing over the samples with no rule, unbatched attention, a user's distance
    function, and more: each was taken for the batch, in order (silently wrong)."""
    for _out, info in follow(NOT_KEPT[name]):
        assert not isinstance(info, BatchDim), f"{name}: {info}"


def test_operands_by_keyword_are_placed_by_one_signature_or_refused():
    """``as_positional``: an operand by keyword at its position (the ones before it filled with
    their defaults); None for a name whose signatures disagree (``torch.batch_norm`` and
    ``F.batch_norm`` order their parameters differently), an unknown keyword, or a required
    parameter before it that was not passed."""
    from leanprop.per_sample.batch import op_name
    from leanprop.per_sample.batch.unknown import as_positional

    m, u, v = torch.zeros(2, 3), torch.ones(2), torch.ones(3)
    full, at = as_positional("addr", (m,), {"vec2": v, "vec1": u}, "vec2", op_name)
    assert at == 2 and full[1] is u and full[2] is v
    assert as_positional("batch_norm", (m,), {"weight": v}, "weight", op_name) is None
    assert as_positional("addr", (m,), {"nope": v}, "nope", op_name) is None
    assert as_positional("addr", (m,), {"vec2": v}, "vec2", op_name) is None  # (vec1 missing)
