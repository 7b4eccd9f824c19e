"""The BackPACK facade's curvature, BatchDotGrad, ``retain_graph``, ``extension_hook`` and
``savefield``: against the brute-force oracles, and against BackPACK itself where installed."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from leanprop import LeanpropValueError, UnsupportedModelError
from leanprop.compat import backpack as facade
from leanprop.compat.backpack import backpack, extend, extensions
from leanprop.errors import LeanpropError
from leanprop.testing import ggn_blocks, individual_gradients, quantities_from_individual

from ..cases import build
from ..helpers import assert_close, positive_curvature_blocks

EXACT = (extensions.DiagGGNExact(), extensions.BatchDiagGGNExact(), extensions.SqrtGGNExact())


def _functional_gradients(values, params):
    """Gradients with respect to ``params`` of a fixed random linear functional of the
    quantities ``values`` (zeros where one does not depend on a parameter)."""
    gen = torch.Generator().manual_seed(3)
    f = sum((v * torch.randn(v.shape, generator=gen, dtype=v.dtype)).sum() for v in values)
    grads = torch.autograd.grad(f, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def _release(lib, model, loss_fn):
    """After one library's run: the gradients dropped, the facade's extension undone."""
    model.zero_grad(set_to_none=True)
    if lib is facade:
        facade.unextend(model)
        facade.unextend(loss_fn)


def _assert_same_values_and_gradients(found):
    """``found``: the facade's and BackPACK's ``(values, functional gradients)``, equal."""
    for ours, theirs in zip(*found, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _loss_module(case):
    return nn.CrossEntropyLoss() if not case.y.is_floating_point() else nn.MSELoss(reduction="sum")


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("name", ["mlp", "residual", "shared", "conv2d", "attention", "recurrent",
                                  "sequence", "batchnorm_eval"])  # fmt: skip
def test_curvature_and_first_order_match_the_oracles(name):
    """The loss is computed outside the block (BackPACK's usual pattern); curvature and the
    first-order quantities come from the one ``loss.backward()``."""
    case = build(name)
    model, loss_fn = extend(case.model), extend(_loss_module(case))
    try:
        loss = loss_fn(model(case.x), case.y)
        with backpack(extensions.BatchGrad(), extensions.BatchDotGrad(), *EXACT):
            loss.backward()
        ref = ggn_blocks(model, case.x, loss_fn, case.y)
        reduction = "sum" if isinstance(loss_fn, nn.MSELoss) else "mean"
        expected = individual_gradients(model, case.loss, case.x, case.y, reduction)
        for k, p in model.named_parameters():
            full, per = ref[k]
            assert_close(p.diag_ggn_exact.flatten(), full.diagonal(), f"{k}.diag", 1e-10, 1e-12)
            assert_close(p.diag_ggn_exact_batch.flatten(1), per, f"{k}.batch_diag", 1e-10, 1e-12)
            root = p.sqrt_ggn_exact.flatten(2).flatten(0, 1)
            assert_close(root.t() @ root, full, f"{k}.sqrt", 1e-10, 1e-12)
            first = quantities_from_individual(expected[k])
            for attr in ("grad_batch", "batch_dot"):
                assert_close(getattr(p, attr), first[attr], f"{k}.{attr}", 1e-9, 1e-12)
    finally:
        facade.unextend(model)
        facade.unextend(loss_fn)


def test_curvature_needs_the_extended_loss_output():
    case = build("mlp")
    model, loss_fn = extend(case.model), extend(nn.CrossEntropyLoss())
    try:
        loss = 2 * loss_fn(model(case.x), case.y)
        with (
            pytest.raises(UnsupportedModelError, match="loss module's output"),
            backpack(extensions.DiagGGNExact()),
        ):
            loss.backward()
        # a backward that does not start at an extended loss: said so, nothing stale left
        with backpack(extensions.DiagGGNExact()):
            loss_fn(model(case.x), case.y).backward()
        assert hasattr(model[0].weight, "diag_ggn_exact")
        for loss in (
            nn.CrossEntropyLoss()(model(case.x), case.y),  # not extended
            loss_fn(model(case.x), case.y).detach().requires_grad_() + model(case.x).sum(),
        ):
            with (
                pytest.raises(UnsupportedModelError, match="did not start at the output"),
                backpack(extensions.DiagGGNExact()),
            ):
                loss.backward()
            assert not hasattr(model[0].weight, "diag_ggn_exact")
        facade.unextend(loss_fn)  # its hook is removed
        with (
            pytest.raises(UnsupportedModelError, match="did not start at the output"),
            backpack(extensions.DiagGGNExact()),
        ):
            loss_fn(model(case.x), case.y).backward()
        # the loss called twice in one backward: refused (the curvature is one loss's)
        loss_fn = extend(loss_fn)
        two = loss_fn(model(case.x), case.y) + loss_fn(model(case.x[:3]), case.y[:3])
        with (
            pytest.raises(UnsupportedModelError, match="two extended losses"),
            backpack(extensions.DiagGGNExact()),
        ):
            two.backward()
        # keyword arguments; a loss module extended inline (only the graph holds it)
        for make_loss in (
            lambda: loss_fn(input=model(case.x), target=case.y),
            lambda: extend(nn.CrossEntropyLoss())(model(case.x), case.y),
        ):
            loss = make_loss()
            gc.collect()
            with backpack(extensions.DiagGGNExact()):
                loss.backward()
            assert hasattr(model[0].weight, "diag_ggn_exact")
    finally:
        facade.unextend(model)
        facade.unextend(loss_fn)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_hessian_products_under_create_graph_are_differentiable_as_backpacks():
    """``backward(create_graph=True)`` in a ``backpack(HMP())`` block: the products are
    functions of the parameters (they were refused); their values and the gradients of a
    functional of them equal BackPACK's. (PCHMP: BackPACK's residual is off, see below; its
    derivatives are checked against finite differences in test_curvature.py.)"""
    bp = pytest.importorskip("backpack")
    torch.manual_seed(0)
    x, y = torch.randn(6, 4).double(), torch.randint(0, 3, (6,))
    gen = torch.Generator().manual_seed(4)
    found = []
    for lib in (facade, bp):
        torch.manual_seed(1)
        model = nn.Sequential(
            nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3)
        ).double()
        model, loss_fn = lib.extend(model), lib.extend(nn.CrossEntropyLoss())
        with lib.backpack(lib.extensions.HMP()):
            loss_fn(model(x), y).backward(create_graph=True)
        if not found:
            mats = [torch.randn(2, *p.shape, generator=gen).double() for p in model.parameters()]
        values = [p.hmp(m) for p, m in zip(model.parameters(), mats, strict=True)]
        assert all(v.requires_grad for v in values)
        found.append((values, _functional_gradients(values, list(model.parameters()))))
        for p in model.parameters():
            del p.hmp
        _release(lib, model, loss_fn)
    _assert_same_values_and_gradients(found)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_curvature_under_create_graph_is_differentiable_as_backpacks(loss):
    """``backward(create_graph=True)`` in a ``backpack(DiagGGNExact(), ...)`` block: the
    quantities and the gradients of a functional of them equal BackPACK's (the Hessian's
    diagonals too: two curved activations, the first one's layer fed the data)."""
    bp = pytest.importorskip("backpack")
    torch.manual_seed(0)
    make = (
        (nn.CrossEntropyLoss, torch.randint(0, 3, (6,)))
        if loss == "ce"
        else (lambda: nn.MSELoss(reduction="sum"), torch.randn(6, 3).double())
    )
    x = torch.randn(6, 4).double()
    exts = ("DiagGGNExact", "BatchDiagGGNExact", "DiagGGNMC", "DiagHessian", "BatchDiagHessian")
    found = []
    for lib in (facade, bp):
        torch.manual_seed(1)
        model = nn.Sequential(
            nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3)
        ).double()
        model, loss_fn = lib.extend(model), lib.extend(make[0]())
        with lib.backpack(*(getattr(lib.extensions, e)() for e in exts)):
            torch.manual_seed(2)  # (the Monte-Carlo draws: BackPACK's, from torch's generator)
            loss_fn(model(x), make[1]).backward(create_graph=True)
        attrs = ("diag_ggn_exact", "diag_ggn_exact_batch", "diag_h", "diag_h_batch")
        values = [getattr(p, a) for p in model.parameters() for a in attrs]
        # (MSE's last bias: a constant diagonal, no graph needed)
        assert sum(v.requires_grad for v in values) >= len(values) - 4 * (loss == "mse")
        found.append((values, _functional_gradients(values, list(model.parameters()))))
        assert model[0].weight.diag_ggn_mc.requires_grad
        _release(lib, model, loss_fn)
    _assert_same_values_and_gradients(found)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.parametrize("how", ["grad", "backward"])
