"""The public surface: one door, pinned."""

import leanprop

EXPECTED = {
    "BatchDotGrad",
    "BatchGrad",
    "BatchL2Grad",
    "Quantity",
    "SumGradSquared",
    "Variance",
    "all_reduce_quantities",
    "per_sample",
    "register_rule",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDiagHessian",
    "DiagGGNExact",
    "DiagGGNMC",
    "DiagHessian",
    "GGNMP",
    "HMP",
    "PCHMP",
    "KFAC",
    "KFLR",
    "KFRA",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "ggn",
    "DPOptimizer",
    "clip_per_sample",
    "poisson_loader",
    "InBackward",
    "chunked_linear_cross_entropy",
    "scale_grad",
    "side_loss",
    "transform_grad",
    "Timing",
    "compare",
    "time_fn",
    "track_memory",
    "BatchError",
    "LeanpropError",
    "LeanpropValueError",
    "MismatchError",
    "UnsupportedModelError",
}


def test_all_is_pinned():
    assert set(leanprop.__all__) == EXPECTED
    assert len(leanprop.__all__) == len(EXPECTED)
    for name in leanprop.__all__:
        assert hasattr(leanprop, name), name


def test_errors_subclass_builtins():
    assert issubclass(leanprop.LeanpropValueError, ValueError)
    assert issubclass(leanprop.BatchError, ValueError)
    assert issubclass(leanprop.UnsupportedModelError, RuntimeError)
    for e in (leanprop.LeanpropValueError, leanprop.BatchError, leanprop.UnsupportedModelError):
        assert issubclass(e, leanprop.LeanpropError)


def test_quickstart_example_runs():
    import pathlib
    import runpy

    path = pathlib.Path(__file__).parents[1] / "examples" / "per_sample_quickstart.py"
    runpy.run_path(str(path), run_name="__main__")


def test_readme_examples_run(capsys):
    """Every self-contained README snippet (those starting with their imports) runs."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("import")]
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    assert "2097152" in capsys.readouterr().out  # the peak the README states
