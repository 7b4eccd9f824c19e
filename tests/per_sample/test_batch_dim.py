"""Where the batch is: batch tracking, parameters broadcast over the batch, sequence-first
inputs and real transformer models, each with sequence length T == batch size N (the
coincidence that hid wrong results) and T != N, against the per-sample loop in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import leanprop
from leanprop import BatchError, BatchGrad, BatchL2Grad, SumGradSquared, Variance
from leanprop.testing import quantities_from_individual

from ..helpers import assert_close

ALL = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())


def per_sample_loop(model: nn.Module, loss_of, n: int) -> dict[str, torch.Tensor]:
    """``loss_of(i)``: sample i's own loss, by running the model on it alone."""
    names, params = zip(
        *[(k, p) for k, p in model.named_parameters() if p.requires_grad], strict=True
    )
    rows = [torch.autograd.grad(loss_of(i), params, allow_unused=True) for i in range(n)]
    return {
        k: torch.stack([torch.zeros_like(params[j]) if r[j] is None else r[j] for r in rows])
        for j, k in enumerate(names)
    }


def check(model, batch_loss, loss_of, n, quantities=ALL, **options):
    expected = per_sample_loop(model, loss_of, n)
    model.zero_grad()
    with leanprop.per_sample(model, *quantities, **options):
        batch_loss().backward()
    scale = max(float(g.abs().max()) for g in expected.values())
    for k, p in model.named_parameters():
        ref = quantities_from_individual(expected[k])
        for q in quantities:
            assert_close(getattr(p, q.attr), ref[q.attr], f"{k}.{q.attr}", 1e-9, 1e-12 * scale)


class NanoGPT(nn.Module):
    """nanoGPT's embeddings: positions looked up with arange(T), broadcast over the batch."""

    def __init__(self, vocab: int = 11, block: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        self.scale = nn.Parameter(torch.ones(()))  # a learned scalar in a parent: fallback

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.ln(h)) * self.scale


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


