"""The facade's ``hessianfree`` helpers and ``custom_module`` building blocks: against autograd
oracles, and BackPACK's own helpers where installed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leanprop import LeanpropError, LeanpropValueError
from leanprop.compat import backpack as facade
from leanprop.compat.backpack import backpack, extend, extensions
from leanprop.compat.backpack.custom_module.branching import ActiveIdentity, Parallel, SumModule
from leanprop.compat.backpack.custom_module.pad import Pad
from leanprop.compat.backpack.custom_module.permute import Permute
from leanprop.compat.backpack.custom_module.reduce_tuple import ReduceTuple
from leanprop.compat.backpack.custom_module.scale_module import ScaleModule
from leanprop.compat.backpack.custom_module.slicing import Slicing
from leanprop.compat.backpack.hessianfree.ggnvp import ggn_vector_product
from leanprop.compat.backpack.hessianfree.hvp import hessian_vector_product
from leanprop.compat.backpack.hessianfree.lop import L_op
from leanprop.compat.backpack.hessianfree.rop import R_op
from leanprop.testing import ggn_blocks, individual_gradients, quantities_from_individual

from ..helpers import assert_close


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    return model, x, y, nn.CrossEntropyLoss()


def _flat(ts):
    return torch.cat([t.flatten() for t in ts])


def test_hessian_free_products_against_autograd():
    model, x, y, loss_fn = _problem()
    params = list(model.parameters())
    v = [torch.randn_like(p) for p in params]
    out = model(x)
    loss = loss_fn(out, y)

    names = [k for k, _ in model.named_parameters()]

    def loss_of(*ps):
        weights = dict(zip(names, ps, strict=True))
        return loss_fn(torch.func.functional_call(model, weights, (x,)), y)

    _, hv = torch.autograd.functional.hvp(loss_of, tuple(p.detach() for p in params), tuple(v))
    assert_close(_flat(hessian_vector_product(loss, params, v)), _flat(hv), "Hv", 1e-10, 1e-12)
    u = torch.randn_like(out)
    (jt_u,) = [torch.autograd.grad(out, params, u, retain_graph=True)]
    assert_close(_flat(L_op(out, params, u)), _flat(jt_u), "J^T u", 1e-12, 1e-14)
    (jv,) = R_op(out, params, v)
    # <J v, u> = <v, J^T u>
    assert_close((jv * u).sum(), (_flat(v) * _flat(jt_u)).sum(), "J v", 1e-10, 1e-12)
    gv = ggn_vector_product(loss, out, model, v)
    assert [g.shape for g in gv] == [p.shape for p in params]
    full = _full_ggn(model, x, loss_fn, y)  # (G v crosses the parameters' blocks)
    assert_close(_flat(gv), full @ _flat(v), "G v", 1e-10, 1e-12)


def _full_ggn(model, x, loss_fn, y):
    """G over all parameters at once (the oracle for products that cross blocks)."""
    from torch.func import functional_call, jacrev

    params = {k: p.detach() for k, p in model.named_parameters()}
    out = functional_call(model, params, (x,))
    jac = jacrev(lambda ps: functional_call(model, ps, (x,)))(params)
    j = torch.cat([jac[k].reshape(out.numel(), -1) for k in params], 1)
    h = torch.autograd.functional.hessian(lambda o: loss_fn(o, y), out).reshape(out.numel(), -1)
    return j.t() @ h @ j


def test_hessian_free_products_equal_backpacks():
    hf = pytest.importorskip("backpack.hessianfree.ggnvp")
    hvp = pytest.importorskip("backpack.hessianfree.hvp")
    model, x, y, loss_fn = _problem()
    params = list(model.parameters())
    v = [torch.randn_like(p) for p in params]
    out = model(x)
    loss = loss_fn(out, y)
    ours, theirs = (
        ggn_vector_product(loss, out, model, v),
        hf.ggn_vector_product(loss, out, model, v),
    )
    assert_close(_flat(ours), _flat(theirs), "ggnvp", 1e-12, 1e-14)
    ours, theirs = (
        hessian_vector_product(loss, params, v),
        hvp.hessian_vector_product(loss, params, v),
    )
    assert_close(_flat(ours), _flat(theirs), "hvp", 1e-12, 1e-14)


class _Blocks(nn.Module):
    """Every building block in one model: parallel branches summed, a scaled branch, padding,
    a permutation, slicing, and an LSTM's output taken from its tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.par = Parallel(
            nn.Linear(4, 6), nn.Sequential(nn.Linear(4, 6), ScaleModule(0.5)), ActiveIdentity2()
        )
        self.pad = Pad((1, 1))
        self.perm = Permute(0, 2, 1)
        self.lstm = nn.LSTM(8, 3, batch_first=True)
        self.take = ReduceTuple(0)
        self.cut = Slicing((slice(None), -1))

    def forward(self, x):  # x [N, T, 4]
        h = self.pad(self.par(x))  # [N, T, 8]
        h = self.perm(self.perm(h))  # back and forth
        return self.cut(self.take(self.lstm(h)))  # [N, 3]