def test_after_a_create_graph_backward_another_one_is_refused_not_stale(how):
    """In a plain ``backpack(...)`` block a second backward through one forward is refused
    (the facade keeps the layers' inputs for one); after a create_graph backward it was let
    through, with the first one's results left as its own. Differentiating the results (a
    penalty on the individual gradients) is no such backward: it computes nothing."""
    case = build("mlp")
    model, loss_fn = extend(case.model), extend(nn.CrossEntropyLoss())
    params = list(model.parameters())
    try:
        with backpack(extensions.BatchGrad()):
            loss = loss_fn(model(case.x), case.y)
            loss.backward(create_graph=True, retain_graph=True)
            first = [p.grad_batch for p in params]
            penalty = sum(p.grad_batch.square().sum() for p in params)
            torch.autograd.grad(penalty, params, retain_graph=True)
            assert all(p.grad_batch is f for p, f in zip(params, first, strict=True))
            with pytest.raises(UnsupportedModelError, match="second backward through the same"):
                if how == "grad":
                    torch.autograd.grad(3 * loss, params)
                else:
                    (3 * loss).backward()
    finally:
        model.zero_grad(set_to_none=True)
        facade.unextend(model)
        facade.unextend(loss_fn)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize(
    ("kind", "conv", "loss"),
    [("KFLR", False, "ce"), ("KFLR", False, "mse"), ("KFLR", True, "ce"), ("KFLR", True, "mse"),
     ("KFRA", False, "ce")],
)  # fmt: skip
def test_kronecker_factors_under_create_graph_are_differentiable_as_backpacks(kind, conv, loss):
    """(BackPACK's KFRA has MSE's Hessian in float32 whatever the model's dtype: CE only.)"""
    bp = pytest.importorskip("backpack")
    found = []
    for lib in (facade, bp):
        torch.manual_seed(1)
        if conv:
            model = nn.Sequential(
                nn.Conv2d(2, 3, 3, padding=1), nn.Sigmoid(), nn.Flatten(), nn.Linear(75, 3)
            ).double()
            x = torch.randn(6, 2, 5, 5).double()
        else:
            model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
            x = torch.randn(6, 4).double()
        y = torch.randint(0, 3, (6,)) if loss == "ce" else torch.randn(6, 3).double()
        loss_fn = nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss()
        model, loss_fn = lib.extend(model), lib.extend(loss_fn)
        with lib.backpack(getattr(lib.extensions, kind)()):
            loss_fn(model(x), y).backward(create_graph=True)
        values = [t for p in model.parameters() for t in getattr(p, kind.lower())]
        found.append((values, _functional_gradients(values, list(model.parameters()))))
        _release(lib, model, loss_fn)
    _assert_same_values_and_gradients(found)


