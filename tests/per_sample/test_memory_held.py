"""What a per_sample context holds beyond what torch alone holds: its results and a layer's
workspace, nothing that grows with depth or keeps an activation torch frees (measured with
``track_memory``, which counts every byte allocated: deterministic on CPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import leanprop
from leanprop import BatchGrad, BatchL2Grad

N, T, E = 4, 16, 32


class TanhBlock(nn.Module):
    """A transformer MLP with a curved activation (its node is recorded for the Hessian)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(E), nn.Linear(E, 4 * E), nn.Linear(4 * E, E)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.tanh(self.a(self.ln(h))))


class AddmmBlock(nn.Module):
    """HF's Conv1D: weights used by ``torch.addmm`` in the model's own forward (op level)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(E, 4 * E) / 8), nn.Parameter(torch.zeros(4 * E))
        self.w2, self.b2 = nn.Parameter(torch.randn(4 * E, E) / 8), nn.Parameter(torch.zeros(E))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = torch.addmm(self.b1, h.reshape(-1, E), self.w1)
        return h + torch.addmm(self.b2, torch.relu(u), self.w2).view_as(h)


class Checkpointed(nn.Module):
    def __init__(self, block: Callable[[], nn.Module], depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False)
        return h


def _peak(model: nn.Module, x: torch.Tensor, quantities: list) -> int:
    """Peak bytes of a forward and backward (a second step: the gradients exist)."""
    for _ in range(2):
        with contextlib.ExitStack() as stack:
            if quantities:
                stack.enter_context(leanprop.per_sample(model, *quantities))
            with leanprop.track_memory(existing=[model, x]) as mem:
                model(x).square().mean().backward()
    return mem.peak_bytes


@pytest.mark.parametrize("block", [TanhBlock, AddmmBlock], ids=["tanh", "addmm"])
@pytest.mark.parametrize("q", [BatchGrad(), BatchL2Grad()], ids=repr)
def test_checkpointed_depth_adds_no_memory(block, q):
    """Under a non-reentrant checkpoint, what the recomputation made was held to the end of
    backward: each curved activation's node of the recomputed graph (kept for the Hessian,
    though no backward goes through that graph), and for weights used at the op level a
    whole recomputation per op (the op's input gradient, a backward of its own, made the
    checkpoint recompute the block again). The peak above torch's grew with depth (tiny
    GPT-2 with 8 checkpointed layers: 122 MiB against torch's 6.2)."""
    torch.manual_seed(0)
    x = torch.randn(N, T, E)

    def overhead(depth: int) -> int:  # (less the individual gradients written)
        model = Checkpointed(block, depth)
        params = sum(p.numel() for p in model.parameters())
        results = N * params * 4 if q.attr == "grad_batch" else 0
        return _peak(model, x, [q]) - _peak(model, x, []) - results

    block_bytes = N * T * 4 * E * 4  # one [N, T, 4E] activation
    assert overhead(12) - overhead(3) <= block_bytes, (overhead(12), overhead(3), block_bytes)


def test_a_gradient_handed_to_autograd_is_not_held():
    """A layer's summed gradient, handed to autograd as the parameter's whole gradient, was
    also kept for the sum check to the end of backward (where it compares with itself): a
    second copy of every such gradient at the peak."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(128, 128) for _ in range(6)))
    x = torch.randn(2, 128)
    params = sum(p.numel() * 4 for p in model.parameters())
    for q in (BatchGrad(), BatchL2Grad()):
        results = params * len(x) if q.attr == "grad_batch" else 0
        extra = _peak(model, x, [q]) - _peak(model, x, [])
        assert extra <= results + params // 4, (q, extra, results, params)


class _Scaled(nn.Module):
    """A module without a rule of its own: its parameter's gradient comes from autograd (the
    fallback's individual gradients are not it)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(128))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


