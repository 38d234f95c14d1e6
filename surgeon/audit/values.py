"""Tensors of an output against the recipe: untouched ones byte for byte, re-initialized ones re-derived.

Polar mode is checked against a stated bound. surgeon computes a head's new values in float64
(``conditioning.polar``: an SVD) and rounds them once to the stored dtype. Two computations of the same
polar factor (the writer's and this check's, maybe on other hardware or LAPACK) differ by at most
``tau = 8 * max(d, n) * 2**-52 * kappa * ||new head||_F`` (a backward-stable SVD's error, amplified by the
head's condition number kappa = sigma_max / sigma_min of the original; below 1e-10 of the head's norm
for kappa < 1e4). Each rounding moves a value by at most half a unit in the last place (ulp) of the dtype,
so a stored element may differ from this check's by at most

    |found - expected| <= 1 ulp(max(|found|, |expected|)) + tau        (per element)

One ulp of the dtype, nothing more for any head surgeon can condition: a drift of two ulps fails. With
strength 1 each head must also be semi-orthogonal: with unit rows (or columns) and every element within
the bound above of the exact polar factor Q (1.5 ulp <= 1.5 eps |Q_ij|, plus 2 tau), every entry of
W W^T - I is at most ``3 eps + 4 tau sqrt(m) + (1.5 eps + 2 tau sqrt(m))**2`` (m = max(d, n); eps the
dtype's machine epsilon), which is checked too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..compute.engine import EditKind
from ..errors import DerivedMismatch, VerificationError
from ..formats.base import tensor_bytes
from ..modes import get_mode
from ..modes.conditioning import single_threaded

if TYPE_CHECKING:
    from ..compute.engine import Engine
    from ..formats.base import WeightSet
    from ..options import ReinitOptions
    from ..vocab.change import Change

EPS64 = 2.0**-52


def raw(weights: WeightSet, name: str) -> bytes:
    """A tensor's stored bytes (``WeightSet.raw``: by byte range where the format allows, no decoding)."""
    return weights.raw(name)


def check_untouched(a: WeightSet, b: WeightSet, names: list[str], output: str | Path, original: str | Path) -> int:
    """Every tensor of ``names`` is byte-identical in ``b``; returns how many there are."""
    for name in names:
        info, theirs = a.tensors[name], b.tensors[name]
        if (info.shape, info.dtype) != (theirs.shape, theirs.dtype):
            raise VerificationError(
                f"{output}: tensor {name!r} is {theirs.dtype} {list(theirs.shape)}, the original {info.dtype} {list(info.shape)}"
            )
        if raw(a, name) != raw(b, name):
            raise VerificationError(
                f"{output}: tensor {name!r} is not in the recorded selection, but its bytes differ from {original}'s"
            )
    return len(names)


def check_changed(
    a: WeightSet,
    b: WeightSet,
    engine: Engine,
    names: list[str],
    options: ReinitOptions,
    output: str | Path,
    copies: dict[str, str],
) -> None:
    """Every re-initialized tensor of ``names`` (or, for a shared ONNX initializer, its recorded copy) is what the recipe gives."""
    for name in names:
        original = a.read(name)
        expected = engine.update(name, original, record=False)
        new_name = copies.get(name, name)
        info, theirs = a.tensors[name], b.tensors[new_name]
        if (info.shape, info.element) != (theirs.shape, theirs.element):
            raise VerificationError(
                f"{output}: tensor {new_name!r} is {theirs.dtype} {list(theirs.shape)}, the original {info.dtype} {list(info.shape)}"
            )
        found = b.read(new_name)
        if get_mode(options.mode).exact or not any(what is EditKind.WEIGHT for _, what in engine.edits[name]):
            if raw(b, new_name) != tensor_bytes(expected):
                raise DerivedMismatch(
                    f"{output}: tensor {new_name!r}: {first_difference(expected, found)}; the recipe re-derived from the record's seed gives other values"
                )
        else:
            with single_threaded():  # small factorizations: LAPACK's threads only spin on a busy machine
                check_polar(name, engine, original, expected, found, options, output)