def test_retain_graph_gives_each_backward_its_own_results():
    """BackPACK's batched-Jacobian pattern: one backward per output through one forward, each
    with the individual gradients of that output, also through modules hooked as a whole."""
    case = build("recurrent")
    model = extend(case.model)
    try:
        out = model(case.x)
        rows = []
        for k in range(out.shape[1]):
            with backpack(extensions.BatchGrad(), retain_graph=True):
                out[:, k].sum().backward(retain_graph=True)
            rows.append({n: p.grad_batch.clone() for n, p in model.named_parameters()})
            model.zero_grad()
        for k, row in enumerate(rows):
            expected = individual_gradients(
                model, lambda o, y, r, k=k: o[:, k].sum(), case.x, case.y, "sum"
            )
            for n, g in row.items():
                assert_close(g, expected[n], f"output {k}: {n}", 1e-9, 1e-12)
        # without retain_graph, a second backward is refused clearly
        out = model(case.x)
        with backpack(extensions.BatchGrad()):
            out[:, 0].sum().backward(retain_graph=True)
        with (
            pytest.raises(UnsupportedModelError, match="second backward"),
            backpack(extensions.BatchGrad()),
        ):
            out[:, 1].sum().backward()
    finally:
        facade.unextend(model)


def test_extension_hook_sees_each_module_after_its_quantities():
    case = build("mlp")
    model = extend(case.model)
    seen = []

    def hook(module):
        if isinstance(module, nn.Linear):
            seen.append((module, module.weight.grad_batch.shape))

    try:
        loss = nn.functional.cross_entropy(model(case.x), case.y)
        with backpack(extensions.BatchGrad(), extension_hook=hook):
            loss.backward()
        assert [m for m, _ in seen] == [model[2], model[0]]  # last layer first
        assert seen[0][1] == (6, *model[2].weight.shape)
    finally:
        facade.unextend(model)