class ActiveIdentity2(nn.Module):
    """A third branch of the right width: the first 6 features through ActiveIdentity."""

    def __init__(self) -> None:
        super().__init__()
        self.id, self.lin = ActiveIdentity(), nn.Linear(4, 6)

    def forward(self, x):
        return self.id(self.lin(x))


def test_custom_modules_work_with_every_quantity():
    torch.manual_seed(0)
    model = _Blocks().double()
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    _check_against_oracles(model, x, y, extensions.BatchGrad())


def test_use_converter_is_accepted_and_changes_nothing():
    """``extend(model, use_converter=True)`` (BackPACK's graph conversion: leanprop follows
    any graph without it) gives the same exact quantities on a model with branches."""
    torch.manual_seed(0)
    model = _Blocks().double()
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    _check_against_oracles(model, x, y, extensions.BatchGrad(), use_converter=True)


def _check_against_oracles(model, x, y, batch_grad, use_converter=False):
    """BatchGrad (``batch_grad``), Variance and DiagGGNExact through the facade, against the
    per-sample loop and ``J^T H J``."""
    loss_fn = nn.CrossEntropyLoss()
    model, lf = extend(model, use_converter=use_converter), extend(loss_fn)
    try:
        loss = lf(model(x), y)
        with backpack(batch_grad, extensions.Variance(), extensions.DiagGGNExact()):
            loss.backward()
        expected = individual_gradients(
            model, lambda o, t, r: nn.functional.cross_entropy(o, t, reduction=r), x, y, "mean"
        )
        blocks = ggn_blocks(model, x, loss_fn, y)
        for k, p in model.named_parameters():
            ref = quantities_from_individual(expected[k])
            assert_close(p.grad_batch, ref["grad_batch"], k, 1e-9, 1e-12)
            assert_close(p.variance, ref["variance"], k, 1e-9, 1e-12)
            assert_close(p.diag_ggn_exact.flatten(), blocks[k][0].diagonal(), k, 1e-9, 1e-12)
    finally:
        facade.unextend(model)
        facade.unextend(lf)
        facade.unextend(lf)


def test_custom_module_errors():
    with pytest.raises(LeanpropValueError, match="float"):
        ScaleModule(2)
    with pytest.raises(LeanpropValueError, match="one shape"):
        SumModule()(torch.zeros(2), torch.zeros(3))
    with pytest.raises(LeanpropValueError, match="two dimensions"):
        Permute(0, 2, 1, init_transpose=True)
    assert Permute(1, 2, init_transpose=True)(torch.zeros(2, 3, 4)).shape == (2, 4, 3)


# ---------------------------------------------------------------- custom module extensions