def test_class_token_concatenated_by_keyword_is_exact():
    """``torch.cat(tensors=[cls, x], dim=1)``: the keyword form raised IndexError where a
    tracked parameter is in the list (the concatenation was read positionally only)."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cls = nn.Parameter(torch.randn(1, 1, 4))
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            cls = self.cls.expand(x.shape[0], 1, 4)
            return self.fc(torch.cat(tensors=[cls, x], dim=1))

    torch.manual_seed(0)
    model = Tokens().double()
    x = torch.randn(5, 4, 4, dtype=torch.float64)  # (N == T + 1: 5)
    with leanprop.per_sample(model, BatchGrad()):
        model(x).square().sum().backward()
    rows = [
        torch.autograd.grad(model(x[i : i + 1]).square().sum(), list(model.parameters()))
        for i in range(5)
    ]
    for j, (k, p) in enumerate(model.named_parameters()):
        assert_close(p.grad_batch, torch.stack([r[j] for r in rows]), k, 1e-10, 1e-12)


@pytest.mark.parametrize(("n", "t"), [(6, 6), (4, 6)])
def test_position_embedding_broadcast_over_the_batch(n, t):
    torch.manual_seed(0)
    model = NanoGPT().double()
    x, y = torch.randint(0, 11, (n, t)), torch.randint(0, 11, (n, t))
    check(
        model, lambda: token_loss(model(x), y),
        lambda i: token_loss(model(x[i : i + 1]), y[i : i + 1]), n,
    )  # fmt: skip


class BertStyleEmbeddings(nn.Module):
    """Token types from a buffer expanded to [N, T]: batch-shaped, but carrying no batch."""

    def __init__(self, vocab: int = 9, dim: int = 4) -> None:
        super().__init__()
        self.tok, self.typ = nn.Embedding(vocab, dim), nn.Embedding(2, dim)
        self.register_buffer("types", torch.zeros(1, 16, dtype=torch.long))
        self.head = nn.Linear(dim, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        types = self.types[:, : idx.shape[1]].expand(idx.shape[0], idx.shape[1])
        return self.head(torch.tanh(self.tok(idx) + self.typ(types))).mean(1)


@pytest.mark.parametrize(("n", "t"), [(5, 5), (3, 5)])
def test_batch_shaped_parameter_derived_operand(n, t):
    torch.manual_seed(0)
    model = BertStyleEmbeddings().double()
    x, y = torch.randint(0, 9, (n, t)), torch.randint(0, 3, (n,))
    loss = lambda s: F.cross_entropy(model(x[s]), y[s], reduction="sum")  # noqa: E731
    check(model, lambda: loss(slice(None)), lambda i: loss(slice(i, i + 1)), n)


@pytest.mark.parametrize(("n", "t"), [(5, 5), (5, 3)])
def test_sequence_first_inputs_with_batch_dim(n, t):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(t, n, 3, dtype=torch.float64)
    check(
        model, lambda: model(x).square().sum(), lambda i: model(x[:, i : i + 1]).square().sum(),
        n, batch_dim=1,
    )  # fmt: skip


@pytest.mark.parametrize(("n", "t"), [(4, 4), (4, 6)])
def test_transformer_encoder_layer_sequence_first_with_padding_mask(n, t):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0).double()
    x = torch.randn(t, n, 8, dtype=torch.float64)
    pad = torch.zeros(n, t, dtype=torch.bool)
    pad[0, -2:] = True

    def loss(s: slice) -> torch.Tensor:
        return layer(x[:, s], src_key_padding_mask=pad[s]).square().sum()

    check(
        layer, lambda: loss(slice(None)), lambda i: loss(slice(i, i + 1)), n,
        (BatchGrad(), Variance()), batch_dim=1, batch_dims={"src_key_padding_mask": 0},
    )  # fmt: skip


@pytest.mark.parametrize(("n", "t"), [(4, 4), (4, 6)])
def test_multihead_attention_with_a_mask_per_sample_and_head(n, t):
    """``nn.MultiheadAttention`` with a 3-D ``attn_mask`` ``[N*H, T, T]`` (each sample's
    padding repeated for its heads): refused with a clear error as an input of unknown
    batch, exact with ``batch_dims={"attn_mask": None}`` (constant data: no parameter's
    gradient goes through it), T == N too."""
    torch.manual_seed(0)
    heads = 2
    mha = nn.MultiheadAttention(8, heads, batch_first=True).double()
    x = torch.randn(n, t, 8, dtype=torch.float64)
    lengths = torch.tensor([t, t - 1, t - 2, t])[:n]
    pad = torch.arange(t)[None, :] >= lengths[:, None]  # [N, T]
    mask = pad[:, None, :].expand(n, t, t).repeat_interleave(heads, 0)  # [N*H, T, T]

    def loss(s: slice) -> torch.Tensor:
        m = mask.view(n, heads, t, t)[s].flatten(0, 1)
        return mha(x[s], x[s], x[s], attn_mask=m, need_weights=False)[0].square().sum()

    with (
        pytest.raises(BatchError, match="batch_dims="),
        leanprop.per_sample(mha, BatchGrad()),
    ):
        loss(slice(None)).backward()
    check(
        mha, lambda: loss(slice(None)), lambda i: loss(slice(i, i + 1)), n,
        batch_dims={"attn_mask": None},
    )  # fmt: skip


def test_batch_first_mask_taken_as_sequence_first_is_refused_not_wrong():
    """T == N: a [N, T] mask marked at dim 1 fits by size; leanprop must not use it."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0).double()
    x = torch.randn(4, 4, 8, dtype=torch.float64)
    pad = torch.zeros(4, 4, dtype=torch.bool)
    pad[0, -1] = True
    with (
        pytest.raises(BatchError, match=r"cannot tell which dimension holds the samples"),
        leanprop.per_sample(layer, BatchGrad(), batch_dim=1),
    ):
        layer(x, src_key_padding_mask=pad).sum().backward()


