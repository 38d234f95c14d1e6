"""The initialization math: conditioned reset, polar conditioning and condition numbers.

All matrices here are per head in PyTorch orientation: ``(head_dim, in_features)``, i.e. the
transpose of the paper's ``W^(h)`` (``D x d``). "Semi-orthogonal" therefore means orthonormal rows
when ``head_dim <= in_features`` (the paper's ``W^T W = I_d``), orthonormal columns otherwise.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .spectrum import VALUE_IDENTITIES, Spectrum, kappa_from

__all__ = ["VALUE_IDENTITIES", "Spectrum", "head_seed", "semi_orthogonal", "semi_orthogonal_batch", "value_identity",
           "polar", "rescale_to", "kappa", "singular_values", "head_kappas", "spectrum", "in_parallel"]

_POOL: ThreadPoolExecutor | None = None


def workers() -> int:
    """Threads for per-head CPU work: torch releases the GIL in randn, QR and eigensolves."""
    return max(1, min(os.cpu_count() or 1, 8))


def in_parallel(fn, items: list, *, device: torch.device | str = "cpu", min_chunk: int = 2) -> list:
    """``[fn(chunk) for chunk in chunks(items)]`` over a thread pool, in order, on CPU only.

    Each chunk runs with one intra-op thread: batched LAPACK calls on small matrices gain nothing from
    more, and two-thread LAPACK calls spin on a busy machine. On a GPU the work is already parallel.
    """
    global _POOL
    n = workers()
    if torch.device(device).type != "cpu" or n == 1 or len(items) < 2 * min_chunk:
        return [fn(items)]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(n, thread_name_prefix="surgeon")
    size = -(-len(items) // n)
    chunks = [items[i : i + size] for i in range(0, len(items), size)]
    return list(_POOL.map(lambda chunk: _one_thread(fn, chunk), chunks))


def _one_thread(fn, chunk):
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(chunk)
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


def semi_orthogonal_batch(rows: int, cols: int, seeds: list[int], *, device: torch.device | str = "cpu") -> torch.Tensor:
    """One Haar-random ``rows x cols`` semi-orthogonal matrix per seed, stacked ``(len(seeds), rows, cols)``.

    The Gaussian draws happen on the CPU, one generator per seed, so that they are the same on every
    device and for every batching; the QR factorization runs batched on ``device``. Folding the signs
    of diag(R) into Q makes Q Haar-distributed (equivalent to the paper's polar factor of a Gaussian
    matrix, and cheaper). The float64 draw is kept on purpose: torch's float32 normal sampler takes a
    vectorized path only on AVX2 CPUs, which would make the bytes depend on the machine.
    """
    tall, short = max(rows, cols), min(rows, cols)

    def draw(chunk: list[int]) -> torch.Tensor:
        gauss = torch.empty(len(chunk), tall, short, dtype=torch.float64)
        gen = torch.Generator(device="cpu")
        for i, seed in enumerate(chunk):
            gen.manual_seed(seed)
            torch.randn(tall, short, generator=gen, dtype=torch.float64, out=gauss[i])
        q, r = torch.linalg.qr(gauss.to(device))
        signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
        signs[signs == 0] = 1
        return q * signs.unsqueeze(-2)

    parts = in_parallel(draw, list(seeds), device=device)
    q = parts[0] if len(parts) == 1 else torch.cat(parts)
    return q if rows >= cols else q.transpose(-1, -2)


def value_identity(head: int, head_dim: int, in_features: int, kind: str, *, device=None) -> torch.Tensor:
    """The rectangular identity for value head ``head``.

    ``block``: the whole value projection is the rectangular identity, so head ``h`` reads input
    features ``h*d .. (h+1)*d - 1``. ``per-head``: every head is ``I_{d x D}`` (reads the first d).
    """
    if kind not in VALUE_IDENTITIES:
        raise ValueError(f"value identity must be one of {VALUE_IDENTITIES}, not {kind!r}")
    start = head * head_dim if kind == "block" else 0
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


# The whole-projection spectrum is an eigensolve of a D x D Gram matrix: ~0.1 s at D = 1024, but
# ~15 s at D = 4096 on two CPU cores. By default it is computed up to this size (and always on a GPU).
WHOLE_SPECTRUM_LIMIT = 1024


def whole_spectrum_default(shape: tuple[int, ...], device: torch.device) -> bool:
    return device.type == "cuda" or min(shape[-2:]) <= WHOLE_SPECTRUM_LIMIT


def singular_values(mats: torch.Tensor) -> torch.Tensor:
    """Singular values of a batch of matrices, from the eigenvalues of the smaller Gram matrix.

    LAPACK's SVD is slow on the degenerate spectra surgeon produces (all singular values 1);
    the Gram route is fast and, in float64, exact enough for condition numbers up to ~1e7.
    Matrices holding NaN or Inf get NaN singular values (the eigensolver would fail on them).
    """
    mats = mats.to(torch.float64)
    finite = torch.isfinite(mats).flatten(-2).all(-1)
    if not bool(finite.all()):
        mats = torch.where(finite[..., None, None], mats, torch.zeros((), dtype=mats.dtype, device=mats.device))
    gram = mats @ mats.transpose(-1, -2) if mats.shape[-2] <= mats.shape[-1] else mats.transpose(-1, -2) @ mats
    values = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()
    return torch.where(finite[..., None], values, torch.full((), math.nan, dtype=values.dtype, device=values.device))


def head_kappas(heads: torch.Tensor) -> tuple[float, ...]:
    """The condition number of each head of ``(H, d, in)``, in one batched eigensolve."""
    if heads.shape[0] == 0:
        return ()
    parts = in_parallel(lambda idx: singular_values(heads[idx[0] : idx[-1] + 1]).cpu(), list(range(heads.shape[0])), device=heads.device)
    per_head = torch.cat(parts)
    return tuple(kappa_from(hi, lo) for hi, lo in zip(per_head.max(-1).values.tolist(), per_head.min(-1).values.tolist()))


def spectrum(heads: torch.Tensor, *, whole: bool | None = None, kappas: tuple[float, ...] | None = None) -> Spectrum:
    """Condition numbers of a projection given as its per-head matrices ``(H, d, in)``.

    ``whole``: also the whole-matrix kappa and spectral norm (default: when cheap, see
    ``whole_spectrum_default``). ``kappas``: per-head values already known for these exact bytes.
    """
    if whole is None:
        whole = whole_spectrum_default((heads.shape[0] * heads.shape[1], heads.shape[-1]), heads.device)
    per_head = head_kappas(heads) if kappas is None else kappas
    if not whole:
        return Spectrum(kappa=None, head_kappas=per_head, norm=None)
    values = singular_values(heads.reshape(-1, heads.shape[-1]))
    return Spectrum(kappa=kappa(values), head_kappas=per_head, norm=float(values.max()))