def test_savefield_and_bad_extensions():
    assert extensions.DiagGGNMC(2).savefield == "diag_ggn_mc"
    assert extensions.BatchDotGrad().savefield == "batch_dot"
    with (
        pytest.raises(LeanpropValueError, match="same mc_samples"),
        backpack(extensions.DiagGGNMC(1), extensions.SqrtGGNMC(3)),
    ):
        pass


# ---------------------------------------------------------------- against BackPACK


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.filterwarnings("ignore:Extension saving to")
@pytest.mark.parametrize("loss", ["ce", "mse", "bce"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_against_backpack(name, loss):
    bp = pytest.importorskip("backpack")
    torch.manual_seed(0)
    k = 1 if loss == "bce" else 3  # (BackPACK's BCEWithLogitsLoss: one output per sample)
    if name == "mlp":
        model, x = nn.Sequential(nn.Linear(6, 5), nn.Sigmoid(), nn.Linear(5, k)), torch.randn(7, 6)
    else:
        model = nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2, padding=1),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(4 * 4 * 4, k),
        )
        x = torch.randn(5, 2, 8, 8)
    model, x = model.double(), x.double()
    loss_fn = {"ce": nn.CrossEntropyLoss(), "mse": nn.MSELoss(), "bce": nn.BCEWithLogitsLoss()}[
        loss
    ]
    y = torch.randint(0, 3, (x.shape[0],)) if loss == "ce" else torch.rand(x.shape[0], k).double()
    exts = ("DiagGGNExact", "BatchDiagGGNExact", "SqrtGGNExact", "KFLR", "DiagHessian",
            "BatchDiagHessian")  # fmt: skip
    exts += ("GGNMP", "HMP") if loss != "bce" else ()  # (BackPACK's have no BCE)
    ours = extend(model)
    ours_loss = extend(loss_fn)
    try:
        with backpack(*(getattr(extensions, e)() for e in exts)):
            ours_loss(ours(x), y).backward()
        mine = {k: {e: getattr(p, getattr(extensions, e)().attr) for e in exts}
                for k, p in model.named_parameters()}  # fmt: skip
    finally:
        facade.unextend(model)
        facade.unextend(ours_loss)
        model.zero_grad()
    theirs_model, theirs_loss = bp.extend(model), bp.extend(type(loss_fn)())
    with bp.backpack(*(getattr(bp.extensions, e)() for e in exts)):
        theirs_loss(theirs_model(x), y).backward()
    for k, p in model.named_parameters():
        for e in exts:
            attr = getattr(extensions, e)().attr
            theirs = getattr(p, attr)
            if e == "SqrtGGNExact":  # the same factor up to its columns' order and signs
                a, b = (t.flatten(2).flatten(0, 1) for t in (mine[k][e], theirs))
                assert_close(a.t() @ a, b.t() @ b, f"{k}.{e}", 1e-10, 1e-12)
            elif e in ("GGNMP", "HMP"):  # functions: the same products
                mat = torch.randn(2, *p.shape, dtype=p.dtype)
                assert_close(mine[k][e](mat), theirs(mat), f"{k}.{e}", 1e-10, 1e-12)
            elif e == "KFLR":  # lists of Kronecker factors
                assert len(mine[k][e]) == len(theirs)
                for i, (a, b) in enumerate(zip(mine[k][e], theirs, strict=True)):
                    assert_close(a, b, f"{k}.{e}[{i}]", 1e-10, 1e-12)
            else:
                assert_close(mine[k][e], theirs, f"{k}.{e}", 1e-10, 1e-12)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_subsampling_against_backpack():
    bp = pytest.importorskip("backpack")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
    pick = [1, 5, 2]
    ours, lf = extend(model), extend(nn.CrossEntropyLoss())
    try:
        loss = lf(ours(x), y)
        with backpack(
            extensions.BatchGrad(subsampling=pick), extensions.SqrtGGNExact(subsampling=pick)
        ):
            loss.backward()
        mine = {k: (p.grad_batch, p.sqrt_ggn_exact) for k, p in model.named_parameters()}
    finally:
        facade.unextend(model)
        facade.unextend(lf)
        model.zero_grad()
    theirs, tl = bp.extend(model), bp.extend(nn.CrossEntropyLoss())
    loss = tl(theirs(x), y)
    with bp.backpack(
        bp.extensions.BatchGrad(subsampling=pick), bp.extensions.SqrtGGNExact(subsampling=pick)
    ):
        loss.backward()
    for k, p in model.named_parameters():
        assert_close(mine[k][0], p.grad_batch, f"{k}.grad_batch", 1e-12, 1e-14)
        a, b = (t.flatten(2) for t in (mine[k][1], p.sqrt_ggn_exact))
        assert a.shape == b.shape
        for n in range(len(pick)):  # each sample's GGN share: the same
            assert_close(
                a[:, n].t() @ a[:, n], b[:, n].t() @ b[:, n], f"{k} sample {n}", 1e-10, 1e-12
            )


