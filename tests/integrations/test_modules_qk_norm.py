"""q/k normalization between the projections and the attention (issue 28, item 4): part of the model, kept as
it is, while the module route re-initializes the projections before it. A timm-style Attention with qk_norm
(tests/helpers/modules.py, after timm's vision_transformer.py: qkv Linear, q_norm/k_norm LayerNorm over head_dim, SDPA
or the written-out product) and transformers' Qwen3 (q_norm/k_norm RMSNorm), judged through their forward:
what reaches each norm is conditioned per head, the norms are untouched, the model still runs.
"""

from __future__ import annotations

import pytest
import torch

import surgeon
from surgeon.detect.module import detect_module, probe_blocks

from helpers.modules import Maps, TimmVisionTransformer, _Capture, _solve, assert_conditioned, assert_same, probe
from helpers.tiny import tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_thread")


def observe_before_norms(attn, x, call, q_norm, k_norm, value):
    """Per-head maps from ``x`` to what enters q_norm and k_norm and to the value at the attention product.

    ``value(captured_v, hooked)`` picks the value (B, H, L, d)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        q_norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("q", a[0])),
        k_norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("k", a[0])),
    ]
    mode = _Capture()
    try:
        with torch.no_grad(), mode:
            call(attn, x)
    finally:
        for h in hooks:
            h.remove()
    q, k = (seen[r] if seen[r].shape[1] != x.shape[1] else seen[r].transpose(1, 2) for r in "qk")  # (B, H, L, d)
    v = value(mode.qkv()[2])
    (qw, qb), (kw, kb), (vw, vb) = (_solve(x, t.float()) for t in (q, k, v))
    return Maps(qw, qb, kw, kb, vw, vb)


@pytest.mark.parametrize("fused_attn", [True, False], ids=["sdpa", "matmul-softmax"])
def test_timm_qk_norm_projections_are_reinitialized_and_the_norms_kept(fused_attn):
    torch.manual_seed(0)
    vit = TimmVisionTransformer(qk_norm=True, qkv_bias=True, depth=2, fused_attn=fused_attn).eval()
    with torch.no_grad():  # norms that are not the identity, so that keeping them is visible
        for n, p in vit.named_parameters():
            if "_norm." in n:
                p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if n.endswith("weight") else 0.0))
    x = probe(48)

    def maps(block):
        attn = block.attn
        return observe_before_norms(attn, x, lambda a, t: a(t), attn.q_norm, attn.k_norm, lambda v: v)

    before = [maps(b) for b in vit.blocks]
    state = {n: t.clone() for n, t in vit.state_dict().items()}
    report = surgeon.reinit_(vit, layers="0")
    assert [(b.module, b.heads, b.head_dim) for b in report.blocks] == [(f"blocks.{i}.attn", 6, 8) for i in range(2)]
    assert_conditioned(maps(vit.blocks[0]))
    assert_same(maps(vit.blocks[1]), before[1])
    moved = {n for n, t in vit.state_dict().items() if not torch.equal(t, state[n])}
    assert moved == {"blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"}  # q_norm/k_norm as they were
    (note,) = [n for n in report.notes if "q_norm" in n]
    assert note.startswith("blocks.0.attn and 1 more block: q_norm, k_norm ") and "kept as they are" in note
    out = vit(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 5) and torch.isfinite(out).all()


def qwen3_maps(model, layer):
    attn = model.model.layers[layer].self_attn
    x = probe(32, rows=40)

    def call(a, t):  # the attention module's own forward, with the model's own rotary embedding
        a(t, model.model.rotary_emb(t, torch.arange(t.shape[1])[None]), None)

    # v at the attention product is repeated to the query heads (repeat_kv) unless SDPA's enable_gqa is used:
    # one copy per key/value head
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads

    def value(v):
        return v[:, :: heads // kv_heads] if v.shape[1] == heads else v

    return observe_before_norms(attn, x, call, attn.q_norm, attn.k_norm, value)


def test_qwen3_in_memory_reinitializes_the_projections_before_q_norm_and_k_norm():
    model = tiny_qwen3()
    was = qwen3_maps(model, 1)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    report = surgeon.reinit_(model, layers="0")
    assert_conditioned(qwen3_maps(model, 0))
    assert_same(qwen3_maps(model, 1), was, atol=1e-5)
    moved = {n for n, t in model.state_dict().items() if not torch.equal(t, state[n])}
    assert moved == {f"model.layers.0.self_attn.{r}_proj.weight" for r in "qkv"}
    assert any(n.startswith("model.layers.0.self_attn and 1 more block: q_norm, k_norm ") for n in report.notes)
    assert torch.isfinite(model(torch.randint(0, 64, (1, 6))).logits).all()


def test_qwen3_forward_route_reads_through_the_norms_as_the_names_do():
    model = tiny_qwen3()

    def key(b):
        return (b.module, b.stack, b.layer, b.kind, b.heads, b.kv_heads, b.head_dim, b.q, b.k, b.v)

    notes: list[str] = []
    by_forward = probe_blocks(model, notes=notes)
    assert [key(b) for b in by_forward] == [key(b) for b in detect_module(model).blocks]
    assert len(notes) == 1 and "q_norm, k_norm" in notes[0]
