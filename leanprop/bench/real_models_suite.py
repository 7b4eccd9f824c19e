"""Per-sample gradients on real model families built from small configs (no downloads).

Models (rows are ``model/method``): ``gpt2``, ``bert`` and ``vit``, small configs of HF
``transformers``' GPT-2, BERT (with padding) and ViT (skipped without it), and ``resnet18gn``, a
ResNet-18 with GroupNorm (written out), in training mode with their default dropout.
Methods side by side in one run: ``plain`` forward+backward, ``plain+write`` (plain, then
``[N, *p.shape]`` tensors allocated and written for every parameter: what returning individual
gradients costs at the least, whatever computes them; on CPU mostly the kernel's zeroing of
fresh pages), leanprop's ``BatchGrad`` /
``BatchL2Grad`` / ``Variance``, ``torch.func`` (``vmap(grad)`` with per-sample randomness)
and Opacus' ``GradSampleModule``, where each runs. Peak memory is the exact tensor peak of one
step (:class:`leanprop.track_memory`); time is measured in rounds, every method once per round
(the order rotated by one each round); each row gives the ratio of medians to ``plain`` and
the median of the rounds' own ratios (a round the machine ran slow cancels).
Each method runs ``WARM_UP`` steps first. leanprop's individual gradients are checked to add
up to the batch gradient (its own sum check, on); their exactness on these model families is
what tests/per_sample/test_models.py tests.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import leanprop

from ..measure import paired_ratio, time_interleaved, track_memory

Problem = tuple[nn.Module, Callable[[nn.Module, int], dict], Callable[..., Tensor]]
# steps each method runs before it is measured (leanprop's "auto" convolution algorithm tries
# the algorithms in turn on a layer's first calls)
WARM_UP = 10
LEANPROP = {
    "leanprop_batchgrad": leanprop.BatchGrad(),
    "leanprop_l2": leanprop.BatchL2Grad(),
    "leanprop_variance": leanprop.Variance(),
}


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.gn1, self.gn2 = nn.GroupNorm(8, c_out), nn.GroupNorm(8, c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(8, c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.gn1(self.conv1(x)))
        h = self.gn2(self.conv2(h))
        return F.relu(h + (x if self.down is None else self.down(x)))


def resnet18_gn(classes: int = 10, width: int = 16) -> nn.Module:
    """ResNet-18 (2-2-2-2 basic blocks) with GroupNorm, for 32x32 images."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.GroupNorm(8, width), nn.ReLU()
    ]  # fmt: skip
    c = width
    for i, mult in enumerate((1, 2, 4, 8)):
        for j in range(2):
            layers.append(BasicBlock(c, width * mult, 2 if i > 0 and j == 0 else 1))
            c = width * mult
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def _classify(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits, y)


def problems() -> dict[str, Callable[[], Problem]]:
    """``name -> () -> (model, batch(model, N) -> inputs, loss(model, inputs) -> scalar)``."""
    out: dict[str, Callable[[], Problem]] = {}

    def resnet() -> Problem:
        def batch(model: nn.Module, n: int) -> dict:
            return {"x": torch.randn(n, 3, 32, 32), "y": torch.randint(0, 10, (n,))}

        return resnet18_gn(), batch, lambda m, b: _classify(m(b["x"]), b["y"])

    if importlib.util.find_spec("transformers") is not None:
        import transformers as tf

        def gpt2() -> Problem:
            cfg = tf.GPT2Config(vocab_size=1000, n_positions=128, n_embd=128, n_layer=2,
                                n_head=4, bos_token_id=0, eos_token_id=0)  # fmt: skip

            def batch(model: nn.Module, n: int) -> dict:
                return {"x": torch.randint(0, 1000, (n, 64))}

            def loss(m: nn.Module, b: dict) -> Tensor:
                logits = m(input_ids=b["x"]).logits[:, :-1]
                return F.cross_entropy(logits.flatten(0, 1), b["x"][:, 1:].flatten())

            return tf.GPT2LMHeadModel(cfg), batch, loss

        def bert() -> Problem:
            cfg = tf.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=512,
                                max_position_embeddings=128)  # fmt: skip

            def batch(model: nn.Module, n: int) -> dict:
                mask = torch.ones(n, 64, dtype=torch.long)
                mask[: n // 2, 48:] = 0
                return {"x": torch.randint(0, 1000, (n, 64)), "mask": mask,
                        "y": torch.randint(0, 2, (n,))}  # fmt: skip

            def loss(m: nn.Module, b: dict) -> Tensor:
                return _classify(m(input_ids=b["x"], attention_mask=b["mask"]).logits, b["y"])

            return tf.BertForSequenceClassification(cfg), batch, loss

        def vit() -> Problem:
            cfg = tf.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=512, num_labels=10)  # fmt: skip

            def batch(model: nn.Module, n: int) -> dict:
                return {"x": torch.randn(n, 3, 32, 32), "y": torch.randint(0, 10, (n,))}

            def loss(m: nn.Module, b: dict) -> Tensor:
                return _classify(m(pixel_values=b["x"]).logits, b["y"])

            return tf.ViTForImageClassification(cfg), batch, loss

        out |= {"gpt2": gpt2, "bert": bert, "vit": vit}
    out["resnet18gn"] = resnet
    return out