@pytest.mark.parametrize(
    "use", ["curvature", "nothing asked", "unchecked BatchGrad", "unchecked fallback"]
)
def test_a_gradient_nothing_reads_is_not_held(use):
    """Where no sum check reads it (curvature alone, nothing asked, ``check=False``), each
    gradient autograd handed over was still held to the end of backward: autograd could not
    take it as ``.grad`` and copied it (twice the gradients' memory at the peak, and a copy
    of each). ``.grad`` is now the very tensor autograd handed over."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), _Scaled(), nn.Linear(128, 10))
    x, y = torch.randn(4, 128), torch.randint(0, 10, (4,))
    loss_fn = nn.CrossEntropyLoss()
    handed: dict[str, int] = {}
    hooks = [
        p.register_hook(lambda g, k=k: handed.__setitem__(k, g.data_ptr()))
        for k, p in model.named_parameters()
    ]  # (registered first: they see what autograd hands over, and hold nothing)
    quantities = {"unchecked BatchGrad": [BatchGrad()], "unchecked fallback": [BatchGrad()]}
    check = use not in ("unchecked BatchGrad", "unchecked fallback")
    with leanprop.per_sample(model, *quantities.get(use, []), check=check) as ctx:
        out = model(x)
        if use == "curvature":
            leanprop.ggn(ctx, out, loss_fn, y, leanprop.DiagGGNExact())
        loss_fn(out, y).backward()
    for h in hooks:
        h.remove()
    for k, p in model.named_parameters():
        assert p.grad.data_ptr() == handed[k], k


def test_an_op_level_linear_output_is_not_saved():
    """An op-level linear op (``addmm`` on a module's own weights) kept its output to its
    backward, for nothing: its backward needs the input and the weight. An attention
    projection's output, split into heads and copied, is otherwise freed in the forward."""
    torch.manual_seed(0)
    model = AddmmBlock()
    x = torch.randn(N, T, E)

    def held(quantities: list) -> int:
        with contextlib.ExitStack() as stack:
            if quantities:
                stack.enter_context(leanprop.per_sample(model, *quantities))
            with leanprop.track_memory(existing=[model, x]) as mem:
                loss = model(x).square().mean()
                saved = mem.current_bytes
                loss.backward()
        return saved

    output_bytes = N * T * 4 * E * 4  # the first addmm's [N T, 4E]
    assert held([BatchL2Grad()]) - held([]) < output_bytes // 2


def test_a_sum_not_taken_by_autograd_is_not_held():
    """An op's summed gradient, kept in case autograd takes it whole, was held to the end of
    backward where autograd did not (bf16 autocast: it casts it to the parameter's dtype)."""
    from leanprop.per_sample.cycle import ParamState

    p = nn.Parameter(torch.zeros(3))
    state = ParamState("p", p)
    individual = torch.ones(2, 3)
    state.add_batch(individual, summed=individual.sum(0))
    assert not state.hand_over(individual.sum(0).float(), allowed=True)  # (another tensor)
    assert state.summed is None


def test_an_op_captures_outputs_go_with_its_saved_tensors():
    """An op captured without a closed form (an eval-mode BatchNorm's) holds its local
    outputs beside its saved tensors, not among them (its result may change in place): they
    go when a backward without retain_graph frees the saved tensors, and with the graph when
    no backward comes; a retained graph keeps them for the next backward."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 3, 1), nn.BatchNorm1d(3), nn.Flatten()).eval()
    x = torch.randn(N, 3, 5)

    def held(out: torch.Tensor) -> list[weakref.ref]:
        nodes, refs = [out.grad_fn], []
        while nodes:
            node = nodes.pop()
            if node is None:
                continue
            refs += [weakref.ref(o) for o in getattr(getattr(node, "held", None), "outs", [])]
            nodes += [n for n, _ in node.next_functions]
        return refs

    with leanprop.per_sample(model, BatchGrad()):
        out = model(x)
        refs = held(out)
        assert refs and all(r() is not None for r in refs)
        out.square().sum().backward(retain_graph=True)
        assert all(r() is not None for r in refs)  # (retained: another backward may come)
        out.square().sum().backward()
        gc.collect()
        assert all(r() is None for r in refs)
        refs = held(model(x))  # (the graph dropped at once: no backward)
        gc.collect()
        assert refs and all(r() is None for r in refs)


@pytest.mark.parametrize("kind", ["DiagGGNExact", "DiagHessian"])
def test_curvature_diagonals_are_not_copied_when_written(kind):
    """Each layer's diagonal was multiplied by the sign of its term (1 for the GGN's) when
    written: a copy of the largest weight's diagonal beside it at the peak. The peak of
    ``ggn`` is now its results and the columns (small here)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x, y = torch.randn(4, 512), torch.randint(0, 10, (4,))
    results = sum(p.numel() * 4 for p in model.parameters())
    with leanprop.per_sample(model) as ctx:
        out = model(x)
        with leanprop.track_memory(existing=[model, x, out]) as mem:
            leanprop.ggn(ctx, out, nn.CrossEntropyLoss(), y, getattr(leanprop, kind)())
    assert mem.peak_bytes < 1.25 * results, (mem.peak_bytes, results)
