"""The module walker on modules that are not Hugging Face models: timm-style ViT, torch.nn
Transformer layers and MultiheadAttention, and custom modules naming their projections freely.

Effects are read through each attention module's own forward (tests/helpers/modules.py: q, k, v caught at
the attention product, per-head maps solved from a known probe): re-initialized blocks have
semi-orthogonal query/key heads, block-identity values and zero biases; the others are unchanged.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgeon
from surgeon.errors import LayoutError, NoAttentionFoundError

from helpers.modules import (
    FusedEinsumAttention,
    InterleavedQKV,
    LucidAttention,
    MetaTransformer,
    Stack,
    TimmVisionTransformer,
    assert_conditioned,
    assert_same,
    observe,
    observe_mha,
    randomize_biases,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(module):
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


def assert_only_changed(module, before, changed_prefixes):
    for n, t in module.state_dict().items():
        touched = any(n.startswith(p) for p in changed_prefixes)
        assert torch.equal(t, before[n]) != touched, n


@pytest.mark.parametrize("fused_attn", [True, False], ids=["sdpa", "matmul-softmax"])
def test_timm_vision_transformer(fused_attn):
    torch.manual_seed(0)
    vit = randomize_biases(TimmVisionTransformer(fused_attn=fused_attn, qkv_bias=True)).eval()
    scale = 1.0 if fused_attn else vit.blocks[0].attn.scale  # the unfused path scales q before q @ kᵀ
    before = [observe(b.attn, 48, q_scale=scale) for b in vit.blocks]
    state = snapshot(vit)
    report = surgeon.reinit_(vit, layers="0,2", seed=2)
    assert [(b.stack, b.layer, b.kind, b.heads, b.head_dim, b.layout) for b in report.blocks] == [
        ("blocks", i, "self", 6, 8, "forward: fused qkv") for i in range(3)
    ]
    for i, block in enumerate(vit.blocks):
        got = observe(block.attn, 48, q_scale=scale)
        if i in (0, 2):
            assert_conditioned(got)
        else:
            assert_same(got, before[i])
    assert_only_changed(vit, state, ["blocks.0.attn.qkv.", "blocks.2.attn.qkv."])
    # the image-to-logits forward still runs
    assert vit(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_interleaved_fused_layout_is_read_from_the_forward():
    """``qkv`` viewed (B, N, H, 3, d): the name suggests timm's blocked layout; the forward says otherwise."""
    torch.manual_seed(0)
    model = randomize_biases(Stack(lambda: InterleavedQKV(32, heads=4), 32)).eval()
    report = surgeon.inspect(model)
    q, k = report.blocks[0].q.weight, report.blocks[0].k.weight
    assert q.offsets == (0, 24, 48, 72) and k.offsets == (8, 32, 56, 80)
    surgeon.reinit_(model, seed=1)
    for layer in model.layers:
        assert_conditioned(observe(layer["attn"], 32))


def test_lucidrains_style_self_and_cross_attention():
    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = LucidAttention(24, heads=4, dim_head=6)
            self.memory = nn.Linear(24, 16)
            self.cross = LucidAttention(24, heads=4, dim_head=6, context_dim=16)

        def forward(self, x):
            return self.cross(x, context=self.memory(self.encoder(x)))

    torch.manual_seed(0)
    model = randomize_biases(EncoderDecoder()).eval()
    before = observe(model.encoder, 24)
    report = surgeon.inspect(model)
    kinds = {b.module: (b.kind, b.heads, b.head_dim, b.layout) for b in report.blocks}
    assert kinds == {
        "encoder": ("self", 4, 6, "forward: to_q, to_k, to_v"),
        "cross": ("cross", 4, 6, "forward: to_q, to_k, to_v"),
    }
    assert {b.module: b.k.in_features for b in report.blocks} == {"encoder": 24, "cross": 16}
    surgeon.reinit_(model, attention="cross", seed=4)
    assert_same(observe(model.encoder, 24), before)
    # inner width 24 = 4 heads x 6: the 16-wide context holds two heads' features; heads 2-3 read those
    # of heads 0-1 again (the block identity tiles it) rather than features 12-23, which do not all exist
    got = observe(model.cross, 24, context_width=16)
    assert_conditioned(got)
    assert torch.allclose(got.v[2:], got.v[:2], atol=1e-12)
    assert torch.allclose(got.v[1], torch.eye(16, dtype=got.v.dtype)[6:12], atol=1e-12)


def test_fused_to_qkv_chunked_with_einsum_attention():
    torch.manual_seed(0)
    model = Stack(lambda: FusedEinsumAttention(32, heads=4, dim_head=8), 32, depth=3).eval()
    before = [observe(layer["attn"], 32) for layer in model.layers]
    report = surgeon.reinit_(model, layers="-1", seed=5)
    assert report.blocks[0].layout == "forward: fused to_qkv"
    assert [r.block.layer for r in report.rows] == [2, 2, 2]
    for i, layer in enumerate(model.layers):
        got = observe(layer["attn"], 32)
        assert_conditioned(got) if i == 2 else assert_same(got, before[i])


