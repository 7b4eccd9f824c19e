"""Optimizer step inside backward on a GPT-2-like language model.

Variants, each a trainer of its own (a model from the same initial weights and its optimizer,
kept between timed calls: the steady state of a long run), each call training it for a few
steps with AdamW (torch's default kernels on CPU, fused kernels on CUDA). The first call, which
builds the optimizer's state, gives the peak memory; later calls, interleaved round by round,
the time per step:

* ``ordinary``: ``backward(); step(); zero_grad()``.
* ``hooks``: PyTorch's tutorial recipe, one optimizer per parameter stepped in
  ``register_post_accumulate_grad_hook``.
* ``torch_in_backward``: torch's ``_apply_optimizer_in_backward`` (one optimizer per parameter,
  hooked on its gradient accumulator).
* ``leanprop``: :class:`leanprop.InBackward` as it comes, buckets stepped by one optimizer
  call each; it keeps each gradient's norm (for ``clip_grad_norm_(params, inf)`` /
  ``last_grad_norm``, one extra read of it) while they are read: this loop reads none, so
  after its first backward none are kept. ``leanprop_norms``: ``record_norms=True``, kept
  always (what a trainer that logs the norm pays); ``leanprop_no_norms``:
  ``record_norms=False``.

Sizes: ``small_b1`` (about 4.2M parameters) and ``gpt2_10m`` (about 10M, InBackward's default
25 MiB buckets) on CPU; ``gpt2m_b1`` (GPT-2 medium) on CUDA. The leanprop row also gives the
Python cost of one bucket step beyond the plain optimizer's ``step()`` on the same tensors
(tiny tensors, so that only the per-call cost is left).

:func:`leanprop.compare` times them and measures peak memory above the parameters (optimizer
state, gradients and activations); fresh trainers of each leanprop variant and of the ordinary
loop, run once, check that their parameters agree exactly (per-tensor sums compared with zero
tolerance).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import leanprop
from leanprop.measure import as_dict

SIZES = {
    "small_b1": {"vocab": 2048, "d": 256, "heads": 4, "layers": 4, "seq": 32, "batch": 1},
    "gpt2_10m": {"vocab": 8192, "d": 256, "heads": 4, "layers": 8, "seq": 64, "batch": 1},
    "gpt2m_b1": {"vocab": 50304, "d": 1024, "heads": 16, "layers": 24, "seq": 128, "batch": 1},
}
BUCKET_MB = {  # a few buckets per step: each costs one optimizer call (~0.2-0.8 ms of Python)
    "small_b1": 4.0,
    "gpt2_10m": 25.0,  # the default
    "gpt2m_b1": 256.0,
}
STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        a = self.ln1(x)
        x = x + self.attn(a, a, a, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks, a linear head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


@dataclass(frozen=True)
class Trainer:
    """One variant's training loop: ``steps()`` runs :data:`STEPS` training steps of
    ``model`` and returns a summary of its parameters; ``close()`` removes what it hooked."""

    steps: Callable[[], Tensor]
    model: nn.Module
    close: Callable[[], None] = lambda: None


Variant = Callable[[], Trainer]  # builds a trainer


def _variants(size: str, device: str) -> dict[str, Variant]:
    """Each variant as a builder: it makes its own model (the same initial weights) and
    optimizer, and returns the training loop's step, which runs :data:`STEPS` steps on the
    same data each call (a trainer kept between calls: steady state, as a long training run;
    the first call builds the optimizer's state, as the first step does)."""
    cfg = SIZES[size]
    torch.manual_seed(0)
    init = LM(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"]).state_dict()
    x = torch.randint(0, cfg["vocab"], (STEPS, cfg["batch"], cfg["seq"]), device=device)
    y = torch.randint(0, cfg["vocab"], (STEPS, cfg["batch"], cfg["seq"]), device=device)
    loss_fn = nn.CrossEntropyLoss()
    # fused kernels on CUDA; torch's default (a per-tensor loop) on CPU, where it is fastest
    kernel = {"fused": True} if torch.device(device).type == "cuda" else {}

    def model() -> nn.Module:
        m = LM(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"]).to(device)
        m.load_state_dict(init)
        return m

    def loss(m: nn.Module, s: int) -> Tensor:
        return loss_fn(m(x[s]).flatten(0, 1), y[s].flatten())

    def summary(m: nn.Module) -> Tensor:
        return torch.stack([p.detach().double().sum() for p in m.parameters()])

    def ordinary() -> Trainer:
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, **kernel)

        def steps() -> Tensor:
            for s in range(STEPS):
                loss(m, s).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return summary(m)

        return Trainer(steps, m)

    def hooks() -> Trainer:
        m = model()
        opts = {p: torch.optim.AdamW([p], lr=1e-3, foreach=False) for p in m.parameters()}

        def hook(p: Tensor) -> None:
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)

        handles = [p.register_post_accumulate_grad_hook(hook) for p in m.parameters()]

        def steps() -> Tensor:
            for s in range(STEPS):
                loss(m, s).backward()
            return summary(m)

        def close() -> None:
            for h in handles:
                h.remove()

        return Trainer(steps, m, close)

    def torch_in_backward() -> Trainer:
        with warnings.catch_warnings():  # (the package's import scripts a function with jit)
            warnings.simplefilter("ignore", DeprecationWarning)
            from torch.distributed.optim import _apply_optimizer_in_backward
            from torch.distributed.optim.apply_optimizer_in_backward import (
                param_to_optim_hook_handle_map,
            )

        m = model()
        params, options = list(m.parameters()), {"lr": 1e-3, **kernel}
        _apply_optimizer_in_backward(torch.optim.AdamW, params, options)

        def steps() -> Tensor:
            for s in range(STEPS):
                loss(m, s).backward()
            return summary(m)

        def close() -> None:  # (it has no removal API: its hooks and optimizers go here)
            for p in params:
                for h in param_to_optim_hook_handle_map.pop(p, []):
                    h.remove()
                for attr in ("_in_backward_optimizers", "_optimizer_classes", "_optimizer_kwargs"):
                    delattr(p, attr)

        return Trainer(steps, m, close)

    def in_backward(record_norms: bool | None = None) -> Trainer:
        m = model()
        opt = leanprop.InBackward(
            m.parameters(), torch.optim.AdamW, bucket_mb=BUCKET_MB[size], lr=1e-3,
            record_norms=record_norms, **kernel,
        )  # fmt: skip

        def steps() -> Tensor:
            for s in range(STEPS):
                loss(m, s).backward()
                opt.step()
            return summary(m)

        return Trainer(steps, m, opt.remove)

    return {
        "ordinary": ordinary,
        "hooks": hooks,
        "torch_in_backward": torch_in_backward,
        "leanprop": in_backward,
        "leanprop_norms": lambda: in_backward(record_norms=True),
        "leanprop_no_norms": lambda: in_backward(record_norms=False),
    }


def _run_once(build: Variant) -> Tensor:
    """A fresh trainer's summary after :data:`STEPS` steps (its hooks removed after)."""
    trainer = build()
    try:
        return trainer.steps()
    finally:
        trainer.close()


def _then_free(step: Callable[[], None], params: list[nn.Parameter]) -> Callable[[], None]:
    def run() -> None:
        step()
        for p in params:
            p.grad = None

    return run


def _with_norms(step: Callable[[], None], params: list[nn.Parameter]) -> Callable[[], None]:
    grads = [p.grad for p in params]  # (built beforehand, as the kernel's lists)

    def run() -> None:
        torch._foreach_norm(grads)
        step()

    return run


def bucket_overhead_us(tensors: int = 10, rounds: int = 1000) -> dict[str, float]:
    """Median extra time (µs) of one InBackward bucket step on ``tensors`` tiny tensors (so
    that only the per-call cost is left), each timed with fresh gradients, in turn, with SGD
    (momentum, multi-tensor: a kernel of a few µs, so the Python shows clearly). A bucket step
    frees its gradients; so do the ordinary loop's ``zero_grad()`` and each reference below
    (timed with it). Each figure is the median of the rounds' differences (a slow round slows
    both sides: paired, it cancels):

    * ``"over_step"``: norms recorded (``record_norms=True``), over the plain ``step()`` on
      the same tensors;
    * ``"over_kernel"``: norms recorded, over the bare functional kernel on lists built
      beforehand (the floor): the Python of bucketing and checks, plus the norm kernel (on CPU
      one ``vector_norm`` call per tensor);
    * ``"over_kernel_no_norms"``: ``record_norms=False``, over the bare kernel: the Python
      alone;
    * ``"over_kernels"``: norms recorded, over the bare kernel and the norm kernel
      (``torch._foreach_norm``) on lists built beforehand: the Python alone with norms."""
    import time

    from leanprop.optim.kernels import DirectKernels

    sets = [[nn.Parameter(torch.randn(8)) for _ in range(tensors)] for _ in range(5)]
    opts = {"lr": 1e-3, "momentum": 0.9, "foreach": True}
    ours = leanprop.InBackward(sets[0], torch.optim.SGD, record_norms=True, **opts)
    bare = leanprop.InBackward(sets[3], torch.optim.SGD, record_norms=False, **opts)
    plain = torch.optim.SGD(sets[1], **opts)
    floor = torch.optim.SGD(sets[2], **opts)
    floor_norms = torch.optim.SGD(sets[4], **opts)
    steps = {
        "ours": lambda: ours.step_bucket(sets[0]),
        "no_norms": lambda: bare.step_bucket(sets[3]),
        "step": _then_free(plain.step, sets[1]),
    }
    times: dict[str, list[float]] = {k: [] for k in (*steps, "kernel", "kernels")}
    try:
        for i in range(rounds + 1):
            for ps in sets:
                for p in ps:
                    p.grad = torch.ones_like(p)
            if i == 0:  # state created by a first step of each
                floor.step()
                floor_norms.step()
            # (the floor's lists built now, untimed: the kernel reads this round's gradients;
            # then the gradients freed, as the ordinary loop's zero_grad() and a bucket step do)
            steps["kernel"] = _then_free(DirectKernels(floor).bare_call(sets[2]), sets[2])
            steps["kernels"] = _then_free(
                _with_norms(DirectKernels(floor_norms).bare_call(sets[4]), sets[4]), sets[4]
            )
            order = list(steps.items())
            for name, fn in order if i % 2 else order[::-1]:  # (no side always first)
                with torch.no_grad():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
    finally:
        ours.remove()
        bare.remove()

    def over(a: str, b: str) -> float:
        diffs = sorted(x - y for x, y in zip(times[a][1:], times[b][1:], strict=True))
        return diffs[len(diffs) // 2] * 1e6

    return {
        "over_step": over("ours", "step"),
        "over_kernel": over("ours", "kernel"),
        "over_kernel_no_norms": over("no_norms", "kernel"),
        "over_kernels": over("ours", "kernels"),
    }


def run(device: str = "cpu", batches: tuple[int, ...] = (), reps: int = 5) -> list[dict]:
    """One row per variant and size; ``batches`` is unused (sizes are by model), kept for the
    CLI."""
    sizes = ("small_b1", "gpt2_10m") if device == "cpu" else ("gpt2m_b1",)
    overhead = bucket_overhead_us()
    rows = []
    for size in sizes:
        builders = _variants(size, device)
        # (exactness: each leanprop variant against the ordinary loop, both built afresh)
        exact = {}
        ordinary = _run_once(builders["ordinary"])
        for k in ("leanprop", "leanprop_norms", "leanprop_no_norms"):
            exact[k] = bool(torch.equal(_run_once(builders[k]), ordinary))
        trainers = {k: build() for k, build in builders.items()}
        try:
            res = leanprop.compare(
                {k: t.steps for k, t in trainers.items()}, device=device, reps=reps, rtol=0.0,
                atol=0.0, show=False, check=False,
                existing=tuple(t.model for t in trainers.values()),
            )  # fmt: skip
        finally:
            for t in trainers.values():
                t.close()
        del trainers
        gc.collect()
        cfg = SIZES[size]
        for r in (as_dict(r, batch=cfg["batch"], method=f"{size}: {r.name}") for r in res):
            r["median_s"] /= STEPS  # per training step
            r["min_s"] /= STEPS
            variant = r["method"].split(": ")[1]
            if variant in exact:
                r["agrees"] = exact[variant]
                r["bucket_overhead_us"] = overhead["over_kernel"]
                r["bucket_overhead_no_norms_us"] = overhead["over_kernel_no_norms"]
                r["bucket_over_step_us"] = overhead["over_step"]
                r["bucket_over_kernels_us"] = overhead["over_kernels"]
                r["extra"] = (
                    f"bucket step over the bare kernel: {overhead['over_kernel']:+.0f} us "
                    f"({overhead['over_kernel_no_norms']:+.0f} us without norms; "
                    f"{overhead['over_kernels']:+.0f} us over it and the norm kernel), "
                    f"{overhead['over_step']:+.0f} us over step()"
                )
            rows.append(r)
    return rows
