"""The initialization math, checked against its definitions."""

from __future__ import annotations

import math

import pytest
import torch

from surgeon.modes.conditioning import (
    head_seed,
    in_parallel,
    polar,
    rescale_to,
    semi_orthogonal,
    single_threaded,
    singular_values,
    spectrum,
    value_identity,
)


@pytest.mark.parametrize("rows,cols", [(16, 64), (64, 64), (64, 16), (1, 8)])
def test_semi_orthogonal_has_unit_singular_values(rows, cols):
    w = semi_orthogonal(rows, cols, seed=3)
    assert w.shape == (rows, cols)
    s = torch.linalg.svdvals(w)
    assert torch.allclose(s, torch.ones_like(s), atol=1e-12)
    gram = w @ w.T if rows <= cols else w.T @ w
    assert torch.allclose(gram, torch.eye(min(rows, cols), dtype=gram.dtype), atol=1e-12)


def test_semi_orthogonal_is_deterministic_and_keyed():
    a = semi_orthogonal(8, 32, seed=head_seed(0, "layers.0.q_proj.weight", "q", 1))
    b = semi_orthogonal(8, 32, seed=head_seed(0, "layers.0.q_proj.weight", "q", 1))
    assert torch.equal(a, b)
    others = [
        head_seed(1, "layers.0.q_proj.weight", "q", 1),
        head_seed(0, "layers.1.q_proj.weight", "q", 1),
        head_seed(0, "layers.0.q_proj.weight", "k", 1),
        head_seed(0, "layers.0.q_proj.weight", "q", 2),
    ]
    assert len({head_seed(0, "layers.0.q_proj.weight", "q", 1), *others}) == 5


def test_semi_orthogonal_is_haar_not_biased():
    # Haar-random orthogonal matrices have E[W] = 0; without the sign fix of QR the diagonal is biased positive.
    mean_diag = torch.stack([torch.diagonal(semi_orthogonal(4, 4, seed=s)) for s in range(4000)]).mean()
    assert abs(float(mean_diag)) < 0.03


def test_value_identity_block_and_per_head():
    d, D = 4, 12
    block = torch.cat([value_identity(h, d, D, "block") for h in range(3)])
    assert torch.equal(block, torch.eye(12, dtype=torch.float64))
    per_head = [value_identity(h, d, D, "per-head") for h in range(3)]
    for m in per_head:
        assert torch.equal(m, torch.eye(d, D, dtype=torch.float64))


def test_value_identity_past_input_width_tiles_the_input():
    # 3 heads of 4 over 8 input features: the third head reads the first head's features again (kappa 1),
    # rather than nothing
    first, last = value_identity(0, 4, 8, "block"), value_identity(2, 4, 8, "block")
    assert torch.equal(last, first) and torch.equal(first, torch.eye(4, 8, dtype=torch.float64))
    assert spectrum(last[None]).head_kappas[0] == 1


