"""Side losses on a backbone's intermediate activations.

``loss = head(h_L) + sum_k alpha * penalty_k(h_k)``, with two kinds of penalty: an MLP with its
own parameters (``D -> 4D -> 4D -> 1``, as in the reference problem ``anchors_eager.py``), and
a parameter-free penalty with large intermediates (a pairwise Gram-matrix decorrelation term,
``[N, N]`` per layer). Variants:

* ``combined``: one backward of the whole loss (every penalty graph alive until then);
* ``checkpoint``: each penalty under ``torch.utils.checkpoint`` (recomputed in backward);
* ``backward-at-once``: ``penalty.backward(retain_graph=True)`` right away (re-traverses the
  backbone each time);
* ``leanprop``: :func:`leanprop.side_loss`;
* ``leanprop chunked`` (MLP penalty only, a mean over samples): ``side_loss(...,
  chunk_size=N // 4)``, a quarter of the penalty's activations at a time (for the Gram penalty,
  which mixes samples, chunking would change the penalty);
* ``leanprop offload`` (CUDA only): ``side_loss(..., offload=True)``, the stored gradients wait
  in pinned host memory.

And the same principle on an LM head: ``cross_entropy(h @ W.T, y)`` for growing vocabularies,
``plain`` against :func:`leanprop.chunked_linear_cross_entropy` (default chunking: 32 MiB of
logits per chunk). Each row notes the working memory, the peak less the gradients of ``h`` and
``W`` (which both must produce): the plain loss's grows with the vocabulary, the chunked one's
should not.

:func:`leanprop.compare` times them, measures peak memory and checks the parameter gradients
agree with ``combined`` (leanprop's are bit-identical; the tests check that).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import leanprop
from leanprop.measure import as_dict

SIZES = {
    "small": {"layers": 4, "batch": 512, "d": 256},
    "large": {"layers": 8, "batch": 4096, "d": 2048},
}
CE_SIZES = {
    "small": {"tokens": 1024, "d": 128, "vocabs": (4096, 16384, 65536)},
    "large": {"tokens": 8192, "d": 2048, "vocabs": (32768, 131072)},
}
ALPHA = 0.1
CHUNKS = 4  # chunks of the batch for "leanprop chunked"


def _gram_penalty(h: Tensor) -> Tensor:
    """Parameter-free, with a large intermediate: off-diagonal similarity of the samples."""
    z = nn.functional.normalize(h, dim=1)
    gram = z @ z.mT  # [N, N]
    return (gram - torch.eye(len(h), device=h.device)).square().mean()


def _variants(
    size: str, device: str, kind: str
) -> tuple[dict[str, Callable[[], Tensor]], nn.Module]:
    cfg = SIZES[size]
    d = cfg["d"]
    torch.manual_seed(0)
    backbone = nn.ModuleList(
        nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(cfg["layers"])
    )
    pens = nn.ModuleList(
        nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, 4 * d), nn.GELU(), nn.Linear(4 * d, 1)
        )
        for _ in range(cfg["layers"])
    )
    model = nn.ModuleList([backbone, pens, nn.Linear(d, 1)]).to(device)
    x = torch.randn(cfg["batch"], d, device=device)

    def pen_fn(k: int) -> Callable[[Tensor], Tensor]:
        if kind == "free":
            return _gram_penalty
        return lambda t: pens[k](t).square().mean()

    def grads_summary() -> Tensor:
        out = torch.stack([p.grad.double().sum() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return out

    def run(method: str) -> Tensor:
        h, extra = x, []
        for k, blk in enumerate(backbone):
            h = blk(h)
            fn = pen_fn(k)
            if method == "combined":
                extra.append(ALPHA * fn(h))
            elif method == "checkpoint":
                extra.append(ALPHA * checkpoint(fn, h, use_reentrant=False))
            elif method == "backward-at-once":
                (ALPHA * fn(h)).backward(retain_graph=True)
            elif method == "leanprop chunked":
                h = leanprop.side_loss(h, fn, weight=ALPHA, chunk_size=len(h) // CHUNKS)
            elif method == "leanprop offload":
                h = leanprop.side_loss(h, fn, weight=ALPHA, offload=True)
            else:
                h = leanprop.side_loss(h, fn, weight=ALPHA)
        loss = model[2](h).square().mean()
        (loss + sum(extra) if extra else loss).backward()
        return grads_summary()

    methods = ["combined", "checkpoint", "backward-at-once", "leanprop"]
    if kind == "mlp":
        methods.append("leanprop chunked")
    if torch.device(device).type == "cuda":
        methods.append("leanprop offload")
    return {m: (lambda m=m: run(m)) for m in methods}, model


def _ce_variants(
    tokens: int, d: int, vocab: int, device: str
) -> tuple[dict[str, Callable[[], list[Tensor]]], tuple[Tensor, ...]]:
    torch.manual_seed(0)
    h = torch.randn(tokens, d, device=device, requires_grad=True)
    w = (torch.randn(vocab, d, device=device) / d**0.5).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device)

    def step(loss: Callable[[], Tensor]) -> list[Tensor]:
        loss().backward()
        out = [h.grad, w.grad]
        h.grad = w.grad = None
        return out

    variants = {
        "plain": lambda: step(lambda: nn.functional.cross_entropy(h @ w.mT, y)),
        "leanprop chunked": lambda: step(lambda: leanprop.chunked_linear_cross_entropy(h, w, y)),
    }
    return variants, (h, w, y)


def _ce_rows(size: str, device: str, reps: int) -> list[dict]:
    cfg = CE_SIZES[size]
    rows: list[dict] = []
    for vocab in cfg["vocabs"]:
        variants, tensors = _ce_variants(cfg["tokens"], cfg["d"], vocab, device)
        res = leanprop.compare(
            variants, device=device, reps=reps, rtol=1e-4, atol=1e-9, existing=tensors, show=False
        )
        grads_mib = sum(t.numel() * t.element_size() for t in tensors[:2]) / 2**20
        for r in res:
            row = as_dict(r, batch=cfg["tokens"], method=f"ce V={vocab}: {r.name}")
            row["working_mib"] = r.peak_mib - grads_mib
            row["extra"] = f"working memory {row['working_mib']:.1f} MiB"
            rows.append(row)
    return rows


def run(device: str = "cpu", batches: tuple[int, ...] = (), reps: int = 5) -> list[dict]:
    """Rows for both penalty kinds and the LM-head loss; sizes are by device (``small`` on
    CPU)."""
    size = "small" if device == "cpu" else "large"
    rows: list[dict] = []
    for kind in ("mlp", "free"):
        variants, model = _variants(size, device, kind)
        res = leanprop.compare(
            variants, device=device, reps=reps, rtol=1e-5, atol=1e-8, existing=(model,), show=False
        )
        batch = SIZES[size]["batch"]
        rows += [as_dict(r, batch=batch, method=f"{kind} penalty: {r.name}") for r in res]
    return rows + _ce_rows(size, device, reps)
