"""`surgeon diff A B` / `surgeon.diff`: tensor by tensor, and the heads of the changed attention projections."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import surgeon

from helpers.cli import Cli
from helpers.tiny import tiny_llama

QKV = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module")
def base_and_reset(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff")
    tiny_llama().save_pretrained(root / "base")
    Cli()("reinit", root / "base", "--layers", "1", "-o", root / "reset")
    return root / "base", root / "reset"


def test_a_reset_changes_only_the_chosen_layers_qkv_and_each_head_is_measured(base_and_reset):
    base, reset = base_and_reset
    result = surgeon.diff(base, reset)
    assert sorted(result.changed) == sorted(f"model.layers.1.self_attn.{p}.weight" for p in QKV)
    assert all(t.status == "identical" for t in result.tensors if t.name not in result.changed)
    a, b = load_file(base / "model.safetensors"), load_file(reset / "model.safetensors")
    q = "model.layers.1.self_attn.q_proj.weight"
    expected = float((b[q].double() - a[q].double()).norm() / a[q].double().norm())
    assert {t.name: t.relative for t in result.tensors}[q] == pytest.approx(expected, rel=1e-12)
    # 8 query heads, 2 key and 2 value heads (grouped-query attention), each with kappa in A and in B
    assert [(h.role, h.head) for h in result.heads] == [("q", i) for i in range(8)] + [("k", 0), ("k", 1)] + [
        ("v", 0),
        ("v", 1),
    ]
    h0 = result.heads[0]
    head_a, head_b = a[q][0:8].double(), b[q][0:8].double()
    sa, sb = torch.linalg.svdvals(head_a), torch.linalg.svdvals(head_b)
    assert h0.kappa_a == pytest.approx(float(sa[0] / sa[-1]), rel=1e-9)
    assert h0.kappa_b == pytest.approx(float(sb[0] / sb[-1]), rel=1e-9)
    assert h0.relative == pytest.approx(float((head_b - head_a).norm() / head_a.norm()), rel=1e-12)
    assert all(h.layer == 1 and h.module == "model.layers.1.self_attn" for h in result.heads)


def test_the_cli_prints_the_changes_and_json(base_and_reset):
    base, reset = base_and_reset
    text = Cli()("diff", base, reset).stdout
    assert text.splitlines()[0] == f"{base} -> {reset}: 30 tensors, 27 identical, 3 changed"
    assert "  changed: model.layers.1.self_attn.k_proj.weight (relative change " in text
    assert "  model.layers.1.self_attn q head 7: " in text and "; kappa " in text
    data = json.loads(Cli()("diff", base, reset, "--json").stdout)
    assert len(data["tensors"]) == 30 and len(data["heads"]) == 12 and len(data["changed"]) == 3


def test_a_loaded_and_resaved_model_is_identical_and_a_dropped_tensor_is_named(tmp_path, base_and_reset):
    from transformers import AutoModelForCausalLM

    base, _ = base_and_reset
    AutoModelForCausalLM.from_pretrained(base).save_pretrained(tmp_path / "resaved")
    assert surgeon.diff(base, tmp_path / "resaved").identical
    # a checkpoint without lm_head: from_pretrained draws it afresh, and the diff says so
    weights = load_file(base / "model.safetensors")
    (tmp_path / "partial").mkdir()
    from safetensors.torch import save_file

    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, tmp_path / "partial" / "model.safetensors")
    (tmp_path / "partial" / "config.json").write_bytes((base / "config.json").read_bytes())
    AutoModelForCausalLM.from_pretrained(tmp_path / "partial").save_pretrained(tmp_path / "loaded")
    result = surgeon.diff(tmp_path / "partial", tmp_path / "loaded")
    assert result.changed == ["lm_head.weight"] and result.tensors[0].status == "only in B"
