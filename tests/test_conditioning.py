"""The initialization math, checked against its definitions."""

import math

import pytest
import torch

from surgeon.conditioning import head_seed, polar, rescale_to, semi_orthogonal, singular_values, spectrum, value_identity


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
    others = [head_seed(1, "layers.0.q_proj.weight", "q", 1), head_seed(0, "layers.1.q_proj.weight", "q", 1),
              head_seed(0, "layers.0.q_proj.weight", "k", 1), head_seed(0, "layers.0.q_proj.weight", "q", 2)]
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


def test_value_identity_past_input_width_reads_nothing():
    # 3 heads of 4 over 8 input features: the third head has no features left to read (kappa = inf).
    last = value_identity(2, 4, 8, "block")
    assert last.abs().sum() == 0
    assert math.isinf(spectrum(last[None]).kappa)


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
        assert k1 == pytest.approx(k0 ** 0.5, rel=1e-9)


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
    s = spectrum(w)
    assert s.head_kappas == (4.0, 1.0)
    assert s.norm == pytest.approx(float(torch.linalg.svdvals(w.reshape(4, 3)).max()))
    ref = torch.linalg.svdvals(w.reshape(4, 3))  # the stacked 4 x 3 matrix has full column rank
    assert s.kappa == pytest.approx(float(ref.max() / ref.min()))
