"""Statistics over samples (``leanprop/per_sample/stats.py``) against float64 references."""

from __future__ import annotations

import pytest
import torch

from leanprop import BatchL2Grad, SumGradSquared, Variance
from leanprop.per_sample.chunks import Scratch
from leanprop.per_sample.stats import Reducer, quantities_of

KINDS = frozenset({Variance, SumGradSquared, BatchL2Grad})


@pytest.mark.parametrize("chunks", [1, 4, 64], ids=lambda c: f"{c}-chunks")
def test_variance_is_accurate_where_the_mean_dwarfs_the_spread(chunks):
    """float32 gradients with mean 1e4 and spread 1e-2 (relative errors were 1.3e-2 in one
    chunk, 1.8e-1 across chunks): as accurate as float32 allows."""
    torch.manual_seed(0)
    b = (1e4 + 1e-2 * torch.randn(64, 50, dtype=torch.float64)).float()
    exact = b.double().var(0, unbiased=False)
    reducer = Reducer(KINDS, b[0], 64, Scratch())
    for part in b.chunk(chunks):
        reducer.add(part)
    got, total = reducer.result()
    rel = ((got[Variance.attr].double() - exact).abs() / exact).max()
    assert rel < 2e-3, f"relative error {rel:.2e}"
    if chunks == 1:
        rel_one = ((quantities_of(b, KINDS)[Variance.attr].double() - exact).abs() / exact).max()
        assert rel_one < 2e-3, f"in one piece: relative error {rel_one:.2e}"
    assert torch.allclose(total.double(), b.double().sum(0), rtol=1e-6)


@pytest.mark.parametrize("chunks", [1, 3])
def test_every_statistic_matches_float64(chunks):
    torch.manual_seed(0)
    b = torch.randn(9, 4, 3, dtype=torch.float64)
    reducer = Reducer(KINDS, b[0], 9, Scratch())
    for part in b.chunk(chunks):
        reducer.add(part)
    got, total = reducer.result()
    torch.testing.assert_close(got[Variance.attr], b.var(0, unbiased=False))
    torch.testing.assert_close(got[SumGradSquared.attr], b.square().sum(0))
    torch.testing.assert_close(got[BatchL2Grad.attr], b.flatten(1).square().sum(1))
    torch.testing.assert_close(total, b.sum(0))


def test_half_precision_statistics_do_not_overflow():
    """fp16 individual gradients of a scaled loss: the statistics accumulate in float32."""
    b = torch.full((8, 5), 300.0, dtype=torch.float16)  # 300² * 8 overflows fp16
    reducer = Reducer(KINDS, b[0].float(), 8, Scratch())
    reducer.add(b)
    got, _ = reducer.result()
    for k in (SumGradSquared.attr, BatchL2Grad.attr, Variance.attr):
        assert got[k].dtype == torch.float32 and torch.isfinite(got[k]).all(), k
    assert float(got[SumGradSquared.attr][0]) == pytest.approx(8 * 300.0**2)


def test_reducers_of_one_call_get_separate_scratch_buffers():
    """A layer's weight and bias reduced in one chunk: a rule may write both targets, so
    their scratch buffers must not alias."""
    scratch = Scratch()
    w, b, g = torch.zeros(4, 3), torch.zeros(4), torch.zeros(5, 4)
    reducers = {k: Reducer(KINDS, like, 5, scratch, k) for k, like in (("w", w), ("b", b))}
    with torch.no_grad():
        targets = {k: r.target(0, 5, g) for k, r in reducers.items()}
    assert targets["w"].data_ptr() != targets["b"].data_ptr()


@pytest.mark.parametrize(
    ("n", "per", "budget"), [(32, 10, 140), (32, 1, 10**9), (7, 100, 1), (0, 1, 1), (5, 0, 3)]
)
def test_sample_chunks_cover_the_batch_in_near_equal_chunks_within_the_budget(n, per, budget):
    from leanprop.per_sample.chunks import sample_chunks

    chunks = list(sample_chunks(n, per, budget))
    assert [i for a, b in chunks for i in range(a, b)] == list(range(n))
    sizes = [b - a for a, b in chunks]
    assert not sizes or max(sizes) - min(sizes) <= 1
    fit = max(1, budget // max(per, 1))
    assert all(s <= fit for s in sizes) and len(chunks) == -(-n // fit)


@pytest.fixture
def no_kept_buffers(monkeypatch):
    """The process's kept CPU scratch buffers, empty for the test (and as they were after)."""
    from leanprop.per_sample import chunks

    monkeypatch.setattr(chunks, "_KEPT", {})
    return chunks


def test_cpu_scratch_buffers_are_kept_for_the_next_backward(no_kept_buffers):
    """A backward's CPU scratch buffer serves the next backward (a fresh one faults its pages
    in again: a few ms per step), never two live users at once, and never beyond the cap."""
    like = torch.zeros(())
    first = Scratch()
    a = first.take((4, 100), like, "weight")
    first.clear()
    second, third = Scratch(), Scratch()
    b = second.take((2, 100), like, "weight")
    assert b.data_ptr() == a.data_ptr(), "the first backward's buffer was not reused"
    c = third.take((2, 100), like, "weight")  # (while the second still uses it)
    assert c.data_ptr() != b.data_ptr()
    second.clear()
    third.clear()  # (one buffer per device, dtype and slot is kept: the other is freed)
    assert len(no_kept_buffers._KEPT) == 1
    huge = Scratch()
    n = no_kept_buffers._KEPT_BYTES // 4 + 1
    huge.take((n,), like, "huge")
    huge.clear()
    assert set(no_kept_buffers._KEPT) == {(like.device, like.dtype, "weight")}


def test_kept_scratch_buffers_leave_results_alone(no_kept_buffers):
    """Two backward passes of BatchL2Grad whose individual gradients go through the scratch
    buffer (a sequence input: no closed form): the first's norms are not overwritten by the
    second's use of the kept buffer."""
    import leanprop

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5).double()
    xs = [torch.randn(3, 4, 6, dtype=torch.float64) for _ in range(2)]
    norms = []
    for x in xs:
        model.zero_grad()
        with leanprop.per_sample(model, BatchL2Grad()):
            model(x).square().sum().backward()
        norms.append((model.weight.batch_l2, model.weight.batch_l2.clone()))
    assert no_kept_buffers._KEPT, "no scratch buffer was used"
    for got, copy in norms:
        torch.testing.assert_close(got, copy, rtol=0, atol=0)
    x = xs[0]
    ref = torch.stack(
        [torch.einsum("to,ti->oi", 2 * model(x[i]), x[i]).square().sum() for i in range(3)]
    ).detach()
    torch.testing.assert_close(norms[0][0], ref)