def first_difference(expected: torch.Tensor, found: torch.Tensor) -> str:
    diff = (expected.double() != found.double()) if expected.dtype.is_floating_point else (expected != found)
    idx = diff.nonzero()
    if not len(idx):
        return "the bytes differ"
    where = tuple(int(i) for i in idx[0])
    return f"element {list(where)} is {found[where].item():.9g}, the recipe gives {expected[where].item():.9g}"


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |x| (float64 in, float64 out): 2**(e - p) for |x| in [2**(e-1), 2**e)."""
    info = torch.finfo(dtype)
    p = round(-torch.log2(torch.tensor(info.eps)).item()) + 1  # significand bits, the implicit one included
    _, e = torch.frexp(x.abs())
    return torch.maximum(torch.ldexp(torch.ones_like(x), e - p), torch.full_like(x, info.tiny * info.eps))


def _heads_where(
    name: str, engine: Engine, shape: tuple[int, ...], per_head: Callable[[Change], list[float]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(selected mask, tau per element) of tensor ``name``; ``per_head(change)`` gives each head's tau."""
    mask = torch.zeros(shape, dtype=torch.bool)
    tau = torch.zeros(shape, dtype=torch.float64)
    for change, what in engine.edits[name]:
        rows = change.projection.weight if what is EditKind.WEIGHT else change.projection.bias
        assert rows is not None  # a bias edit is planned only for a projection with one
        taus = per_head(change) if what is EditKind.WEIGHT else [0.0] * len(change.heads)
        for h, t in zip(change.heads, taus):
            for target, value in ((mask, True), (tau, t)):
                view = target if rows.axis == 0 or what is EditKind.BIAS else target.transpose(0, 1)
                view[rows.head_slice(h)] = value
    return mask, tau


def polar_tau(original: torch.Tensor, expected: torch.Tensor, change: Change) -> list[float]:
    """tau of each head of ``change`` (see the module's docstring)."""
    from ..compute.engine import head_matrices

    rows = change.projection.weight
    old = head_matrices(original, rows, change.heads).double()
    new = head_matrices(expected, rows, change.heads).double()
    s = torch.linalg.svdvals(old)
    kappa = torch.where(
        s[:, -1] > 0, s[:, 0] / s[:, -1].clamp_min(1e-300), torch.full_like(s[:, 0], 1 / EPS64)
    ).clamp_max(1 / EPS64)
    m = max(old.shape[1], old.shape[2])
    return (8 * m * EPS64 * kappa * torch.linalg.matrix_norm(new)).tolist()


def check_polar(
    name: str,
    engine: Engine,
    original: torch.Tensor,
    expected: torch.Tensor,
    found: torch.Tensor,
    options: ReinitOptions,
    output: str | Path,
) -> None:
    mask, tau = _heads_where(name, engine, tuple(found.shape), lambda c: polar_tau(original, expected, c))
    if not torch.equal(tensor_bytes_view(found[~mask]), tensor_bytes_view(original[~mask])):
        raise VerificationError(f"{output}: tensor {name!r} changed outside the recorded heads")
    exp64, got64 = expected.double(), found.double()
    bound = ulp(torch.maximum(exp64.abs(), got64.abs()), found.dtype) + tau
    bad = ((exp64 - got64).abs() > bound) & mask
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        off = ((exp64 - got64).abs() / ulp(exp64.abs(), found.dtype))[where].item()
        raise DerivedMismatch(
            f"{output}: tensor {name!r}: element {list(where)} is {got64[where].item():.9g}, polar conditioning of the original gives "
            f"{exp64[where].item():.9g} ({off:.3g} ulps of {found.dtype} off, beyond {found.dtype} rounding: 1 ulp)"
        )
    if not options.keep_scale:  # the heads at strength 1 are semi-orthogonal
        _check_semi_orthogonal(name, engine, got64, tau, found.dtype, output)


def tensor_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The elements' bits, so that -0.0 != 0.0 and NaN == NaN compare as bytes do."""
    return t.contiguous().view(torch.uint8) if t.numel() else t.reshape(0).to(torch.uint8)


def _check_semi_orthogonal(
    name: str, engine: Engine, got64: torch.Tensor, tau: torch.Tensor, dtype: torch.dtype, output: str | Path
) -> None:
    from ..compute.engine import head_matrices

    eps = torch.finfo(dtype).eps
    for change, what in engine.edits[name]:
        if what is not EditKind.WEIGHT or change.strength not in (None, 1.0):
            continue
        rows = change.projection.weight
        heads = head_matrices(got64, rows, change.heads)
        d, n = heads.shape[1], heads.shape[2]
        gram = heads @ heads.transpose(1, 2) if d <= n else heads.transpose(1, 2) @ heads
        err = (gram - torch.eye(min(d, n), dtype=torch.float64)).abs().amax(dim=(1, 2))
        t = head_matrices(tau, rows, change.heads).amax(dim=(1, 2)) * max(d, n) ** 0.5
        allowed = 3 * eps + 4 * t + (1.5 * eps + 2 * t) ** 2 + 4 * max(d, n) * EPS64
        worst = int(torch.argmax(err - allowed))
        if err[worst] > allowed[worst]:
            raise DerivedMismatch(
                f"{output}: tensor {name!r}: the {change.role} heads of {change.block.module} are not semi-orthogonal "
                f"(|W Wᵀ - I| up to {err[worst].item():.3g}, {dtype} rounding allows {allowed[worst].item():.3g})"
            )
