"""`leanprop bench` end to end on a tiny problem."""

from __future__ import annotations

import importlib.util
import json

import pytest

from leanprop.bench import cli, per_sample_suite


def test_per_sample_suite_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        per_sample_suite, "COMPETITORS", {"torchfunc": "torch"}
    )  # keep the test fast and independent of optional packages
    monkeypatch.setitem(cli.SUITES, "future", cli.Suite("not built yet", None, {}))
    out = tmp_path / "r.json"
    assert cli.main(["bench", "per-sample", "future", "--batch", "4", "--reps", "1",
                     "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "future: unavailable" in text
    report = json.loads(out.read_text())
    assert report["suites"]["future"] == "unavailable"
    rows = report["suites"]["per-sample"]
    methods = [r["method"] for r in rows]
    assert methods[:2] == ["plain", "leanprop_batchgrad"]
    assert "torchfunc" in methods
    for r in rows:
        assert "error" not in r, r
        if "max_rel" in r:
            assert r["max_rel"] < 1e-4
        else:
            assert r["median_s"] > 0 and r["time_ratio"] > 0
            assert r["method"] in text
    assert report["environment"]["torch"]


def test_variance_suite_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    args = ["bench", "variance-of-gradients", "--batch", "4", "--reps", "1", "--plot", str(png)]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert text.count("agrees") == 2 and "DISAGREES" not in text
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_in_backward_suite(capsys):
    assert cli.main(["bench", "in-backward", "--reps", "1"]) == 0
    text = capsys.readouterr().out
    assert "small_b1: ordinary" in text and "small_b1: hooks" in text
    assert "small_b1: leanprop" in text and "agrees" in text and "DISAGREES" not in text
    assert "gpt2_10m: torch_in_backward" in text and "gpt2_10m: leanprop_no_norms" in text


def test_curvature_suite(capsys):
    pytest.importorskip("backpack")
    assert cli.main(["bench", "curvature", "--batch", "4", "--reps", "1"]) == 0
    text = capsys.readouterr().out
    for model in ("mlp", "mlp_sigmoid", "cnn"):
        for quantity in ("DiagGGNExact", "DiagHessian", "KFAC"):
            for method in ("plain", "leanprop", "backpack"):
                assert f"{model}/{quantity}: {method}" in text
    # (the exact quantities agree with BackPACK's; KFAC's Monte-Carlo draws differ)
    assert text.count("agrees") == 6 and "DISAGREES" not in text


def test_dp_suite(capsys):
    pytest.importorskip("opacus")
    assert cli.main(["bench", "dp", "--batch", "4", "--reps", "1"]) == 0
    text = capsys.readouterr().out
    for model in ("cnn", "transformer"):
        for method in ("plain", "leanprop", "opacus_hooks", "opacus_ghost"):
            assert f"{model}: {method}" in text
    assert text.count("agrees") == 6 and "DISAGREES" not in text


def test_distributed_suite(capsys):
    assert cli.main(["bench", "distributed", "--reps", "2"]) == 0
    text = capsys.readouterr().out
    for method in ("ddp", "ddp bucket-view", "leanprop"):
        assert f"small_b1 x2: {method} " in text
    assert text.count("agrees") == 2 and "DISAGREES" not in text
    leanprop_line = next(line for line in text.splitlines() if "x2: leanprop" in line)
    assert "buckets at backward start 0.0 MiB" in leanprop_line


def test_side_losses_suite(capsys):
    assert cli.main(["bench", "side-losses", "--reps", "1"]) == 0
    text = capsys.readouterr().out
    for kind in ("mlp", "free"):
        for method in ("combined", "checkpoint", "backward-at-once", "leanprop"):
            assert f"{kind} penalty: {method}" in text
    assert "mlp penalty: leanprop chunked" in text and "free penalty: leanprop chunked" not in text
    assert text.count("agrees") == 10 and "DISAGREES" not in text
    working = {
        (line.split("ce V=")[1].split(":")[0], "chunked" in line): float(
            line.split("working memory ")[1].split(" MiB")[0]
        )
        for line in text.splitlines()
        if "ce V=" in line
    }
    assert len(working) == 6
    # the plain loss's working memory grows with the vocabulary, the chunked one's does not
    assert working["65536", False] > 3 * working["16384", False]
    assert working["65536", True] <= working["16384", True] < working["16384", False]


def test_unknown_suite_is_rejected(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "nope"])
    assert "unknown suite(s) nope" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "0 must be at least 1"),
        (["--batch", "-4"], "-4 must be at least 1"),
        (["--reps", "0"], "0 must be at least 1"),
        (["--json", "no/such/folder/out.json"], "does not exist"),
    ],
)
def test_bad_arguments_are_rejected_before_measuring(args, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "per-sample", *args])
    assert message in capsys.readouterr().err


def test_unknown_method_error():
    with pytest.raises(ValueError, match="unknown per-sample benchmark method 'x'"):
        per_sample_suite.make_step("x", per_sample_suite.torch.device("cpu"), 2)


def test_real_models_suite(capsys):
    assert cli.main(["bench", "real-models", "--batch", "2", "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    models = ["resnet18gn"]
    if importlib.util.find_spec("transformers") is not None:
        models += ["gpt2", "bert", "vit"]
    for model in models:
        for method in ("plain", "leanprop_batchgrad", "leanprop_l2", "leanprop_variance"):
            line = next(row for row in lines if f"{model}/{method} " in row)
            assert "failed" not in line, line