class _Scale(nn.Module):
    """BackPACK's custom-module example: the input times a learned scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.7], dtype=torch.float64))

    def forward(self, x):
        return x * self.weight


def test_a_custom_module_extension_serves_every_quantity():
    from leanprop.compat.backpack.extensions.firstorder.base import FirstOrderModuleExtension

    class ScaleBatchGrad(FirstOrderModuleExtension):
        def __init__(self):
            super().__init__(params=["weight"])

        def weight(self, ext, module, g_inp, g_out, bp_quantities):
            assert ext.get_subsampling() is None  # (called for all samples)
            assert module.output.shape == module.input0.shape == g_out[0].shape
            calls.append(g_out[0].shape)
            return (g_out[0] * module.input0).flatten(start_dim=1).sum(1).unsqueeze(-1)

    calls = []

    class OtherBatchGrad(ScaleBatchGrad):
        pass

    extension = extensions.BatchGrad()
    extension.set_module_extension(_Scale, ScaleBatchGrad())
    extensions.BatchGrad().set_module_extension(_Scale, ScaleBatchGrad())  # (again, each step)
    with pytest.raises(LeanpropValueError, match="overwrite=True"):
        extension.set_module_extension(_Scale, OtherBatchGrad())
    with pytest.raises(LeanpropValueError, match="overwrite=True"):
        extension.set_module_extension(nn.Linear, ScaleBatchGrad())  # (a built-in rule)
    with pytest.warns(UserWarning, match="does not call this extension's functions"):
        extensions.Variance().set_module_extension(_Scale, ScaleBatchGrad())
    with pytest.raises(LeanpropValueError, match="ModuleExtension subclass"):
        extensions.Variance().set_module_extension(_Scale, object())

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), _Scale(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    _check_against_oracles(model, x, y, extension)
    assert calls and calls[-1] == (6, 5)  # the extension computed them (once per pass)

    subsampled = extensions.BatchGrad(subsampling=[4, 1])
    assert subsampled.get_subsampling() == [4, 1] and extension.get_subsampling() is None
    model = extend(model)
    with backpack(subsampled):
        nn.CrossEntropyLoss()(model(x), y).backward()
    want = individual_gradients(
        model, lambda o, t, r: nn.functional.cross_entropy(o, t, reduction=r), x, y, "mean"
    )
    assert_close(model[2].weight.grad_batch, want["2.weight"][[4, 1]], "w", 1e-12, 1e-14)
    facade.unextend(model)

    class Incomplete(FirstOrderModuleExtension):
        def __init__(self):
            super().__init__(params=["bias"])

    with pytest.raises(LeanpropValueError, match="no method 'bias'"):
        Incomplete()


def test_second_order_module_extensions_are_accepted_and_the_result_is_exact():
    """BackPACK's custom-module example's DiagGGNExact extension (``backpropagate`` and a
    parameter function): accepted with a warning that it is not called; the diagonal comes
    from the module's graph, exactly (the module has no BatchGrad extension here)."""
    from leanprop.compat.backpack.extensions.module_extension import ModuleExtension

    class Twice(_Scale):  # (a type of its own: no BatchGrad extension registered for it)
        pass

    class TwiceDiagGGN(ModuleExtension):
        def __init__(self):
            super().__init__(params=["weight"])

        def backpropagate(self, ext, module, g_inp, g_out, bp_quantities):
            raise AssertionError("not called")

        def weight(self, ext, module, g_inp, g_out, bp_quantities):
            raise AssertionError("not called")

    with pytest.warns(UserWarning, match="its ops as leanprop captures them"):
        extensions.DiagGGNExact().set_module_extension(Twice, TwiceDiagGGN())
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), Twice(), nn.Linear(5, 3)).double())
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    loss_fn = extend(nn.CrossEntropyLoss())
    with backpack(extensions.DiagGGNExact()):
        loss_fn(model(x), y).backward()
    blocks = ggn_blocks(model, x, loss_fn, y)
    for k, p in model.named_parameters():
        assert_close(p.diag_ggn_exact.flatten(), blocks[k][0].diagonal(), k, 1e-11, 1e-13)
    facade.unextend(model)
    facade.unextend(loss_fn)


_MODULE_PATHS = {  # BackPACK's module paths its examples import from, and what they take
    "extensions.secondorder": ("DiagGGNExact", "DiagHessian", "KFAC", "SqrtGGNMC"),
    "extensions.secondorder.diag_ggn": ("DiagGGNExact", "DiagGGNMC", "BatchDiagGGNExact"),
    "extensions.secondorder.diag_hessian": ("DiagHessian", "BatchDiagHessian"),
    "extensions.secondorder.hbp": ("KFAC", "KFLR", "KFRA"),
    "extensions.secondorder.sqrt_ggn": ("SqrtGGNExact", "SqrtGGNMC"),
    "extensions.curvmatprod": ("GGNMP", "HMP", "PCHMP"),
    "extensions.curvmatprod.hmp": ("HMP",),
    "extensions.curvmatprod.ggnmp": ("GGNMP",),
    "extensions.curvmatprod.pchmp": ("PCHMP",),
    "core.derivatives.convnd": ("weight_jac_t_save_memory",),
    "utils.convert_parameters": ("vector_to_parameter_list",),
}


@pytest.mark.parametrize("path", sorted(_MODULE_PATHS))
def test_backpacks_module_paths(path):
    """Each path holds the facade's own objects (the same extension class wherever imported
    from), under the names BackPACK 1.7.1 has there."""
    import importlib

    ours = importlib.import_module(f"leanprop.compat.backpack.{path}")
    for name in _MODULE_PATHS[path]:
        obj = getattr(ours, name)
        if hasattr(extensions, name):
            assert obj is getattr(extensions, name), name
    theirs = pytest.importorskip(f"backpack.{path}")
    assert all(hasattr(theirs, name) for name in _MODULE_PATHS[path])


def test_vector_to_parameter_list_is_the_inverse_of_parameters_to_vector():
    from leanprop.compat.backpack.utils.convert_parameters import vector_to_parameter_list

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    vec = torch.nn.utils.parameters_to_vector(model.parameters())
    views = vector_to_parameter_list(vec, model.parameters())
    assert all(torch.equal(v, p) for v, p in zip(views, model.parameters(), strict=True))
    assert views[0].data_ptr() == vec.data_ptr()  # (views, no copies)
    with pytest.raises(LeanpropValueError, match="hold 26 entries"):
        vector_to_parameter_list(vec[:-1], model.parameters())
    with pytest.raises(TypeError):
        vector_to_parameter_list([1.0], model.parameters())