def _meta_call(attn, x):
    # position 0 everywhere: rotary embeddings are the identity, so the maps are position free
    d = attn.head_dim
    return attn(x, 0, torch.ones(x.shape[1], d // 2, dtype=torch.complex64), None)


def test_meta_llama_style_needs_example_inputs():
    torch.manual_seed(0)
    model = MetaTransformer().eval()
    state = snapshot(model)
    with pytest.raises(LayoutError) as err:
        surgeon.reinit_(model)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("layers.0.attention looks like attention (wq.weight, wk.weight, wv.weight)")
    assert "example_inputs" in message
    assert_only_changed(model, state, [])

    tokens = torch.randint(0, 64, (1, 6))
    report = surgeon.reinit_(model, example_inputs=tokens, layers="1", seed=6)
    block = report.blocks[1]
    assert (block.heads, block.kv_heads, block.head_dim, block.layout) == (6, 2, 8, "forward: wq, wk, wv")
    got = observe(model.layers[1].attention, 48, call=_meta_call)
    assert_conditioned(got, kv_groups=3)
    assert_only_changed(model, state, ["layers.1.attention.wq.", "layers.1.attention.wk.", "layers.1.attention.wv."])


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 48, dropout=0.0, batch_first=batch_first)
    enc = randomize_biases(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)).eval()
    before = [observe_mha(m.self_attn) for m in enc.layers]
    state = snapshot(enc)
    report = surgeon.reinit_(enc, layers="1", seed=8)
    assert [(b.module, b.layout) for b in report.blocks] == [
        (f"layers.{i}.self_attn", "fused in_proj") for i in range(3)
    ]
    for i, m in enumerate(enc.layers):
        got = observe_mha(m.self_attn)
        assert_conditioned(got) if i == 1 else assert_same(got, before[i])
    assert_only_changed(enc, state, ["layers.1.self_attn.in_proj_"])


def test_transformer_decoder_cross_attention_only():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(32, 4, 48, dropout=0.0, batch_first=True)
    dec = randomize_biases(nn.TransformerDecoder(layer, 2)).eval()
    before = {
        n: observe_mha(m, cross=n.endswith("multihead_attn"))
        for n, m in dec.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }
    report = surgeon.reinit_(dec, attention="cross", seed=9)
    assert [(b.module, b.kind) for b in report.blocks] == [
        ("layers.0.self_attn", "self"),
        ("layers.0.multihead_attn", "cross"),
        ("layers.1.self_attn", "self"),
        ("layers.1.multihead_attn", "cross"),
    ]
    for n, old in before.items():
        got = observe_mha(dec.get_submodule(n), cross=n.endswith("multihead_attn"))
        assert_conditioned(got) if n.endswith("multihead_attn") else assert_same(got, old)


def test_multihead_attention_with_kdim_vdim():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, kdim=16, vdim=16, batch_first=True)
    nn.init.normal_(mha.in_proj_bias, std=0.1)
    report = surgeon.reinit_(mha)
    (block,) = report.blocks
    assert (block.module, block.kind, block.layout, block.k.in_features) == ("", "cross", "separate in_proj", 16)
    got = observe_mha(mha)
    assert_conditioned(got)
    # value heads 2-3 tile the 16-wide input: they read those of heads 0-1
    assert torch.allclose(got.v[2:], got.v[:2], atol=1e-12)


def test_normalization_written_as_ops_is_refused_in_one_line():
    # Swin-v2-style cosine attention: F.normalize on q and k is no norm module, so the probe cannot read through
    # it (LayerNorm/RMSNorm modules it can: tests/integrations/test_modules_qk_norm.py)
    class CosineAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4).unbind(0)
            q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    model = CosineAttention()
    state = snapshot(model)
    with pytest.raises(LayoutError) as err:
        surgeon.reinit_(model)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("cannot resolve the attention in CosineAttention: its query is not")
    assert "normalization written as ops" in message or "F.normalize" in message
    assert_only_changed(model, state, [])


def test_heads_split_over_several_tensors_are_refused():
    class PerHeadLinears(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.ModuleList(nn.Linear(16, 4) for _ in range(2))
            self.k = nn.ModuleList(nn.Linear(16, 4) for _ in range(2))
            self.v = nn.ModuleList(nn.Linear(16, 4) for _ in range(2))

        def forward(self, x):
            q, k, v = (torch.stack([m(x) for m in ms], dim=1) for ms in (self.q, self.k, self.v))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v).flatten(1)

    with pytest.raises(
        LayoutError,
        match=r"^cannot resolve the attention in PerHeadLinears: its query heads live in several tensors \(q.0.weight, q.1.weight\)",
    ):
        surgeon.reinit_(PerHeadLinears())


