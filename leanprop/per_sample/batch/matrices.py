"""Where the batch lands in matrix products (``matmul``, ``einsum``), functions of matrices
(``det``, ``inverse``, ``svd``), norms of matrices, distances and similarities between rows,
and spectra: each keeps the samples apart where the batch is a dimension they do not act on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .infos import MAY_MIX, BatchDim, Combined, Info, Lost, dim_or_last, dims_arg, norm_dim

# the arguments of the products and of the ops placing values, by position (for the rules,
# which read them so, where they come by keyword)
OPERAND_NAMES = {
    "matmul": ("input", "other"), "mm": ("input", "mat2"), "bmm": ("input", "mat2"),
    "addmm": ("input", "mat1", "mat2"), "baddbmm": ("input", "batch1", "batch2"),
    "addbmm": ("input", "batch1", "batch2"), "kron": ("input", "other"),
    "tensordot": ("a", "b", "dims"), "index_put": ("input", "indices", "values"),
    "put": ("input", "index", "source"),
}  # fmt: skip


def positional(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str
) -> tuple[Sequence[Any], int | str]:
    """An op's arguments passed by keyword (:data:`OPERAND_NAMES`), as positional ones (and
    ``which``, the operand asked about, as its position)."""
    names = OPERAND_NAMES[name]
    full = list(args) + [kwargs.get(k) for k in names[len(args) :]]
    return full, names.index(which) if which in names else which


# functions of each matrix of their first argument [*, m, n]
MATRIX_FUNCTIONS = frozenset({
    "det", "linalg_det", "logdet", "slogdet", "linalg_slogdet", "inverse", "linalg_inv",
    "linalg_solve", "linalg_svdvals", "linalg_svd", "svd", "linalg_cholesky", "cholesky",
    "linalg_qr", "linalg_eigh", "linalg_eigvalsh", "linalg_eig", "linalg_eigvals",
    "matrix_exp", "linalg_matrix_exp", "linalg_pinv", "linalg_matrix_power", "nuclear_norm",
    "linalg_cond", "linalg_inv_ex", "pinverse", "linalg_cholesky_ex", "linalg_lu_factor",
    "linalg_lu_factor_ex", "linalg_lu", "lu", "linalg_ldl_factor",
    "matrix_power", "linalg_matrix_rank", "linalg_solve_ex", "cholesky_inverse",
    "cholesky_solve", "triangular_solve", "linalg_solve_triangular", "lu_solve",
    "linalg_lu_solve", "lu_unpack", "linalg_ldl_factor_ex", "linalg_ldl_solve",
    "linalg_householder_product", "orgqr", "ormqr", "geqrf", "qr", "lobpcg", "linalg_lstsq",
    "svd_lowrank", "pca_lowrank", "linalg_polar",
})  # fmt: skip
# functions of a whole tensor taken as one matrix (its leading dimensions as the rows)
WHOLE_TENSOR_FUNCTIONS = frozenset({"linalg_tensorinv", "linalg_tensorsolve"})


def _pairs(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, bd: BatchDim,
    nd: int, od: int,
) -> Info:  # fmt: skip
    """Distances between rows (``cdist(x1 [*, P, M], x2 [*, R, M]) -> [*, P, R]``, ``pdist``),
    covariances between rows (``cov``, ``corrcoef``), differences of neighbours (``diff``):
    where the batch of operand ``which`` goes, or why its samples are mixed."""
    if name == "diff":  # (x, n, dim)
        if dim_or_last(args, kwargs, 2, nd) == bd.dim:
            return Lost("diff along the batch dimension mixes samples")
        return bd  # (prepend and append are laid out as the input)
    if name == "cdist" and bd.dim < nd - 2:
        return BatchDim(od - (nd - bd.dim), bd.inner)
    if name == "cdist" and bd.dim == nd - 2 and which in (0, 1):  # x1's rows, or x2's
        return BatchDim(od - 2 + which, bd.inner)
    return Lost(f"'{name}' over the batch dimension mixes samples")


def rare_result(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], which: int | str, bd: BatchDim,
    nd: int, od: int,
) -> Info | None:  # fmt: skip
    """:func:`result_dim` for the ops of :data:`RARE` (operand ``which``, its batch at ``bd``
    of its ``nd`` dimensions; the output has ``od``); None for ``linalg.norm`` of vectors (a
    reduction)."""
    if name in WHOLE_TENSOR_FUNCTIONS:
        return Lost(f"'{name}' of a tensor that carries the batch, as one matrix, {MAY_MIX}")
    if name in MATRIX_FUNCTIONS:  # of each matrix [*, m, n] (a solve's A)
        if which != 0 and bd.dim >= nd - 2:  # (a solve's B, whose rows may be samples)
            return Lost(f"'{name}' with its argument {which} batched in its matrices {MAY_MIX}")
        if bd.dim >= nd - 2:
            return Lost(f"'{name}' of a matrix made of samples mixes samples")
        return BatchDim(bd.dim, bd.inner)
    # (A, ord="fro", dim=(-2, -1), keepdim=False); linalg.norm with two dims alike
    d = dims_arg(args, kwargs, 2, "dim") if name in ("linalg_norm", "linalg_matrix_norm") else None
    if name == "linalg_matrix_norm" or (isinstance(d, list | tuple) and len(d) == 2):
        dims = [-2, -1] if d is None else [norm_dim(int(k), nd) - nd for k in d]
        if bd.dim - nd not in dims:
            return BatchDim(bd.dim - sum(nd + k < bd.dim for k in dims if od < nd), bd.inner)
        if dims_arg(args, kwargs, 1, "ord") in (None, "fro"):  # (a vector norm of the matrix)
            return Combined("a matrix norm over the batch dimension sums samples")
        return Lost(f"'{name}' of a matrix made of samples mixes samples")
    if name == "linalg_norm":
        return None
    if name in ("cosine_similarity", "pairwise_distance"):
        return _similarity(name, args, kwargs, bd, nd)
    if name in FFTS:  # (x, s, dim, norm): over the last two dimensions, or all
        d = dims_arg(args, kwargs, 2, "dim")
        dims = range(nd) if d is None and name.endswith("n") else [-2, -1] if d is None else d
        if bd.dim in [norm_dim(int(k), nd) for k in dims]:
            return Lost(f"{name} over the batch dimension mixes samples")
        return bd
    return _pairs(name, args, kwargs, which, bd, nd, od)


def _similarity(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], bd: BatchDim, nd: int
) -> Info:
    """``cosine_similarity(x1, x2, dim=1)``, ``pairwise_distance(x1, x2, p, eps, keepdim)``
    (over the last dimension): where an operand's batch (at ``bd`` of its ``nd`` dimensions)
    lands, its operands broadcast from the right; mixing where they reduce over it."""
    full = max(t.dim() for t in args[:2] if isinstance(t, Tensor))
    pos = full - (nd - bd.dim)  # (the batch's place among the broadcast dimensions)
    if name == "cosine_similarity":
        d, keep = dims_arg(args, kwargs, 2, "dim"), False
        d = 1 if d is None else d
    else:
        d, keep = -1, bool(dims_arg(args, kwargs, 4, "keepdim"))
    dd = norm_dim(int(d), full)
    if dd == pos:
        return Lost(f"'{name}' over the batch dimension mixes samples")
    return BatchDim(pos - (dd < pos and not keep), bd.inner)


FFTS = frozenset({
    "fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2", "fft_fftn", "fft_ifftn", "fft_rfftn",
    "fft_irfftn", "fft_hfft2", "fft_ihfft2", "fft_hfftn", "fft_ihfftn",
})  # fmt: skip


# the ops :func:`rare_result` reads (one test on the hot path for all of them)
RARE = frozenset({
    *MATRIX_FUNCTIONS, *WHOLE_TENSOR_FUNCTIONS, *FFTS, "linalg_norm", "linalg_matrix_norm",
    "cdist", "pdist", "cov", "corrcoef", "diff", "cosine_similarity", "pairwise_distance",
})  # fmt: skip


def einsum_result(args: Sequence[Any], which: int, bd: BatchDim) -> Info:
    """Where ``einsum``'s operand ``which`` (its batch at ``bd``) puts the samples: the output
    dimension of the batch's letter, or summed where the output lacks it (an ellipsis spelled
    out as letters of its own; an implicit output: the letters met once, in order)."""
    ins, _, out = args[0].replace(" ", "").partition("->")
    operands = args[1] if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:]
    terms = ins.split(",")
    if len(terms) != len(operands) or "." in ins.replace("...", ""):
        return Lost(f"einsum with an equation leanprop cannot read {MAY_MIX}")
    if "->" not in args[0]:
        out = "..." * ("..." in ins) + "".join(
            sorted(c for c in set(ins) if c.isalpha() and ins.count(c) == 1)
        )
    spare = [chr(c) for c in range(0x100, 0x100 + 64)]  # (letters no equation uses)
    widths = [
        t.dim() - len(term.replace("...", "")) for t, term in zip(operands, terms, strict=True)
    ]
    wide = max(widths, default=0)
    dims = "".join(spare[:wide])  # (ellipses broadcast from the right)
    terms = [term.replace("...", dims[wide - w :]) for term, w in zip(terms, widths, strict=True)]
    out = out.replace("...", dims)
    letter = terms[which][bd.dim]
    if letter not in out:
        return Combined("einsum sums samples")
    return BatchDim(out.index(letter), bd.inner)


def matmul_result(a: Tensor, b: Tensor, which: int, bd: BatchDim, out_ndim: int) -> Info:
    x = a if which == 0 else b
    if x.dim() == 1:  # (its one dimension is the batch's, contracted)
        return Combined("matrix product over the batch")
    last = x.dim() - 1
    contracted = last if which == 0 else last - 1
    if bd.dim == contracted:
        return Combined("a matrix product sums over the batch dimension")
    if which == 0 and b.dim() == 1:  # [..., K] @ [K] -> [...]: only the last dim goes
        return BatchDim(bd.dim, bd.inner)
    if which == 1 and a.dim() == 1:  # [K] @ [..., K, M] -> [..., M]
        return BatchDim(bd.dim if bd.dim < last - 1 else out_ndim - 1, bd.inner)
    if which == 1 and bd.dim == last:
        return BatchDim(out_ndim - 1, bd.inner)
    return BatchDim(out_ndim - (x.dim() - bd.dim), bd.inner)


def tensordot_result(
    args: Sequence[Any], kwargs: dict[str, Any], which: int | str, bd: BatchDim
) -> Info:
    """Where ``tensordot(a, b, dims)``'s operand ``which`` (its batch at ``bd``) puts the
    samples: summed where the batch's dimension is contracted, else at its place among the
    free dimensions (``a``'s first, in order, then ``b``'s)."""
    a, b = args[0], args[1]
    dims = dims_arg(args, kwargs, 2, "dims")
    dims = 2 if dims is None else dims.tolist() if isinstance(dims, Tensor) else dims
    if isinstance(dims, int):
        contracted = [range(a.dim() - dims, a.dim()), range(dims)]
    else:
        contracted = [[k] if isinstance(k, int) else list(k) for k in dims]
    if which not in (0, 1):
        return Lost(f"tensordot's argument {which}")
    x = a if which == 0 else b
    gone = [norm_dim(int(k), x.dim()) for k in contracted[which]]
    if bd.dim in gone:
        return Combined("tensordot sums over the batch dimension")
    before = 0 if which == 0 else a.dim() - len(contracted[0])
    return BatchDim(before + bd.dim - sum(k < bd.dim for k in gone), bd.inner)


def kron_result(
    args: Sequence[Any], which: int | str, x: Tensor, bd: BatchDim, out: Tensor
) -> Info:
    """Where ``kron(a, b)``'s operand ``which`` (``x``, its batch at ``bd``) puts the samples
    (``out[i * b_d + j] = a[i] b[j]`` along each dimension, from the right): ``a``'s batch as
    the outer factor of its dimension, ``b``'s alone where ``a`` is 1 there. Each of ``b``'s
    samples met with every value of ``a`` along it otherwise: in no known place (``b``'s
    samples met with another operand's there are told as mixing, and an op acting along
    such a result too)."""
    pos = out.dim() - (x.dim() - bd.dim)
    other = args[1 - which] if which in (0, 1) else None
    if not isinstance(other, Tensor):
        return Lost(f"kron's argument {which}")
    k = other.dim() - (out.dim() - pos)  # (the other's dimension there, if it has one)
    size = other.shape[k] if k >= 0 else 1
    if which == 0:
        return BatchDim(pos, bd.inner * size)
    if size == 1:
        return BatchDim(pos, bd.inner)
    return Lost("kron with the batch as the inner factor of a dimension mixes samples")
