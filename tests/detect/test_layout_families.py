"""Families whose fused layout depends on model_type or config flags, and multi-tower configs.

Each is checked against the model's own forward with --verify-layout's machinery (the forward probe
of surgeon.detect.module, independent of name-based detection), then re-initialized end to end.
"""

from __future__ import annotations

import pytest
import torch

from surgeon import reinit_checkpoint
from surgeon.api import inspect_checkpoint
from surgeon.audit.layout import verify_layout

pytestmark = pytest.mark.usefixtures("one_thread")


def build(name):
    import transformers as tf

    torch.manual_seed(0)
    if name == "codegen":  # qkv_proj packs 4 chunks of [Q | V | K]
        return tf.CodeGenForCausalLM(
            tf.CodeGenConfig(vocab_size=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=32)
        )
    if name == "gpt_bigcode_mha":  # c_attn viewed (heads, 3 * d) when multi_query is off
        return tf.GPTBigCodeForCausalLM(
            tf.GPTBigCodeConfig(vocab_size=64, n_embd=64, n_layer=2, n_head=4, multi_query=False, n_positions=32)
        )
    if name == "bert2bert":  # the decoder's path contains "encoder" (decoder.bert.encoder.layer)
        enc = tf.BertConfig(
            vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
        dec = tf.BertConfig(
            vocab_size=64,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            is_decoder=True,
            add_cross_attention=True,
        )
        return tf.EncoderDecoderModel(config=tf.EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec))
    if name == "clip":  # two towers, each with its own nested config
        text, vision = _towers()
        return tf.CLIPModel(tf.CLIPConfig(text_config=dict(text, eos_token_id=2), vision_config=vision))
    if name == "siglip":  # an attention pooling head outside any numbered layer list
        text, vision = _towers()
        return tf.SiglipModel(tf.SiglipConfig(text_config=text, vision_config=vision))
    raise KeyError(name)


def _towers() -> tuple[dict, dict]:
    """A tiny text tower and vision tower config of different widths and head counts (CLIP, SigLIP)."""
    text = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=16,
    )
    vision = dict(
        hidden_size=48, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=8
    )
    return text, vision


# (SigLIP's forward cannot be probed by --verify-layout yet: its pooling head is checked below.)
@pytest.mark.parametrize("name", ["codegen", "gpt_bigcode_mha", "bert2bert", "clip"])
def test_layout_agrees_with_the_forward_and_reinit_conditions_it(name, tmp_path):
    src = tmp_path / name
    build(name).save_pretrained(src)
    check = verify_layout(src)
    assert "layout verified" in check.summary()
    report = reinit_checkpoint(src, output=tmp_path / "out")
    assert report.rows and all(r.after.head_max < 1 + 1e-5 for r in report.rows)
    assert verify_layout(tmp_path / "out").blocks == check.blocks


def test_each_tower_gets_its_own_head_count(tmp_path):
    src = tmp_path / "b2b"
    build("bert2bert").save_pretrained(src)
    heads = {(b.stack, b.kind): b.heads for b in inspect_checkpoint(src).blocks}
    assert heads == {
        ("encoder.encoder.layer", "self"): 4,
        ("decoder.bert.encoder.layer", "self"): 2,
        ("decoder.bert.encoder.layer", "cross"): 2,
    }


def test_siglip_pooling_head_is_its_own_stack(tmp_path):
    src = tmp_path / "siglip"
    build("siglip").save_pretrained(src)
    blocks = inspect_checkpoint(src).blocks
    head = [b for b in blocks if b.module.endswith("head.attention")]
    assert [(b.stack, b.layer, b.heads) for b in head] == [("vision_model.head.attention", 0, 4)]
    report = reinit_checkpoint(src, output=tmp_path / "out", stack="vision_model.head.attention")
    assert {r.block.module for r in report.rows} == {"vision_model.head.attention"}


@pytest.mark.parametrize("ratio", [2, 8])  # 8 > 4 heads: ConvBERT then keeps one head
def test_convbert_head_ratio_gives_the_heads_its_attention_computes(ratio, tmp_path):
    """ConvBERT's attention computes num_attention_heads // head_ratio heads of hidden // num_attention_heads;
    judged by the model's own attention modules (their num_attention_heads and attention_head_size)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.ConvBertConfig(
        vocab_size=64,
        hidden_size=64,
        embedding_size=64,
        num_attention_heads=4,
        head_ratio=ratio,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    tf.ConvBertModel(cfg).save_pretrained(tmp_path / "in")
    reinit_checkpoint(tmp_path / "in", output=tmp_path / "out", layers="all")
    model = tf.ConvBertModel.from_pretrained(tmp_path / "out").eval()
    blocks = inspect_checkpoint(tmp_path / "in").blocks
    attentions = [layer.attention.self for layer in model.encoder.layer]
    assert [(b.heads, b.head_dim) for b in blocks] == [
        (a.num_attention_heads, a.attention_head_size) for a in attentions
    ]
    for a in attentions:  # every head the model splits off is semi-orthogonal (q, k) or the identity slice (v)
        h, d = a.num_attention_heads, a.attention_head_size
        for proj in (a.query, a.key):
            w = proj.weight.detach().double().reshape(h, d, -1)
            assert torch.allclose(w @ w.transpose(1, 2), torch.eye(d, dtype=torch.float64).expand(h, d, d), atol=1e-5)
        assert torch.equal(a.value.weight.detach(), torch.eye(h * d, cfg.hidden_size))