def test_the_diag_ggn_optimizer_example_trains():
    import runpy

    path = (
        __import__("pathlib").Path(__file__).parents[2]
        / "examples"
        / "backpack_diag_ggn_optimizer.py"
    )
    losses = runpy.run_path(str(path))["main"](steps=5)
    assert losses[-1] < losses[0] - 0.2


def test_retain_graph_with_curvature():
    """Each backward through the retained graph computes its own curvature (the curvature
    passes nested in the first do not end the block's retention)."""
    case = build("mlp")
    model, lf = extend(case.model), extend(nn.CrossEntropyLoss())
    try:
        ref = ggn_blocks(model, case.x, nn.CrossEntropyLoss(), case.y)  # (runs the model)
        loss = lf(model(case.x), case.y)
        with backpack(extensions.BatchGrad(), extensions.DiagGGNExact(), retain_graph=True):
            for _ in range(2):
                loss.backward(retain_graph=True)
                for k, p in model.named_parameters():
                    assert_close(p.diag_ggn_exact.flatten(), ref[k][0].diagonal(), k, 1e-10, 1e-12)
    finally:
        facade.unextend(model)
        facade.unextend(lf)


def test_a_child_extended_before_its_parent():
    """``extend(model[0])`` then ``extend(model)``: each parameter's curvature once, and each
    layer's Kronecker factors once (it was taken for a shared layer)."""
    case = build("mlp")
    model = case.model
    extend(model[0])
    model, lf = extend(model), extend(nn.CrossEntropyLoss())
    try:
        ref = ggn_blocks(model, case.x, nn.CrossEntropyLoss(), case.y)
        loss = lf(model(case.x), case.y)
        with backpack(extensions.DiagGGNExact(), extensions.KFLR()):
            loss.backward()
        for k, p in model.named_parameters():
            assert_close(p.diag_ggn_exact.flatten(), ref[k][0].diagonal(), k, 1e-10, 1e-12)
            assert len(p.kflr) == (2 if k.endswith("weight") else 1)
    finally:
        facade.unextend(model[0])
        facade.unextend(model)
        facade.unextend(lf)


