"""The options, checked through the model's own forward (tests/helpers/observe.py)."""

from __future__ import annotations

import pytest
import torch

from surgeon import reinit_checkpoint

from helpers.families import FAMILIES
from helpers.observe import observe

pytestmark = pytest.mark.usefixtures("one_thread")


def run(saved_family, name, tmp_path, **options):
    src, before = saved_family(name)
    report = reinit_checkpoint(src, output=tmp_path / "out", **options)
    return before, observe(FAMILIES[name].load(tmp_path / "out")), report


def is_semi_orthogonal(w):
    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
    return torch.allclose(gram, torch.eye(gram.shape[0], dtype=gram.dtype), atol=1e-4)


def test_heads_subset_with_grouped_query_attention(saved_family, tmp_path):
    # llama: 8 query heads, 2 key/value heads -> query heads 0-3 share key/value head 0
    before, after, report = run(saved_family, "llama", tmp_path, layers="0", heads="0-3")
    b, a = before["model.layers.0.self_attn"], after["model.layers.0.self_attn"]
    for h in range(8):
        assert is_semi_orthogonal(a.q[h]) == (h < 4)
        assert torch.equal(a.q[h], b.q[h]) == (h >= 4)
    assert is_semi_orthogonal(a.k[0]) and torch.equal(a.k[1], b.k[1])
    assert torch.allclose(a.v[0], torch.eye(16, 64, dtype=a.v.dtype)[:8], atol=1e-6) and torch.equal(a.v[1], b.v[1])
    assert {(r.role, r.heads_changed) for r in report.rows} == {("q", (0, 1, 2, 3)), ("k", (0,)), ("v", (0,))}


def test_targets_inside_a_fused_tensor(saved_family, tmp_path):
    # gpt2 keeps Q, K and V in one Conv1D tensor: re-initializing q must leave k and v as they were
    before, after, _ = run(saved_family, "gpt2", tmp_path, layers="1", targets="q")
    b, a = before["transformer.h.1.attn"], after["transformer.h.1.attn"]
    assert all(is_semi_orthogonal(w) for w in a.q)
    assert torch.allclose(a.q_bias, torch.zeros_like(a.q_bias), atol=1e-6)
    for role in ("k", "v", "k_bias", "v_bias"):
        assert torch.equal(getattr(a, role), getattr(b, role)), role


def test_interleaved_layout_value_only(saved_family, tmp_path):
    before, after, _ = run(saved_family, "gpt_neox", tmp_path, layers="0", targets="v", bias="keep")
    module = next(m for m in before if m.endswith("layers.0.attention"))
    b, a = before[module], after[module]
    heads, d, width = a.v.shape
    for h in range(heads):
        assert torch.allclose(a.v[h], torch.eye(heads * d, width, dtype=a.v.dtype)[h * d : (h + 1) * d], atol=1e-6)
    assert torch.allclose(a.v_bias, b.v_bias)  # --bias keep
    assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k)


def test_per_head_value_identity(saved_family, tmp_path):
    _, after, _ = run(saved_family, "bert", tmp_path, layers="0", value_identity="per-head")
    a = after["encoder.layer.0.attention.self"]
    for w in a.v:
        assert torch.allclose(w, torch.eye(w.shape[0], w.shape[1], dtype=w.dtype), atol=1e-6)


def test_polar_mode_keeps_singular_vectors(saved_family, tmp_path):
    before, after, report = run(saved_family, "bert", tmp_path, layers="1", mode="polar")
    b, a = before["encoder.layer.1.attention.self"], after["encoder.layer.1.attention.self"]
    for role in ("q", "k", "v"):
        for old, new in zip(getattr(b, role), getattr(a, role)):
            u, _, vh = torch.linalg.svd(old, full_matrices=False)
            assert torch.allclose(new, u @ vh, atol=1e-5)
        assert torch.allclose(getattr(a, f"{role}_bias"), getattr(b, f"{role}_bias"), atol=1e-6)  # polar keeps biases
    assert all(r.after.head_max < 1 + 1e-5 for r in report.rows)


def test_strength_moves_kappa_geometrically(saved_family, tmp_path):
    before, after, report = run(saved_family, "llama", tmp_path, layers="1", mode="polar", strength=0.5)
    b, a = before["model.layers.1.self_attn"], after["model.layers.1.self_attn"]
    for role in ("q", "k", "v"):
        for old, new in zip(getattr(b, role), getattr(a, role)):
            s_old, s_new = torch.linalg.svdvals(old), torch.linalg.svdvals(new)
            assert torch.allclose(s_new, s_old.sqrt(), rtol=1e-4)
    for row in report.rows:
        for k0, k1 in zip(row.before.head_kappas, row.after.head_kappas):
            assert k1 == pytest.approx(k0**0.5, rel=1e-4)


def test_keep_scale_preserves_each_heads_norm(saved_family, tmp_path):
    before, after, _ = run(saved_family, "qwen2", tmp_path, layers="0", keep_scale=True)
    b, a = before["model.layers.0.self_attn"], after["model.layers.0.self_attn"]
    for role in ("q", "k", "v"):
        old, new = getattr(b, role), getattr(a, role)
        assert torch.allclose(torch.linalg.matrix_norm(new), torch.linalg.matrix_norm(old), rtol=1e-4)
        for w in new:  # still perfectly conditioned: a scaled semi-orthogonal matrix / scaled identity
            s = torch.linalg.svdvals(w)
            assert float(s.max() / s.min()) == pytest.approx(1.0, abs=1e-4)


def test_cross_attention_only(saved_family, tmp_path):
    before, after, report = run(saved_family, "bart", tmp_path, attention="cross")
    assert {r.block.kind for r in report.rows} == {"cross"}
    for module, obs in after.items():
        if obs.cross:
            assert all(is_semi_orthogonal(w) for w in obs.q)
            assert obs.k.shape[-1] == obs.v.shape[-1]  # keys read the encoder output
        else:
            assert torch.equal(obs.q, before[module].q)


def test_stack_selection_numbers_each_stack_from_zero(saved_family, tmp_path):
    before, after, report = run(saved_family, "t5", tmp_path, stack="decoder", layers="-1")
    changed = {r.block.module for r in report.rows}
    assert changed == {"decoder.block.1.layer.0.SelfAttention", "decoder.block.1.layer.1.EncDecAttention"}
    for module, obs in after.items():
        assert torch.equal(obs.q, before[module].q) == (module not in changed)


def test_dry_run_writes_nothing(saved_family, tmp_path):
    src, _ = saved_family("llama")
    report = reinit_checkpoint(src, output=tmp_path / "out", dry_run=True, layers="0-1", targets="q")
    assert not (tmp_path / "out").exists()
    assert [(r.block.layer, r.role) for r in report.rows] == [(0, "q"), (1, "q")]
    assert "plan (dry run, nothing written)" in report.render()