def test_no_attention_at_all():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(NoAttentionFoundError, match=r"^no attention found in Sequential: looked at 4 parameters"):
        surgeon.inspect(mlp)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_through_the_forward_route(dtype):
    """A custom module in half precision: probed in float32 (restored exactly), rewritten in its dtype."""
    torch.manual_seed(0)
    reference = randomize_biases(Stack(lambda: LucidAttention(24), 24)).eval()
    model = randomize_biases(Stack(lambda: LucidAttention(24), 24)).to(dtype).train()
    state = snapshot(model)
    surgeon.reinit_(reference, layers="0", seed=1)
    report = surgeon.reinit_(model, layers="0", seed=1)
    assert model.training
    edited = {r.block.projection(r.role).weight.tensor for r in report.rows} | {
        r.block.projection(r.role).bias.tensor for r in report.rows
    }
    ref = reference.state_dict()
    for n, t in model.state_dict().items():
        assert t.dtype == dtype
        assert torch.equal(t, ref[n].to(dtype)) if n in edited else torch.equal(t, state[n]), n
    assert_conditioned(observe(model.float().layers[0]["attn"], 24), atol=2e-2)


def test_inspect_changes_nothing_and_reports_real_condition_numbers():
    torch.manual_seed(0)
    model = randomize_biases(Stack(lambda: InterleavedQKV(32, heads=4), 32)).train()
    state = snapshot(model)
    report = surgeon.inspect(model, full=True)
    assert model.training and all(m.training for m in model.modules())
    assert_only_changed(model, state, [])
    assert len(report.rows) == 6
    for row in report.rows:
        layer = model.layers[row.block.layer]["attn"]
        w = layer.qkv.weight.detach().double().view(4, 3, 8, 32)[:, "qkv".index(row.role)]  # (H, d, D)
        kappas = [float(s[0] / s[-1]) for s in torch.linalg.svdvals(w)]
        assert row.before.head_kappas == pytest.approx(kappas, rel=1e-9)
        whole = torch.linalg.svdvals(w.reshape(32, 32))
        assert row.before.kappa == pytest.approx(float(whole[0] / whole[-1]), rel=1e-6)


def test_softmax_products_without_projections_are_not_attention():
    class Smoother(nn.Module):
        """Token mixing by softmax(X Xᵀ) X: no parameter involved, so no attention block to re-initialize."""

        def forward(self, x):
            return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.smooth, self.attn, self.out = Smoother(), LucidAttention(24), nn.Linear(24, 24)

        def forward(self, x):
            return self.out(self.attn(self.smooth(x)))

    report = surgeon.inspect(Net())
    assert [b.module for b in report.blocks] == ["attn"]


def test_hugging_face_model_inside_a_custom_model():
    """Names route for the transformers part, forward route for the custom part, one report."""
    from helpers.tiny import tiny_bert

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = tiny_bert()
            self.pool = TimmAttentionPool()

        def forward(self, input_ids):
            return self.pool(self.encoder(input_ids=input_ids).last_hidden_state)

    class TimmAttentionPool(nn.Module):
        def __init__(self):
            super().__init__()
            from helpers.modules import TimmAttention

            self.attn = TimmAttention(48, 4, qkv_bias=True)

        def forward(self, x):
            return self.attn(x)[:, 0]

    model = Classifier().eval()
    before = observe(model.pool.attn, 48)
    report = surgeon.reinit_(model, seed=3)
    assert [(b.module, b.layout) for b in report.blocks] == [
        ("encoder.encoder.layer.0.attention.self", "separate"),
        ("encoder.encoder.layer.1.attention.self", "separate"),
        ("pool.attn", "forward: fused qkv"),
    ]
    assert [b.stack for b in report.blocks] == ["encoder.encoder.layer", "encoder.encoder.layer", "pool.attn"]
    got = observe(model.pool.attn, 48)
    assert_conditioned(got)
    assert not torch.allclose(got.q, before.q)
    assert model(torch.randint(0, 96, (2, 7))).shape == (2, 48)


def test_hugging_face_layout_the_config_does_not_settle_is_read_from_the_forward():
    """A GPT-NeoX whose config names an unknown model_type (a fork, remote code): the names cannot tell
    interleaved from blocked rows, so the forward decides, and the report says so."""
    import transformers

    from helpers.families import FAMILIES
    from helpers.observe import observe as observe_hf

    class ForkConfig(transformers.GPTNeoXConfig):  # what a remote-code copy of GPT-NeoX looks like
        model_type = "my_neox_fork"

    model = FAMILIES["gpt_neox"].make()
    model.config.__class__ = ForkConfig
    for sub in model.modules():  # every module shares the one config object
        assert getattr(sub, "config", model.config) is model.config
    report = surgeon.reinit_(model, layers="0", seed=2)
    assert [b.q.weight.offsets for b in report.blocks] == [(0, 36, 72, 108)] * 2  # interleaved (H, 3, d)
    assert any("do not settle the layout, so it was read from the forward" in n for n in report.notes)
    maps = observe_hf(model)["gpt_neox.layers.0.attention"]
    for w in (maps.q, maps.k):
        for h in w:
            assert torch.allclose(h @ h.T, torch.eye(h.shape[0]), atol=1e-4)