def test_nested_blocks_the_inner_one_acts():
    """Inside a block, an inner block's backward passes are its own (as in BackPACK): the outer
    block's curvature check raised a false error for them, its extension_hook ran for them, and
    its BatchGrad(subsampling=...) was lost after the inner block."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    loss_fn = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    seen: list[nn.Module] = []
    with backpack(extensions.BatchGrad(subsampling=[0, 1]), extension_hook=seen.append):
        with backpack(extensions.DiagGGNExact()):
            loss_fn(model(x), y).backward()
        assert hasattr(model[0].weight, "diag_ggn_exact") and not seen
        assert not hasattr(model[0].weight, "grad_batch")
        model.zero_grad()
        loss_fn(model(x), y).backward()
    assert model[0].weight.grad_batch.shape == (2, 4, 3) and seen
    model.zero_grad()
    with backpack(extensions.DiagGGNExact()):
        with backpack(extensions.BatchGrad()):
            model(x).sum().backward()  # (not from the loss: the inner block has no curvature)
        assert model[0].weight.grad_batch.shape == (5, 4, 3)
        model.zero_grad()
        loss_fn(model(x), y).backward()
    assert hasattr(model[0].weight, "diag_ggn_exact")
    facade.unextend(model)


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):  # x [N, T, 3]
        q = self.q(x).unflatten(-1, (2, 2)).transpose(1, 2)  # [N, heads, T, 2]
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return self.head(a.transpose(1, 2).flatten(2).mean(1))


def test_hmp_block_keeps_the_graph_for_its_products_only():
    """``backpack(HMP())``: ``loss.backward()`` inside the block keeps the forward's graph for
    ``p.hmp`` (exact against autograd's Hessian), a backward after the block frees its graph
    as usual, and an op without a second derivative (the fused attention kernel) is named."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from leanprop.testing import hessian_blocks

    torch.manual_seed(0)
    model = _SelfAttention().double()
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    lf = nn.CrossEntropyLoss()
    ours, ours_loss = extend(model), extend(lf)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            with backpack(extensions.HMP()):
                ours_loss(ours(x), y).backward()
            ref = hessian_blocks(model, x, lf, y)
            for k, p in model.named_parameters():
                mat = torch.randn(2, *p.shape, dtype=p.dtype)
                assert_close(p.hmp(mat).flatten(1), mat.flatten(1) @ ref[k], k, 1e-10, 1e-12)
            loss = ours_loss(ours(x), y)
            loss.backward()  # outside the block: the graph is freed
            with pytest.raises(RuntimeError, match="second time"):
                loss.backward()
        with backpack(extensions.HMP()):  # the fused attention kernel
            ours_loss(ours(x), y).backward()
        with pytest.raises(UnsupportedModelError, match="sdpa_kernel"):
            model.q.weight.hmp(torch.ones(1, *model.q.weight.shape, dtype=torch.float64))
    finally:
        facade.unextend(model)
        facade.unextend(ours_loss)


def test_hmp_block_with_a_mode_left_open_inside_is_refused_clearly():
    """A TorchFunctionMode entered inside a ``backpack(HMP())`` block and not exited before
    it: the facade's own mode cannot be removed; it is switched off (later backward calls free
    their graph as usual) and the block says so."""
    from torch.overrides import TorchFunctionMode

    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    other = Other()
    with pytest.raises(LeanpropError, match="reverse order"), backpack(extensions.HMP()):
        other.__enter__()
    try:
        loss = (torch.randn(3, requires_grad=True) ** 2).sum()
        loss.backward()
        with pytest.raises(RuntimeError, match="second time"):
            loss.backward()
    finally:
        other.__exit__(None, None, None)  # (exit pops the innermost mode: this one,
        other.__exit__(None, None, None)  # then the facade's idle one)


def _curved_mlp():
    """A float64 MLP with sigmoid and tanh activations, its inputs, labels and loss."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)
    ).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    return model, x, y, nn.CrossEntropyLoss()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("modify", ["clip", "abs"])
def test_pchmp_against_the_definition_and_backpack(modify):
    """``extensions.PCHMP(modify=...)``: the positive-curvature Hessian's blocks by their
    definition (residuals ``σ''(z) δ`` made non-negative). BackPACK 1.7.1 multiplies its
    residual by ``δ`` twice (its elementwise ``hessian_diagonal`` already includes ``δ``, and
    ``PCHMPBase`` multiplies by it again): its products are those of ``σ''(z) δ²``, checked
    here so that a fixed BackPACK shows up."""
    import copy

    model, x, y, lf = _curved_mlp()
    base = copy.deepcopy(model)
    ref = positive_curvature_blocks(base, x, lf, y)[modify]
    ours, ours_loss = extend(model), extend(lf)
    try:
        with backpack(extensions.PCHMP(modify=modify)):
            ours_loss(ours(x), y).backward()
        for k, p in model.named_parameters():
            mat = torch.randn(2, *p.shape, dtype=p.dtype)
            assert_close(p.pchmp(mat).flatten(1), mat.flatten(1) @ ref[k], k, 1e-10, 1e-12)
    finally:
        facade.unextend(model)
        facade.unextend(ours_loss)
    bp = pytest.importorskip("backpack")
    theirs_ref = positive_curvature_blocks(base, x, lf, y, power=2)[modify]
    theirs, theirs_loss = bp.extend(base), bp.extend(nn.CrossEntropyLoss())
    with bp.backpack(bp.extensions.PCHMP(modify=modify)):
        theirs_loss(theirs(x), y).backward()
    for k, p in base.named_parameters():
        mat = torch.randn(2, *p.shape, dtype=p.dtype)
        assert_close(p.pchmp(mat).flatten(1), mat.flatten(1) @ theirs_ref[k], k, 1e-10, 1e-12)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_products_saved_under_their_savefield():
    """``HMP/GGNMP/PCHMP(savefield=...)`` as BackPACK's gallery uses them: two PCHMPs of
    either modification in one block, each stored under its own name, against the blocks'
    definitions; the same name twice is refused up front, a bad one too."""
    import copy

    from leanprop.testing import hessian_blocks

    model, x, y, lf = _curved_mlp()
    base = copy.deepcopy(model)
    positive = positive_curvature_blocks(base, x, lf, y)
    refs = {"pc_clip": positive["clip"], "pc_abs": positive["abs"]}
    refs["h"] = hessian_blocks(base, x, lf, y)
    refs["g"] = {k: v[0] for k, v in ggn_blocks(base, x, lf, y).items()}
    quantities = (
        extensions.PCHMP(savefield="pc_clip", modify="clip"),
        extensions.PCHMP(savefield="pc_abs", modify="abs"),
        extensions.HMP(savefield="h"),
        extensions.GGNMP(savefield="g"),
    )
    ours, ours_loss = extend(model), extend(lf)
    try:
        with backpack(*quantities):
            ours_loss(ours(x), y).backward()
        for k, p in model.named_parameters():
            assert not hasattr(p, "pchmp") and not hasattr(p, "hmp") and not hasattr(p, "ggnmp")
            mat = torch.randn(2, *p.shape, dtype=p.dtype)
            for name, ref in refs.items():
                got = getattr(p, name)(mat).flatten(1)
                assert_close(got, mat.flatten(1) @ ref[k], f"{k}.{name}", 1e-10, 1e-12)
            for name in refs:
                delattr(p, name)
        twice = (extensions.PCHMP(modify="clip"), extensions.PCHMP(modify="abs"))
        with pytest.raises(LeanpropValueError, match=r"p\.pchmp"), backpack(*twice):
            pass
    finally:
        facade.unextend(model)
        facade.unextend(ours_loss)
    for bad in ("not a name", "grad", "data", "register_hook", "_hooks", "grad_batch"):
        with pytest.raises(LeanpropValueError, match="attribute name of its own"):
            extensions.HMP(savefield=bad)
    # (BackPACK's signatures: savefield first)
    assert extensions.PCHMP("pc", "abs") == extensions.PCHMP(savefield="pc", modify="abs")
    assert extensions.HMP("h").savefield == "h" and extensions.GGNMP("g").savefield == "g"


def _facade_then_backpack(bp, model, loss_type, x, y, names, seed=0):
    """The facade's results ``{param name: {attr: value}}`` for the extensions ``names``;
    then BackPACK's own, left on the parameters (each run starts from ``seed``: the same
    dropout masks)."""
    ours, ours_loss = extend(model), extend(loss_type())
    try:
        torch.manual_seed(seed)
        with backpack(*(getattr(extensions, e)() for e in names)):
            ours_loss(ours(x), y).backward()
        attrs = [getattr(extensions, e)().attr for e in names]
        mine = {k: {a: getattr(p, a) for a in attrs} for k, p in model.named_parameters()}
    finally:
        facade.unextend(model)
        facade.unextend(ours_loss)
        model.zero_grad()
    theirs_model, theirs_loss = bp.extend(model), bp.extend(loss_type())
    torch.manual_seed(seed)
    with bp.backpack(*(getattr(bp.extensions, e)() for e in names)):
        theirs_loss(theirs_model(x), y).backward()
    return mine


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("act", [nn.ReLU, nn.Sigmoid, nn.Tanh])
def test_kfra_against_backpack(act, loss):
    """BackPACK averages after every module (dropout and the activation after it separately:
    the average of the product differs). Its MSE's Hessian is float32 whatever the model's
    dtype: MSE runs in float32."""
    bp = pytest.importorskip("backpack")
    dtype = torch.float64 if loss == "ce" else torch.float32
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(6, 5), nn.Dropout(0.3), act(), nn.Linear(5, 4, bias=False)]
    model = nn.Sequential(*layers, act(), nn.Linear(4, 3)).to(dtype)
    x = torch.randn(7, 2, 3, dtype=dtype)
    y = torch.randint(0, 3, (7,)) if loss == "ce" else torch.randn(7, 3, dtype=dtype)
    loss_type = nn.CrossEntropyLoss if loss == "ce" else nn.MSELoss
    mine = _facade_then_backpack(bp, model, loss_type, x, y, ["KFRA"], seed=1)
    tol = (1e-10, 1e-13) if dtype == torch.float64 else (1e-5, 1e-7)
    for k, p in model.named_parameters():
        assert len(mine[k]["kfra"]) == len(p.kfra), k
        for i, (a, b) in enumerate(zip(mine[k]["kfra"], p.kfra, strict=True)):
            assert_close(a, b, f"{k}.kfra[{i}]", *tol)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize(
    ("d", "pools"), [(1, False), (2, False), (3, False), (2, True)],
    ids=["conv1d", "conv2d", "conv3d", "conv2d-pools"],
)  # fmt: skip
def test_kfra_on_convolutions_against_backpack(d, pools):
    """KFRA through convolutions, pooling, padding and a flatten (BackPACK has 2d pooling
    modules only). BackPACK 1.7.1's max and average pooling fail in float64 (their
    temporaries are float32): those run in float32; the others in float64."""
    bp = pytest.importorskip("backpack")
    dtype = torch.float32 if pools else torch.float64
    conv, max_pool, avg_pool = {
        1: (nn.Conv1d, nn.MaxPool1d, nn.AvgPool1d), 2: (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d),
        3: (nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d),
    }[d]  # fmt: skip
    torch.manual_seed(0)
    between = [max_pool(2), nn.ZeroPad2d((1, 0, 0, 1))] if pools else []
    after = [avg_pool(2)] if pools else []
    side = {1: 9, 2: 8, 3: 5}[d]
    x = torch.randn(5, 2, *([side] * d), dtype=dtype)
    model = nn.Sequential(conv(2, 3, 3, padding=1), nn.ReLU(), *between,
                          conv(3, 4, 2, stride=2, padding=1), nn.Sigmoid(), *after, nn.Flatten(),
                          nn.LazyLinear(5), nn.Tanh(), nn.Linear(5, 3))  # fmt: skip
    model(x.float())
    model = model.to(dtype)
    y = torch.randint(0, 3, (5,))
    mine = _facade_then_backpack(bp, model, nn.CrossEntropyLoss, x, y, ["KFRA"])
    tol = (1e-10, 1e-13) if dtype == torch.float64 else (1e-5, 1e-7)
    for k, p in model.named_parameters():
        assert len(mine[k]["kfra"]) == len(p.kfra), k
        for i, (a, b) in enumerate(zip(mine[k]["kfra"], p.kfra, strict=True)):
            assert_close(a, b, f"{k}.kfra[{i}]", *tol)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_token_level_cross_entropy_against_backpack():
    """Cross-entropy on [N, C, T] (classes second, a target per position), as BackPACK takes
    it; T == N + 3 and a 1x1 convolution over the positions."""
    bp = pytest.importorskip("backpack")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 6, 1), nn.Tanh(), nn.Conv1d(6, 5, 1)).double()
    x, y = torch.randn(3, 4, 6, dtype=torch.float64), torch.randint(0, 5, (3, 6))
    names = ["DiagGGNExact", "BatchDiagGGNExact"]
    mine = _facade_then_backpack(bp, model, nn.CrossEntropyLoss, x, y, names)
    for k, p in model.named_parameters():
        for attr in ("diag_ggn_exact", "diag_ggn_exact_batch"):
            assert_close(mine[k][attr], getattr(p, attr), f"{k}.{attr}", 1e-10, 1e-13)
