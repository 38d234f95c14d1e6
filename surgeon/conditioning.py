"""The initialization math: conditioned reset, polar conditioning and condition numbers.

All matrices here are per head in PyTorch orientation: ``(head_dim, in_features)``, i.e. the
transpose of the paper's ``W^(h)`` (``D x d``). "Semi-orthogonal" therefore means orthonormal rows
when ``head_dim <= in_features`` (the paper's ``W^T W = I_d``), orthonormal columns otherwise.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass

import torch

VALUE_IDENTITIES = ("block", "per-head")


def head_seed(seed: int, tensor: str, role: str, head: int) -> int:
    """A 63-bit seed that depends only on (seed, tensor name, role, head).

    Draws are keyed this way so that the result does not depend on processing order, sharding,
    or which other heads are selected. The role is part of the key because a fused tensor holds
    the query, key and value heads under one name.
    """
    digest = hashlib.blake2b(f"{seed}\0{tensor}\0{role}\0{head}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def semi_orthogonal(rows: int, cols: int, *, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A Haar-random ``rows x cols`` matrix whose singular values are all exactly 1.

    The Gaussian draw happens on the CPU so that it is the same on every device; only the QR
    factorization runs on ``device``. Folding the signs of diag(R) into Q makes Q Haar-distributed
    (equivalent to the paper's polar factor of a Gaussian matrix, and cheaper).
    """
    tall, short = max(rows, cols), min(rows, cols)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gauss = torch.randn(tall, short, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss.to(device))
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    q = q * signs
    return q if rows >= cols else q.T


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
    s_max, s_min = float(singular_values.max()), float(singular_values.min())
    return math.inf if s_min == 0.0 else s_max / s_min


@dataclass(frozen=True)
class Spectrum:
    """Condition numbers of one projection: the whole matrix, and each of its heads."""

    kappa: float  # of the whole projection (all heads stacked)
    head_kappas: tuple[float, ...]
    norm: float  # spectral norm of the whole projection

    @property
    def head_min(self) -> float:
        return min(self.head_kappas)

    @property
    def head_median(self) -> float:
        return statistics.median(self.head_kappas)

    @property
    def head_max(self) -> float:
        return max(self.head_kappas)

    def to_dict(self) -> dict:
        return {
            "kappa": _finite(self.kappa),
            "head_kappa": {
                "min": _finite(self.head_min),
                "median": _finite(self.head_median),
                "max": _finite(self.head_max),
            },
            "spectral_norm": _finite(self.norm),
            "heads": [_finite(k) for k in self.head_kappas],
        }


def _finite(x: float) -> float | str:
    # JSON has no infinity; a singular matrix is reported as the string "inf".
    return x if math.isfinite(x) else "inf"


def singular_values(mats: torch.Tensor) -> torch.Tensor:
    """Singular values of a batch of matrices, from the eigenvalues of the smaller Gram matrix.

    LAPACK's SVD is slow on the degenerate spectra surgeon produces (all singular values 1);
    the Gram route is fast and, in float64, exact enough for condition numbers up to ~1e7.
    """
    mats = mats.to(torch.float64)
    gram = mats @ mats.transpose(-1, -2) if mats.shape[-2] <= mats.shape[-1] else mats.transpose(-1, -2) @ mats
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()


def spectrum(heads: torch.Tensor) -> Spectrum:
    """Condition numbers of a projection given as its per-head matrices ``(H, d, in)``."""
    per_head = singular_values(heads)
    whole = singular_values(heads.reshape(-1, heads.shape[-1]))
    return Spectrum(
        kappa=kappa(whole),
        head_kappas=tuple(kappa(s) for s in per_head.cpu()),
        norm=float(whole.max()),
    )