def test_flattened_samples_reach_a_rule_with_their_inner_factor():
    """HF Conv1D-style x.view(-1, D) then a Linear: the batch is the outer factor of N*T."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).double()

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x.reshape(-1, 3)).view(*x.shape[:2], 2)

    model = Flat()
    x = torch.randn(4, 4, 3, dtype=torch.float64)
    check(model, lambda: model(x).square().sum(), lambda i: model(x[i : i + 1]).square().sum(), 4)


def test_mixing_samples_before_a_rule_is_an_error():
    lin = nn.Linear(3, 2).double()

    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x - x.mean(0))

    model = Mix()
    with (
        pytest.raises(BatchError, match=r"mean over the batch dimension sums samples"),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(torch.randn(4, 3, dtype=torch.float64))


class Laundered(nn.Module):
    """One branch's input comes back through numpy: leanprop cannot see that it is batched."""

    def __init__(self, reduce_hidden: bool) -> None:
        super().__init__()
        self.seen, self.hidden = nn.Linear(3, 2), nn.Linear(3, 2)
        self.reduce_hidden = reduce_hidden

    def forward(self, x):
        h = self.hidden(torch.from_numpy(x.detach().numpy()))
        if self.reduce_hidden:
            return self.seen(x).sum() + h.sum()
        return self.seen(x) + h


def test_batch_shaped_branch_meeting_the_batch_is_exact():
    """The hidden branch has N rows where it meets the batch: row n is sample n's."""
    torch.manual_seed(0)
    model = Laundered(reduce_hidden=False).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    check(model, lambda: model(x).square().sum(), lambda i: model(x[i : i + 1]).square().sum(), 4)


def test_parameters_reached_without_their_samples_are_an_error_not_missing():
    model = Laundered(reduce_hidden=True)
    with (
        pytest.raises(
            leanprop.UnsupportedModelError, match=r"'hidden.weight'.*after the samples were comb"
        ),
        leanprop.per_sample(model, BatchGrad()),
    ):
        model(torch.randn(4, 3)).backward()


# ---------------------------------------------------------------- real models (transformers)
transformers = pytest.importorskip("transformers")


def _quiet(model: nn.Module) -> nn.Module:
    return model.double().train()


@pytest.mark.parametrize(("n", "t"), [(5, 5), (3, 5)])
def test_hf_gpt2_out_of_the_box(n, t):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=8, n_layer=2, n_head=2,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = _quiet(transformers.GPT2LMHeadModel(cfg))
    ids = torch.randint(0, 40, (n, t))

    def loss(s: slice) -> torch.Tensor:
        logits = model(ids[s]).logits[:, :-1]
        return token_loss(logits, ids[s][:, 1:])

    quantities = (BatchGrad(), BatchL2Grad())
    check(model, lambda: loss(slice(None)), lambda i: loss(slice(i, i + 1)), n, quantities)


@pytest.mark.parametrize(("n", "t"), [(5, 5), (3, 5)])
def test_hf_bert_with_padding_out_of_the_box(n, t):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = _quiet(transformers.BertForSequenceClassification(cfg))
    ids, labels = torch.randint(0, 40, (n, t)), torch.randint(0, 2, (n,))
    mask = torch.ones(n, t, dtype=torch.long)
    mask[0, -2:] = 0

    def loss(s: slice) -> torch.Tensor:
        logits = model(input_ids=ids[s], attention_mask=mask[s]).logits
        return F.cross_entropy(logits, labels[s], reduction="sum")

    quantities = (BatchGrad(), Variance())
    check(model, lambda: loss(slice(None)), lambda i: loss(slice(i, i + 1)), n, quantities)


