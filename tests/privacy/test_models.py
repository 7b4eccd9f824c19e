"""Per-sample clipping on the real-model patterns in training mode (dropout, drop-path, packed
sequences, checkpoint-free HF models), float64, against the clipped sum of the individual
gradients of the same batch forward."""

from __future__ import annotations

import pytest
import torch

import leanprop
from leanprop.testing import individual_gradients_of_losses

from ..helpers import assert_close
from ..model_zoo import ZOO, hf_models


def check(build, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model, losses_fn, options = build()
    model.double()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    with leanprop.clip_per_sample(model, 1.0, loss_reduction="sum", **options) as clip:
        losses = losses_fn()
        losses.sum().backward(retain_graph=True)
    per = individual_gradients_of_losses(losses, params)  # g_n of the same forward
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per.values()]).sum(0).sqrt()
    c = float(norms.median())  # half of the samples clipped
    a = (c / (norms + 1e-6)).clamp(max=1.0)
    for p in params.values():
        p.grad = None
    # the same forward again (clipping at the median needs the norms first)
    torch.manual_seed(seed)
    model, losses_fn, options = build()
    model.double()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    with leanprop.clip_per_sample(model, c, loss_reduction="sum", **options) as clip:
        losses_fn().sum().backward()
    assert_close(clip.last_norms, norms, "norms", 1e-8, 1e-12)
    scale = max(float(g.abs().max()) for g in per.values())
    for k, p in params.items():
        expected = torch.tensordot(a, per[k], dims=1)
        assert_close(p.grad, expected, f"{k} clipped", 1e-8, 1e-10 * scale)


pytestmark = pytest.mark.usefixtures("float64_default")


@pytest.mark.parametrize("name", sorted(ZOO))
def test_model_pattern(name):
    check(ZOO[name])


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "hf_bert", "hf_vit"])
def test_hf_model_in_training_mode(name):
    pytest.importorskip("transformers")
    check(hf_models()[name])