def test_backpacks_tracer_keeps_the_custom_modules_as_leaves():
    """``custom_module.graph_utils.BackpackTracer`` (BackPACK's RNN example prints graphs
    with it): the custom modules are single nodes, other modules traced as torch.fx does."""
    from leanprop.compat.backpack.custom_module.graph_utils import BackpackTracer

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.scale, self.add = nn.Linear(4, 4), ScaleModule(2.0), SumModule()
            self.pick, self.perm = ReduceTuple(index=0), Permute(1, 0)

        def forward(self, x):
            h = self.lin(x)
            return self.perm(self.pick((self.add(h, self.scale(h)), h)))

    model = Net()
    graph = BackpackTracer().trace(model)
    called = [n.target for n in graph.nodes if n.op == "call_module"]
    assert called == ["lin", "scale", "add", "pick", "perm"]
    assert [n.op for n in graph.nodes] == ["placeholder", *["call_module"] * 5, "output"]
    with pytest.raises(torch.fx.proxy.TraceError):  # (torch.fx's own goes into SumModule)
        torch.fx.Tracer().trace(model)


def test_backpacks_example_helpers():
    """``utils.examples.autograd_diag_ggn_exact`` equals the GGN's diagonal (brute force),
    entries picked by ``idx`` (an int tensor, as BackPACK's examples pass); bad indices and
    the MNIST helpers without torchvision give clear errors."""
    import importlib.util

    from leanprop.compat.backpack.utils import examples

    model, x, y, loss_fn = _problem()
    blocks = ggn_blocks(model, x, loss_fn, y)
    full = torch.cat([blocks[k][0].diagonal() for k, _ in model.named_parameters()])
    assert_close(examples.autograd_diag_ggn_exact(x, y, model, loss_fn), full, "all", 1e-12, 0)
    idx = torch.linspace(0, full.numel() - 1, 5, dtype=torch.int32)
    got = examples.autograd_diag_ggn_exact(x, y, model, loss_fn, idx=idx)
    assert_close(got, full[idx.long()], "idx", 1e-12, 0)
    with pytest.raises(LeanpropValueError, match="out of range"):
        examples.autograd_diag_ggn_exact(x, y, model, loss_fn, idx=[full.numel()])
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(LeanpropError, match="need torchvision"):
            examples.load_one_batch_mnist(4)


def test_module_extensions_see_each_calls_output_and_keep_models_copyable():
    """A custom module called twice in one forward: its extension gets each call's own
    ``module.output`` (it had the last call's: wrong individual gradients, refused by the sum
    check); the outputs are not attributes of the module (a model stays ``deepcopy``-able
    after a step); a ``BatchGrad`` subclass with its own ``__init__`` can register one."""
    import copy

    from leanprop.compat.backpack.extensions.firstorder.base import FirstOrderModuleExtension

    class Exp(nn.Module):  # y = exp(w x): dy/dw = y x
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.tensor([0.3], dtype=torch.float64))

        def forward(self, x):
            return torch.exp(self.weight * x)

    class ExpBatchGrad(FirstOrderModuleExtension):
        def __init__(self):
            super().__init__(params=["weight"])

        def weight(self, ext, module, g_inp, g_out, bp_quantities):
            return (g_out[0] * module.output * module.input0).flatten(1).sum(1, keepdim=True)

    class MyBatchGrad(extensions.BatchGrad):
        def __init__(self) -> None:
            super().__init__()

    MyBatchGrad().set_module_extension(Exp, ExpBatchGrad())

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.e = nn.Linear(3, 3), Exp()

        def forward(self, x):
            return self.e(self.e(self.lin(x)) * 0.5)  # (Exp called twice)

    torch.manual_seed(0)
    model = extend(Net().double())
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with backpack(extensions.BatchGrad()):
        ((model(x) - y) ** 2).sum().backward()
    want = individual_gradients(
        model, lambda o, t, r: ((o - t) ** 2).sum() if r == "sum" else ((o - t) ** 2).mean(),
        x, y, "sum",
    )  # fmt: skip
    assert_close(model.e.weight.grad_batch, want["e.weight"], "e.weight", 1e-12, 1e-14)
    assert not hasattr(model.e, "output")
    copy.deepcopy(model)
    model(x)  # (a forward without backward: evaluation with grad on)
    import gc
    import weakref

    gone = weakref.ref(model.e)  # (the kept outputs hold no graph that holds the modules)
    del model
    gc.collect()
    assert gone() is None


def test_the_warning_of_other_extensions_names_where_the_quantity_comes_from():
    from leanprop.compat.backpack.extensions.module_extension import ModuleExtension

    with pytest.warns(UserWarning, match="its built-in rule"):
        extensions.DiagHessian().set_module_extension(nn.Linear, ModuleExtension())
