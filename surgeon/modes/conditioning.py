"""The initialization math: conditioned reset, polar conditioning and condition numbers.

All matrices here are per head in PyTorch orientation: ``(head_dim, in_features)``, i.e. the
transpose of the paper's ``W^(h)`` (``D x d``). "Semi-orthogonal" therefore means orthonormal rows
when ``head_dim <= in_features`` (the paper's ``W^T W = I_d``), orthonormal columns otherwise.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import torch

from ..vocab.spectrum import VALUE_IDENTITIES, Spectrum, kappa_from

__all__ = [
    "VALUE_IDENTITIES",
    "Spectrum",
    "head_seed",
    "semi_orthogonal",
    "semi_orthogonal_batch",
    "orthonormal_columns",
    "value_identity",
    "polar",
    "rescale_to",
    "kappa",
    "singular_values",
    "head_kappas",
    "spectrum",
    "in_parallel",
    "single_threaded",
]

_POOL: ThreadPoolExecutor | None = None

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def workers() -> int:
    """Threads for per-head CPU work: torch releases the GIL in randn, QR and eigensolves."""
    return max(1, min(os.cpu_count() or 1, 8))


def in_parallel(
    fn: Callable[[list[_Item]], _Result],
    items: list[_Item],
    *,
    device: torch.device | str = "cpu",
    min_chunk: int = 2,
) -> list[_Result]:
    """``[fn(chunk) for chunk in chunks(items)]`` over a thread pool, in order; on a GPU, one chunk.

    On the CPU every chunk runs with one intra-op thread, in the pool or in the caller: the parallelism
    is ours (one chunk per core), not LAPACK's. It also keeps the rounding the same whichever thread runs a
    chunk: MKL's thread count is per thread, so a pool thread first used outside :func:`single_threaded`
    would otherwise keep factoring with several threads while its neighbours use one.
    """
    global _POOL
    if torch.device(device).type != "cpu":
        return [fn(items)]
    n = workers()
    with single_threaded():
        if n == 1 or len(items) < 2 * min_chunk:
            return [fn(items)]
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                n, thread_name_prefix="surgeon", initializer=torch.set_num_threads, initargs=(1,)
            )
        size = -(-len(items) // n)
        return list(_POOL.map(fn, [items[i : i + size] for i in range(0, len(items), size)]))


@contextmanager
def single_threaded() -> Iterator[None]:
    """One intra-op thread for torch/LAPACK while surgeon computes; the previous setting comes back after.

    surgeon's work is many small factorizations, which :func:`in_parallel` spreads over the cores
    itself. Multi-threaded LAPACK calls on small matrices gain nothing, and on a busy machine their
    threads spin: the same 512 x 512 eigensolve was measured at 0.15 s alone and 2-4 s beside another
    process with two threads, 0.02 s with one.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def head_seed(seed: int, tensor: str, role: str, head: int) -> int:
    """A 63-bit seed that depends only on (seed, tensor name, role, head).

    Draws are keyed this way so that the result does not depend on processing order, sharding,
    or which other heads are selected. The role is part of the key because a fused tensor holds
    the query, key and value heads under one name.
    """
    digest = hashlib.blake2b(f"{seed}\0{tensor}\0{role}\0{head}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def semi_orthogonal(rows: int, cols: int, *, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A Haar-random ``rows x cols`` matrix whose singular values are all exactly 1."""
    return semi_orthogonal_batch(rows, cols, [seed], device=device)[0]


def semi_orthogonal_batch(
    rows: int, cols: int, seeds: list[int], *, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """One Haar-random ``rows x cols`` semi-orthogonal matrix per seed, stacked ``(len(seeds), rows, cols)``.

    Each matrix is the Q factor, with positive diag(R), of a float64 Gaussian ``tall x short`` matrix:
    Haar-distributed, and equal to the paper's polar factor of a Gaussian matrix in distribution.
    The Gaussians are drawn on the CPU (numpy's SFC64 generator seeded from ``seed``, ziggurat
    sampler: integer arithmetic, so the same bits on every machine), in parallel chunks; the
    orthonormalization runs batched on ``device``. Neither depends on the device or the batching.
    """
    tall, short = max(rows, cols), min(rows, cols)
    gauss = np.empty((len(seeds), tall, short), dtype=np.float64)
    heads = list(range(len(seeds)))

    def draw(idx: list[int]) -> None:  # each worker fills its own heads: no copies, no concatenation
        for i in idx:
            np.random.Generator(np.random.SFC64(seeds[i])).standard_normal(out=gauss[i])

    in_parallel(draw, heads)
    x = torch.from_numpy(gauss).to(device)
    out = torch.empty(len(seeds), rows, cols, dtype=torch.float64, device=device)

    def orthonormalize(idx: list[int]) -> None:
        part = slice(idx[0], idx[-1] + 1)
        orthonormal_columns(x[part], transposed=rows < cols, out=out[part])

    in_parallel(orthonormalize, heads, device=device)
    return out


# Cholesky QR (Q = X R^-1 with R^T R = X^T X) is two GEMMs, about 2x faster than
# Householder QR on CPU, and gives the same Q (the QR factorization with positive diag(R) is unique).
# Its loss of orthogonality is about kappa(X)^2 * u64: for a Gaussian X with at least CHOLESKY_ASPECT
# times more rows than columns kappa(X) < 3, so Q is orthonormal to ~1e-15. Squarer X use Householder.
CHOLESKY_ASPECT = 4


def orthonormal_columns(x: torch.Tensor, *, transposed: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Q factor with positive diag(R) of each tall matrix in ``x`` (batched, on x's device).

    ``transposed``: return Q^T, computed as such (contiguous, no transposing copy afterwards); ``out``: written
    there (the same bits as without: the same GEMM), not into a new tensor copied over afterwards.
    """
    if x.shape[-2] >= CHOLESKY_ASPECT * x.shape[-1]:
        chol, info = torch.linalg.cholesky_ex(x.mT @ x)
        if not bool(info.any()):
            # X @ R^-1 as a GEMM: batched triangular solves run ~3x slower on CPU, and R is tiny and
            # as well conditioned as X, so forming its inverse loses nothing.
            eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device).expand_as(chol)
            r_inv = torch.linalg.solve_triangular(chol.mT, eye, upper=True)
            return torch.matmul(r_inv.mT, x.mT, out=out) if transposed else torch.matmul(x, r_inv, out=out)
    q, r = torch.linalg.qr(x)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs[signs == 0] = 1
    q = q * signs.unsqueeze(-2)
    q = q.mT if transposed else q
    return q if out is None else out.copy_(q)


def value_identity(
    head: int, head_dim: int, in_features: int, kind: str, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The rectangular identity for value head ``head``.

    ``block``: the whole value projection is the rectangular identity, so head ``h`` reads input
    features ``h*d .. (h+1)*d - 1``; where the heads are wider than the input (multi-head latent attention's
    values over a narrow latent), they tile it: head ``h`` reads those of head ``h mod (D // d)``.
    ``per-head``: every head is ``I_{d x D}`` (reads the first d).
    """
    if kind not in VALUE_IDENTITIES:
        raise ValueError(f"value identity must be one of {VALUE_IDENTITIES}, not {kind!r}")
    slices = max(in_features // head_dim, 1)
    start = (head % slices) * head_dim if kind == "block" else 0
    eye = torch.zeros(head_dim, in_features, dtype=torch.float64, device=device)
    idx = torch.arange(head_dim, device=device)
    cols = idx + start
    keep = cols < in_features  # heads past the input width read nothing (reported, never hidden)
    eye[idx[keep], cols[keep]] = 1.0
    return eye


def polar(weights: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
    """Move each matrix's singular values geometrically toward 1: sigma -> sigma ** (1 - strength).

    ``strength=1`` gives the polar factor U V^T, the nearest semi-orthogonal matrix; singular
    vectors are kept, so kappa -> kappa ** (1 - strength). Works on a batch (..., m, n).
    """
    u, s, vh = torch.linalg.svd(weights.to(torch.float64), full_matrices=False)
    if strength >= 1.0:
        return u @ vh
    return u @ torch.diag_embed(s.pow(1.0 - strength)) @ vh


def rescale_to(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Scale each matrix of ``new`` to the Frobenius norm of the matching one in ``old``."""
    old_norm = torch.linalg.matrix_norm(old.to(torch.float64), keepdim=True)
    new_norm = torch.linalg.matrix_norm(new.to(torch.float64), keepdim=True)
    return new * torch.where(new_norm > 0, old_norm / new_norm, torch.zeros_like(new_norm))


def kappa(singular_values: torch.Tensor) -> float:
    """Condition number sigma_max / sigma_min from a vector of singular values (inf if singular)."""
    return kappa_from(float(singular_values.max()), float(singular_values.min()))


def singular_values(mats: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Singular values of a batch of matrices, from the eigenvalues of the smaller Gram matrix.

    LAPACK's SVD is slow on the degenerate spectra surgeon produces (all singular values 1);
    the Gram route is fast and, in float64, exact enough for condition numbers up to ~1e7.
    Matrices holding NaN or Inf get NaN singular values (the eigensolver would fail on them).
    """
    mats = mats.to(dtype)
    gram = _gram(mats)
    # A NaN or Inf anywhere in a matrix shows on its Gram diagonal (sums of squares): checking those few
    # numbers spares an elementwise pass over the matrices (as long as the Gram itself) where all is finite.
    if bool(torch.isfinite(torch.diagonal(gram, dim1=-2, dim2=-1)).all()):
        return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()
    finite = torch.isfinite(mats).flatten(-2).all(-1)
    if not bool(finite.all()):
        mats = torch.where(finite[..., None, None], mats, torch.zeros((), dtype=mats.dtype, device=mats.device))
        gram = _gram(mats)
    values = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()
    return torch.where(finite[..., None], values, torch.full((), math.nan, dtype=values.dtype, device=values.device))


def _gram(mats: torch.Tensor) -> torch.Tensor:
    """The smaller Gram matrix of each matrix of ``mats``."""
    return mats @ mats.transpose(-1, -2) if mats.shape[-2] <= mats.shape[-1] else mats.transpose(-1, -2) @ mats


# Per-head kappas of 16-bit weights (bf16, fp16: already rounded to 3-4 digits) are first computed
# from a float32 Gram matrix. Its eigenvalues carry an absolute
# error of about (sqrt(D) + d) * u32 * sigma_max^2 (u32 = 6e-8), so the relative error of kappa is about
# (sqrt(D) + d) * u32 * kappa^2 / 2: below 1e-3 for kappa <= FLOAT32_KAPPA_LIMIT at D = 4096, d = 128
# (and far below for the kappa ~ 1 heads surgeon writes). Heads above it, and float32/64 weights, are
# computed in float64.
FLOAT32_KAPPA_LIMIT = 10.0


def head_kappas(heads: torch.Tensor) -> tuple[float, ...]:
    """The condition number of each head of ``(H, d, in)``, batched (float32 first, see above)."""
    if heads.shape[0] == 0:
        return ()

    def kappas(idx: list[int]) -> list[float]:
        chunk = heads[idx[0] : idx[-1] + 1]
        if heads.dtype.itemsize > 2:
            return _kappas(singular_values(chunk, torch.float64))
        out = _kappas(singular_values(chunk, torch.float32))
        redo = [i for i, k in enumerate(out) if not math.isnan(k) and not k <= FLOAT32_KAPPA_LIMIT]
        if redo:
            exact = _kappas(singular_values(chunk[redo], torch.float64))
            for i, k in zip(redo, exact):
                out[i] = k
        return out

    return tuple(k for part in in_parallel(kappas, list(range(heads.shape[0])), device=heads.device) for k in part)


def _kappas(values: torch.Tensor) -> list[float]:
    return [kappa_from(hi, lo) for hi, lo in zip(values.max(-1).values.tolist(), values.min(-1).values.tolist())]


def spectrum(heads: torch.Tensor, *, whole: bool = False, kappas: tuple[float, ...] | None = None) -> Spectrum:
    """Condition numbers of a projection given as its per-head matrices ``(H, d, in)``.

    ``whole``: also the whole-matrix kappa and spectral norm: one eigensolve of the D x D Gram matrix,
    ~0.1 s at D = 768 but ~15 s at D = 4096 on a CPU, for a single number that says little about a
    matrix of independently drawn heads, so it is opt-in (``--full``). ``kappas``: per-head values
    already known for these exact bytes.
    """
    per_head = head_kappas(heads) if kappas is None else kappas
    if not whole:
        return Spectrum(kappa=None, head_kappas=per_head, norm=None)
    values = singular_values(heads.reshape(-1, heads.shape[-1]))
    return Spectrum(kappa=kappa(values), head_kappas=per_head, norm=float(values.max()))