def test_polar_keeps_singular_vectors_and_moves_singular_values():
    torch.manual_seed(0)
    w = torch.randn(2, 8, 32, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    p = polar(w)
    assert torch.allclose(torch.linalg.svdvals(p), torch.ones(2, 8, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(p, u @ vh, atol=1e-12)
    half = polar(w, 0.5)
    assert torch.allclose(torch.linalg.svdvals(half), s.sqrt(), atol=1e-10)
    before, after = spectrum(w), spectrum(half)
    for k0, k1 in zip(before.head_kappas, after.head_kappas):
        assert k1 == pytest.approx(k0**0.5, rel=1e-9)


def test_rescale_to_matches_frobenius_norm():
    old = torch.randn(3, 4, 16, dtype=torch.float64) * 5
    new = rescale_to(polar(old), old)
    assert torch.allclose(torch.linalg.matrix_norm(new), torch.linalg.matrix_norm(old))
    assert all(k == pytest.approx(1.0) for k in spectrum(new).head_kappas)


def test_singular_values_match_svd_on_random_and_degenerate_matrices():
    torch.manual_seed(1)
    for m in (torch.randn(5, 8, 40, dtype=torch.float64), torch.randn(5, 40, 8, dtype=torch.float64)):
        ref = torch.linalg.svdvals(m)
        assert torch.allclose(singular_values(m).sort(-1, descending=True).values, ref, rtol=1e-9, atol=1e-9)


def test_spectrum_of_known_matrix():
    w = torch.zeros(2, 2, 3, dtype=torch.float64)
    w[0, 0, 0], w[0, 1, 1] = 4.0, 1.0  # head 0: singular values 4, 1
    w[1, 0, 2], w[1, 1, 0] = 2.0, 2.0  # head 1: 2, 2 -- but shares column 0 with head 0
    s = spectrum(w, whole=True)
    assert s.head_kappas == (4.0, 1.0)
    assert s.norm == pytest.approx(float(torch.linalg.svdvals(w.reshape(4, 3)).max()))
    ref = torch.linalg.svdvals(w.reshape(4, 3))  # the stacked 4 x 3 matrix has full column rank
    assert s.kappa == pytest.approx(float(ref.max() / ref.min()))


def test_draw_is_the_positive_qr_of_seeded_sfc64_gaussians():
    """The documented recipe, recomputed independently: numpy SFC64 Gaussians -> Householder QR, diag(R) > 0."""
    import numpy as np

    from surgeon.modes.conditioning import semi_orthogonal_batch

    seeds = [head_seed(3, "layers.0.q_proj.weight", "q", h) for h in range(5)]
    for rows, cols in [(8, 64), (16, 16), (64, 8), (12, 40)]:
        got = semi_orthogonal_batch(rows, cols, seeds)
        for seed, mat in zip(seeds, got):
            gauss = np.random.Generator(np.random.SFC64(seed)).standard_normal((max(rows, cols), min(rows, cols)))
            q, r = torch.linalg.qr(torch.from_numpy(gauss))
            q = q * torch.sign(torch.diagonal(r))
            assert torch.allclose(mat, q if rows >= cols else q.T, atol=1e-13)


def test_draws_do_not_depend_on_batching_or_order():
    from surgeon.modes.conditioning import semi_orthogonal_batch

    seeds = [head_seed(0, "w", "k", h) for h in range(9)]
    together = semi_orthogonal_batch(16, 256, seeds)
    alone = torch.stack([semi_orthogonal_batch(16, 256, [s])[0] for s in seeds])
    reversed_ = semi_orthogonal_batch(16, 256, seeds[::-1]).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, reversed_)


def test_nonfinite_heads_get_nan_kappa_not_an_error():
    w = torch.randn(3, 4, 16, dtype=torch.float64)
    w[1, 0, 3] = float("nan")  # noqa
    w[2, 2, 2] = float("inf")
    s = spectrum(w, whole=True)
    assert math.isnan(s.head_kappas[1]) and math.isnan(s.head_kappas[2]) and math.isfinite(s.head_kappas[0])
    assert s.nonfinite_heads == (1, 2) and math.isnan(s.kappa)
    assert s.to_dict()["heads"][1] == "nan" and s.head_max == s.head_kappas[0]


def test_whole_spectrum_only_when_asked():
    wide = torch.randn(8, 128, 1024)
    assert spectrum(wide).kappa is None and spectrum(wide).norm is None
    full = spectrum(wide, whole=True)
    ref = torch.linalg.svdvals(wide.double().reshape(-1, 1024))
    assert full.kappa == pytest.approx(float(ref[0] / ref[-1]), rel=1e-6) and full.norm == pytest.approx(
        float(ref[0]), rel=1e-9
    )
    assert full.head_kappas == spectrum(wide).head_kappas


def test_parallel_chunks_run_with_one_intra_op_thread_whoever_calls():
    """Every chunk factors with one thread, in the pool or in the caller, inside single_threaded or not.

    MKL's thread count is per thread: a pool thread first used outside single_threaded used to keep
    two threads and round differently from its neighbours, so two processes printed different kappas.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(2)

    def threads(chunk):
        return torch.get_num_threads()

    try:
        seen = in_parallel(threads, list(range(64)), min_chunk=1) + in_parallel(threads, [0])
        with single_threaded():
            seen += in_parallel(threads, list(range(64)), min_chunk=1)
        assert set(seen) == {1}
        assert torch.get_num_threads() == 2  # the caller's setting comes back
    finally:
        torch.set_num_threads(before)