class ChunkedHead(nn.Module):
    """An LM whose loss is leanprop.chunked_linear_cross_entropy (chunks cut across samples)."""

    def __init__(self, tied: bool, reduction: str) -> None:
        super().__init__()
        self.emb, self.mix = nn.Embedding(11, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 11)
        if tied:
            self.head.weight = self.emb.weight
        self.reduction = reduction

    def forward(self, idx, y):
        h = torch.tanh(self.mix(self.emb(idx)))
        return leanprop.chunked_linear_cross_entropy(
            h.flatten(0, 1), self.head.weight, y.flatten(), self.head.bias, chunk_size=3,
            reduction=self.reduction,
        )  # fmt: skip


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_lm_head_loss_composes_with_per_sample(tied, reduction):
    torch.manual_seed(0)
    model = ChunkedHead(tied, reduction).double()
    n = t = 4
    idx, y = torch.randint(0, 11, (n, t)), torch.randint(0, 11, (n, t))
    y[0, 1] = -100  # ignored
    valid = int((y != -100).sum()) if reduction == "mean" else 1

    def own_loss(i: int) -> torch.Tensor:  # sample i's share of the batch loss
        per = ChunkedHead.forward(model, idx[i : i + 1], y[i : i + 1])
        if reduction == "mean":
            per = per * int((y[i] != -100).sum()) / valid
        return per

    model.reduction = "mean" if reduction == "mean" else "sum"
    check(model, lambda: model(idx, y), own_loss, n, (BatchGrad(), BatchL2Grad()))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", ["label-smoothing", "class-weights"])
def test_chunked_lm_head_options_compose_with_per_sample(reduction, options):
    """Every quantity of a tied head under each F.cross_entropy option, against the same
    forward's plain per-row losses grouped by sample (T == N)."""
    from leanprop import SumGradSquared
    from leanprop.testing import individual_gradients_of_losses, quantities_from_individual

    torch.manual_seed(0)
    model = ChunkedHead(True, reduction).double()
    n = t = 4
    idx, y = torch.randint(0, 11, (n, t)), torch.randint(0, 11, (n, t))
    y[0, 1] = -100
    extra = (
        {"label_smoothing": 0.3} if options == "label-smoothing"
        else {"class_weight": torch.rand(11, dtype=torch.float64) + 0.5}
    )  # fmt: skip
    params = dict(model.named_parameters())
    kinds = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())

    def both(idx: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(model.mix(model.emb(idx))).flatten(0, 1)
        out = leanprop.chunked_linear_cross_entropy(
            h, model.head.weight, y.flatten(), model.head.bias, chunk_size=3,
            reduction=reduction, **extra,
        )  # fmt: skip
        rows = F.cross_entropy(
            F.linear(h, model.head.weight, model.head.bias),
            y.flatten(),
            reduction="none",
            weight=extra.get("class_weight"),
            label_smoothing=extra.get("label_smoothing", 0.0),
        )  # the oracle's per-row losses, from the same forward
        return out, rows

    model.forward = both
    with leanprop.per_sample(model, *kinds):
        out, rows = model(idx, y)
        go = torch.rand(n * t, dtype=torch.float64) if reduction == "none" else None
        if reduction == "mean":
            w = extra.get("class_weight")
            kept = y.flatten() != -100
            rows = rows / (kept.sum() if w is None else w[y.flatten()[kept]].sum())
        if go is not None:
            rows = rows * go
            out.backward(go, retain_graph=True)
        else:
            out.backward(retain_graph=True)
    expected = individual_gradients_of_losses(rows.view(n, t).sum(1), params)
    for k, p in params.items():
        ref = quantities_from_individual(expected[k])
        for q in kinds:
            assert_close(getattr(p, q.attr), ref[q.attr], f"{k}.{q.attr}", 1e-9, 1e-12)


class _OtherSampleWritten(nn.Module):
    """HF's shift of each sample's states, then the first slot overwritten with sample 0's:
    the write was not followed (the tensor already carried the batch), and every sample's
    results were wrong with the sum check passing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        d = h.new_zeros(h.shape)
        d[:, 1:] = h[:, :-1]
        d[:, 0] = h[0, 0]
        return self.b(d)


class _ClsCopy(nn.Module):
    """A tensor computed from a parameter alone (a cls token's copy), then the batch written
    into it: the parameter got no quantities (silently with ``check=False``)."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.cls, self.lin, self.first = nn.Parameter(torch.randn(3)), nn.Linear(3, 3), first
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, 3]
        n, t, d = x.shape
        if self.first:
            h = self.cls.expand(n, t + 1, d).clone()
        else:
            h = x.new_zeros(n, t + 1, d)
            h[:, 0] = self.cls
        h[:, 1:] = self.lin(x)
        return self.head(h)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize(
    "model", [_OtherSampleWritten(), _ClsCopy(True), _ClsCopy(False)],
    ids=["another sample written", "batch into a cls copy", "batch beside a cls written"],
)  # fmt: skip
def test_writes_that_mix_or_hide_a_parameter_are_refused(model, check):
    x = torch.randn(4, 4, 3, dtype=torch.float64)
    model.double()
    with pytest.raises(BatchError, match=r"written into"), leanprop.per_sample(
        model, BatchGrad(), check=check
    ):  # fmt: skip
        model(x).square().sum().backward()


def test_a_parameter_written_after_the_batch_is_exact():
    """``h[:, 0] = cls`` into the batched tensor: each sample's share of the cls token."""
    torch.manual_seed(0)

    class Cls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cls, self.lin = nn.Parameter(torch.randn(3)), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, t, d = x.shape
            h = x.new_zeros(n, t + 1, d)
            h[:, 1:] = self.lin(x)
            h[:, 0] = self.cls
            return torch.tanh(h)

    model = Cls().double()
    x = torch.randn(4, 4, 3, dtype=torch.float64)

    def loss_of(i):
        return model(x[i : i + 1]).square().sum()

    check(model, lambda: model(x).square().sum(), loss_of, 4)


class _AcrossSamples(nn.Module):
    """A linear layer, then an op acting across the samples with N == D (each was taken as
    elementwise: per-sample results silently wrong, the sum check passing), then a head."""

    def __init__(self, op) -> None:
        super().__init__()
        self.lin, self.head, self.op = nn.Linear(4, 4), nn.Linear(4, 1), op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.op(torch.tanh(self.lin(x))))