def make_step(method: str, problem: Problem, n: int) -> Callable[[], list[Tensor]]:
    """One step of ``method``; returns its per-sample results (or the gradients)."""
    model, make_batch, loss_fn = problem
    torch.manual_seed(0)
    b = make_batch(model, n)
    params = [p for p in model.parameters() if p.requires_grad]

    def clear() -> None:
        for p in params:
            p.grad = None

    if method == "plain":

        def step() -> list[Tensor]:
            loss_fn(model, b).backward()
            out = [p.grad for p in params]
            clear()
            return out

    elif method == "plain+write":  # a floor for any BatchGrad: plain, then its [N, *p.shape]
        # results allocated and written once (fresh memory: the page faults included)

        def step() -> list[Tensor]:
            loss_fn(model, b).backward()
            out = [p.new_empty(n, *p.shape).fill_(1.0) for p in params]
            clear()
            return out

    elif method in LEANPROP:
        q = LEANPROP[method]

        def step() -> list[Tensor]:
            with leanprop.per_sample(model, q):
                loss_fn(model, b).backward()
            out = [getattr(p, q.attr) for p in params]
            clear()
            return out

    elif method == "torchfunc":
        from torch.func import functional_call, grad, vmap

        names = [k for k, p in model.named_parameters() if p.requires_grad]

        def one(p: dict[str, Tensor], sample: dict) -> Tensor:
            single = {k: v.unsqueeze(0) for k, v in sample.items()}
            return loss_fn(lambda *a, **kw: functional_call(model, p, a, kw), single)

        per_sample = vmap(grad(one), in_dims=(None, 0), randomness="different")
        detached = {k: p.detach() for k, p in model.named_parameters() if k in names}

        def step() -> list[Tensor]:
            return list(per_sample(detached, b).values())

    elif method == "opacus":
        from opacus import GradSampleModule

        gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")

        def step() -> list[Tensor]:
            loss_fn(gsm, b).backward()
            out = [p.grad_sample for p in params]
            gsm.zero_grad(set_to_none=True)
            return out

    else:
        raise leanprop.LeanpropValueError(
            f"unknown real-models benchmark method {method!r}; allowed: plain, plain+write, "
            f"{', '.join(LEANPROP)}, torchfunc, opacus."
        )
    return step


def run(device: str = "cpu", batches: tuple[int, ...] = (16,), reps: int = 10) -> list[dict]:
    """Rows of time and peak-memory ratios to ``plain`` for each model and batch size."""
    if device != "cpu":
        raise leanprop.LeanpropValueError(
            "the real-models suite runs on CPU only for now; pass --device cpu."
        )
    methods = ["plain", "plain+write", *LEANPROP, "torchfunc"]
    if importlib.util.find_spec("opacus") is not None:
        methods.append("opacus")
    rows: list[dict] = []
    for name, build in problems().items():
        for n in batches:
            print(f"  {name} N={n}: memory ...", file=sys.stderr, flush=True)
            recs: dict[str, dict] = {}
            steps: dict[str, Callable[[], object]] = {}
            for m in methods:
                torch.manual_seed(0)
                problem = build()
                try:
                    step = make_step(m, problem, n)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        for _ in range(WARM_UP):  # then the exact tensor peak of one step
                            step()
                        with track_memory() as mem:
                            step()
                except Exception as e:  # a competitor that cannot run this model
                    error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    recs[m] = {"method": f"{name}/{m}", "error": [error]}
                    continue
                recs[m] = {"method": f"{name}/{m}", "peak_mib": mem.peak_mib}
                steps[m] = step
            print(f"  {name} N={n}: time, {len(steps)} methods ...", file=sys.stderr, flush=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                timings = time_interleaved(steps, device, reps=reps)
            base_t, base_m = timings["plain"], recs["plain"]["peak_mib"]
            for m in methods:
                r = recs[m] | {"model": name, "batch": n}
                if m in timings:
                    t = timings[m]
                    r |= {
                        "median_s": t.median, "min_s": t.min,
                        "time_ratio": t.median / base_t.median, "min_ratio": t.min / base_t.min,
                        "paired_ratio": paired_ratio(t, base_t),
                        "extra": f"x plain round by round (median): {paired_ratio(t, base_t):.2f}",
                        "mem_ratio": r["peak_mib"] / base_m if base_m else None,
                    }  # fmt: skip
                rows.append(r)
            del steps
    return rows
