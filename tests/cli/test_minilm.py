"""The real pretrained all-MiniLM-L6-v2 (BERT family, 6 layers, 12 heads, width 384)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from helpers.digests import tree_digest
from helpers.observe import observe


def test_inspect_shows_real_condition_numbers(cli, minilm_dir):
    result = cli("inspect", minilm_dir, "--json", "--full")
    report = json.loads(result.stdout)
    assert [(b["stack"], b["layer"], b["heads"], b["kv_heads"], b["head_dim"]) for b in report["blocks"]] == [
        ("encoder.layer", i, 12, 12, 32) for i in range(6)
    ]
    rows = report["projections"]
    assert len(rows) == 18
    # What a trained BERT looks like (shared/method.md): whole-projection kappa in the thousands,
    # per-head median kappa about 2-4, spectral norm about 2.5-7.
    assert all(1000 < r["before"]["kappa"] < 40000 for r in rows)
    assert all(1.5 < r["before"]["head_kappa"]["median"] < 5 for r in rows)
    assert all(2 < r["before"]["spectral_norm"] < 8 for r in rows)
    text = cli("inspect", minilm_dir).stdout
    assert "encoder.layer  self  0-5" in text
    # without --full the whole-projection numbers are not measured, and say so
    quick = json.loads(cli("inspect", minilm_dir, "--json").stdout)["projections"]
    assert all(r["before"]["kappa"] is None and r["before"]["spectral_norm"] is None for r in quick)
    assert [r["before"]["heads"] for r in quick] == [r["before"]["heads"] for r in rows]


def test_reinit_top_layers_and_encode(cli, minilm_dir, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    source_files = tree_digest(minilm_dir)
    out = tmp_path / "minilm-top2"
    result = cli("reinit", minilm_dir, "--layers", "-2-", "-o", out, "--json")
    assert tree_digest(minilm_dir) == source_files
    report = json.loads(result.stdout)
    assert {(p["layer"], p["role"]) for p in report["projections"]} == {(layer, r) for layer in (4, 5) for r in "qkv"}
    for p in report["projections"]:
        assert p["after"]["head_kappa"]["max"] < 1 + 1e-5
        assert p["before"]["head_kappa"]["max"] > 2
    # every non-weight file (tokenizer, sentence-transformers modules, pooling config) came along
    out_files = tree_digest(out)
    for rel, digest in source_files.items():
        if rel not in ("model.safetensors", "README.md"):  # README.md: the new card, the source's below it
            assert out_files[rel] == digest, rel

    sentences = ["A man is playing a guitar.", "The weather is cold today."]
    original = SentenceTransformer(str(minilm_dir), device="cpu").encode(sentences, convert_to_tensor=True)
    reset = SentenceTransformer(str(out), device="cpu").encode(sentences, convert_to_tensor=True)
    assert torch.isfinite(reset).all() and reset.shape == (2, 384)
    assert not torch.allclose(original, reset, atol=1e-3)

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    batch = tok(sentences, return_tensors="pt", padding=True)
    a = AutoModel.from_pretrained(str(minilm_dir)).eval()
    b = AutoModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        ha = a(**batch, output_hidden_states=True).hidden_states
        hb = b(**batch, output_hidden_states=True).hidden_states
    for i in range(5):  # embeddings + layers 0-3 untouched: the same activations, bit for bit
        assert torch.equal(ha[i], hb[i]), i
    assert not torch.allclose(ha[5], hb[5])

    torch.set_num_threads(1)
    seen = observe(b)
    for layer in range(6):
        obs = seen[f"encoder.layer.{layer}.attention.self"]
        gram = obs.q @ obs.q.transpose(1, 2)
        eye = torch.eye(32, dtype=gram.dtype).expand_as(gram)
        assert torch.allclose(gram, eye, atol=1e-4) == (layer >= 4)


def test_polar_strength_on_pretrained_weights(minilm_dir, tmp_path):
    from surgeon import reinit_checkpoint

    report = reinit_checkpoint(
        minilm_dir, output=tmp_path / "o", mode="polar", strength=0.5, keep_scale=True, layers="0"
    )
    for row in report.rows:
        ratios = [k1 / k0**0.5 for k0, k1 in zip(row.before.head_kappas, row.after.head_kappas)]
        assert statistics.mean(ratios) == pytest.approx(1.0, abs=1e-4)