_ACROSS_SAMPLES = {
    "renorm of columns": lambda h: h.renorm(2, 1, 1.0),
    "F.linear with the samples as weights": lambda h: F.linear(h, h),
    "a convolution with the samples as weights": lambda h: F.conv1d(
        h.unsqueeze(-1), h.unsqueeze(-1)
    ).squeeze(-1),
    "fftshift": lambda h: torch.fft.fftshift(h),
    "as_strided windows across the samples": lambda h: h.as_strided(h.shape, (1, 1)),
    "masked_scatter": lambda h: torch.zeros_like(h).masked_scatter(
        torch.ones(4, 4).tril().bool(), h
    ),
}


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("name", sorted(_ACROSS_SAMPLES))
def test_ops_across_the_samples_are_refused(name, check):
    model = _AcrossSamples(_ACROSS_SAMPLES[name]).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(BatchError), leanprop.per_sample(model, BatchGrad(), check=check):
        model(x).square().sum().backward()


def test_unknown_ops_dimension_arguments_are_all_read():
    """An op with no branch of its own acts along the batch where any of its dimension
    arguments names it (the second of two: ``dim1``), or where a required one cannot be
    read (passed under a name its signature does not give)."""
    from leanprop.per_sample.batch import BatchDim, op_name
    from leanprop.per_sample.batch.unknown import acts_along_batch

    x = torch.zeros(4, 4, 4)
    assert acts_along_batch("swapaxes", (x, 1, 0), {}, 3, BatchDim(0), op_name)
    assert not acts_along_batch("swapaxes", (x, 1, 2), {}, 3, BatchDim(0), op_name)
    assert acts_along_batch("renorm", (x, 2.0), {"maxnorm": 1.0}, 3, BatchDim(2), op_name)
    assert not acts_along_batch("renorm", (x, 2.0, 0, 1.0), {}, 3, BatchDim(2), op_name)
