"""Checkpoints from libraries beyond transformers (issue 18), judged through each library's own forward.

diffusers and x-transformers are the real libraries; timm, torchvision and nanoGPT layouts are the
re-implementations in tests/helpers/libraries.py (each names the source file it follows).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from surgeon import reinit_
from surgeon.api import inspect_checkpoint, reinit_checkpoint
from surgeon.errors import LayoutError, SelectionError

from helpers.libraries import (
    CoAtNet,
    Eva,
    MaxxVit,
    NanoGPT,
    OpenClip,
    Perceiver,
    Swin,
    TorchvisionSwin,
    TorchvisionViT,
    changed,
    save,
)
from helpers.modules import observe, observe_mha, randomize_biases


def orthonormal_rows(w, atol=1e-5):
    """Each head's (d, in) map has orthonormal rows: the conditioned reset of a query/key head."""
    gram = w.double() @ w.double().transpose(-1, -2)
    return torch.allclose(gram, torch.eye(w.shape[-2], dtype=torch.float64).expand_as(gram), atol=atol)


# --------------------------------------------------------------------------- torchvision ViT


def test_torchvision_vit_layers_are_one_stack_numbered_by_the_model(tmp_path):
    torch.manual_seed(0)
    model = randomize_biases(TorchvisionViT(num_layers=3, num_heads=4, hidden_dim=32))
    src = save(model, tmp_path / "src")
    found = inspect_checkpoint(src, num_heads=4)
    assert [(b.stack, b.layer) for b in found.blocks] == [("encoder.layers", i) for i in range(3)]
    before = load_file(src / "model.safetensors")
    reinit_checkpoint(src, output=tmp_path / "out", num_heads=4, layers="-1")
    after = load_file(tmp_path / "out" / "model.safetensors")
    layer = "encoder.layers.encoder_layer_2.self_attention"
    assert changed(before, after) == {f"{layer}.in_proj_weight", f"{layer}.in_proj_bias"}
    model.load_state_dict(after)
    maps = observe_mha(model.encoder.layers.encoder_layer_2.self_attention)
    assert orthonormal_rows(maps.q) and orthonormal_rows(maps.k)
    assert torch.allclose(maps.v.reshape(32, 32).float(), torch.eye(32), atol=1e-5)
    reinit_checkpoint(src, output=tmp_path / "one", num_heads=4, layers="1")  # layer 1 exists: no "out of range"


def test_torchvision_vit_pth_reads_as_its_safetensors(tmp_path):
    """torchvision's own .pth (``encoder.layers.encoder_layer_N...``, 1-D LayerNorm weights beside 2-D
    projections) is one tensor per layer, as its .safetensors is: ``layers.`` followed by a word is not a
    stack of layers (only Megatron-Core's TransformerLayer parts after ``layers.`` are)."""
    torch.manual_seed(0)
    model = randomize_biases(TorchvisionViT(num_layers=3, num_heads=4, hidden_dim=32))
    src = save(model, tmp_path / "st")
    pth = tmp_path / "vit_b_16.pth"
    torch.save(model.state_dict(), pth)
    blocks = [(b.stack, b.layer, b.q.weight.tensor) for b in inspect_checkpoint(src, num_heads=4).blocks]
    assert [(b.stack, b.layer, b.q.weight.tensor) for b in inspect_checkpoint(pth, num_heads=4).blocks] == blocks
    assert len(blocks) == 3
    reinit_checkpoint(pth, output=tmp_path / "out.pth", num_heads=4, layers="-1")
    after = torch.load(tmp_path / "out.pth", weights_only=True)
    layer = "encoder.layers.encoder_layer_2.self_attention"
    assert changed(model.state_dict(), after) == {f"{layer}.in_proj_weight", f"{layer}.in_proj_bias"}
    model.load_state_dict(after)
    maps = observe_mha(model.encoder.layers.encoder_layer_2.self_attention)
    assert orthonormal_rows(maps.q) and orthonormal_rows(maps.k)


# --------------------------------------------------------------------------- timm MaxViT


@pytest.mark.parametrize(
    ("head_first", "architecture"), [(True, "maxvit_rmlp_pico_rw_256"), (False, "maxvit_tiny_tf_224.in1k")]
)
def test_maxvit_fused_qkv_packing_follows_the_architecture(tmp_path, head_first, architecture):
    torch.manual_seed(0)
    model = MaxxVit(head_first=head_first)
    config = {"architecture": architecture, "model_args": {"transformer_dim_head": 8}}
    src = save(model, tmp_path / "src", config)
    stages = [s.blocks[0].attn_grid.attn for s in model.stages]
    old = [observe(a, a.qkv.in_features) for a in stages]
    reinit_checkpoint(src, output=tmp_path / "out", heads="0")
    after = load_file(tmp_path / "out" / "model.safetensors")
    model.load_state_dict(after)
    for attn, was in zip(stages, old):
        now = observe(attn, attn.qkv.in_features)
        assert orthonormal_rows(now.q[:1]) and orthonormal_rows(now.k[:1])  # head 0: reset
        d, width = now.v.shape[1], now.v.shape[2]
        assert torch.allclose(now.v[0].float(), torch.eye(d, width), atol=1e-5)  # value head 0: its identity block
        for role in ("q", "k", "v"):  # every other head: untouched
            assert torch.allclose(getattr(now, role)[1:], getattr(was, role)[1:], atol=1e-5), role
        assert torch.allclose(now.q_bias[0].float(), torch.zeros(d), atol=1e-6)
    # the module route (the forward probe) writes the same bytes
    live = MaxxVit(head_first=head_first)
    live.load_state_dict(load_file(src / "model.safetensors"))
    reinit_(live, heads="0")
    assert not changed(after, live.state_dict())


def test_maxvit_without_its_architecture_is_refused_naming_the_hint(tmp_path):
    src = save(MaxxVit(), tmp_path / "src")
    with pytest.raises(LayoutError, match=r"per head.*config=PATH"):
        inspect_checkpoint(src, head_dim=8)
    with pytest.raises(LayoutError, match=r"per head.*config=PATH"):
        inspect_checkpoint(src, num_heads=2)


# --------------------------------------------------------------------------- x-transformers GQA


def xt_decoder(**kw):
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=20, max_seq_len=16, attn_layers=Decoder(dim=32, depth=1, heads=4, attn_dim_head=8, **kw)
    )


def test_x_transformers_gqa_maps_query_head_h_to_kv_head_h_mod_kv(tmp_path):
    model = xt_decoder(attn_kv_heads=2)
    src = save(model, tmp_path / "src")
    found = inspect_checkpoint(src, num_heads=4, num_kv_heads=2)
    block = found.blocks[0]
    assert [block.kv_head(h) for h in range(4)] == [0, 1, 0, 1]
    with pytest.raises(SelectionError, match="serves query heads 0,2"):
        reinit_checkpoint(src, output=tmp_path / "bad", num_heads=4, num_kv_heads=2, heads="0-1")
    attn = model.attn_layers.layers[0][1]
    was = observe(attn, 32)
    reinit_checkpoint(src, output=tmp_path / "out", num_heads=4, num_kv_heads=2, heads="0,2")
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    now = observe(attn, 32)  # k and v as the attention product sees them: repeated to one per query head
    for h in (0, 2):
        assert orthonormal_rows(now.q[h : h + 1]) and orthonormal_rows(now.k[h : h + 1])
        assert torch.allclose(now.v[h].float(), torch.eye(8, 32), atol=1e-5)
    for h in (1, 3):
        for role in ("q", "k", "v"):
            assert torch.allclose(getattr(now, role)[h], getattr(was, role)[h], atol=1e-5), (role, h)
    # the module route reads the same mapping from the forward and writes the same bytes
    live = xt_decoder(attn_kv_heads=2)
    reinit_(live, heads="0,2", example_inputs=torch.randint(0, 20, (1, 6)))
    assert not changed(load_file(tmp_path / "out" / "model.safetensors"), live.state_dict())


# --------------------------------------------------------------------------- timm EVA (fused)


def test_eva_fused_qkv_zeroes_its_separate_q_and_v_biases(tmp_path):
    torch.manual_seed(0)
    model = Eva(dim=32, depth=2, num_heads=4)
    src = save(model, tmp_path / "src")
    reinit_checkpoint(src, output=tmp_path / "out", num_heads=4, heads="1", layers="0")
    after = load_file(tmp_path / "out" / "model.safetensors")
    model.load_state_dict(after)
    now = observe(model.blocks[0]["attn"], 32)
    for role in ("q", "v"):
        bias = getattr(now, f"{role}_bias")
        assert torch.allclose(bias[1].float(), torch.zeros(8), atol=1e-6) and bias[0].abs().sum() > 0.1
    before = load_file(src / "model.safetensors")
    assert changed(before, after) == {f"blocks.0.attn.{t}" for t in ("qkv.weight", "q_bias", "v_bias")}
    live = Eva(dim=32, depth=2, num_heads=4)
    live.load_state_dict(before)
    reinit_(live, heads="1", layers="0", example_inputs=torch.randn(1, 5, 32))  # the module route: the same bytes
    assert not changed(after, live.state_dict())


# --------------------------------------------------------------------------- nanoGPT ckpt.pt


def test_nanogpt_ckpt_pt_is_rewritten_in_its_container_with_heads_from_model_args(tmp_path):
    torch.manual_seed(0)
    model = NanoGPT(n_layer=2, n_head=4, n_embd=32)
    model_args = {
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 32,
        "block_size": 16,
        "bias": True,
        "vocab_size": 40,
        "dropout": 0.0,
    }
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "model_args": model_args,
        "iter_num": 7,
        "best_val_loss": torch.tensor(2.5),
        "config": {"dataset": "shakespeare_char"},
    }
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    found = inspect_checkpoint(tmp_path / "run" / "ckpt.pt")
    assert [(b.stack, b.layer, b.heads) for b in found.blocks] == [("transformer.h", 0, 4), ("transformer.h", 1, 4)]
    reinit_checkpoint(tmp_path / "run" / "ckpt.pt", output=tmp_path / "out.pt", layers="1")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert (
        set(out) == set(ckpt)
        and out["iter_num"] == 7
        and out["model_args"] == model_args
        and torch.equal(out["best_val_loss"], ckpt["best_val_loss"])
    )
    assert changed(ckpt["model"], out["model"]) == {
        "transformer.h.1.attn.c_attn.weight",
        "transformer.h.1.attn.c_attn.bias",
    }
    model.load_state_dict(out["model"])
    now = observe(model.transformer["h"][1]["attn"], 32)
    assert (
        orthonormal_rows(now.q)
        and orthonormal_rows(now.k)
        and torch.allclose(now.v.reshape(32, 32).float(), torch.eye(32), atol=1e-5)
    )


def test_ddp_prefixed_lightning_checkpoint_keeps_its_other_entries(tmp_path):
    torch.manual_seed(0)
    model = NanoGPT(n_layer=1, n_head=4, n_embd=32)
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    ckpt = {"state_dict": state, "hyper_parameters": {"n_head": 4, "n_embd": 32}, "epoch": 3, "global_step": 30}
    torch.save(ckpt, tmp_path / "last.ckpt")
    found = inspect_checkpoint(tmp_path / "last.ckpt")
    assert [(b.stack, b.heads) for b in found.blocks] == [("module.transformer.h", 4)]
    reinit_checkpoint(tmp_path / "last.ckpt", output=tmp_path / "out.ckpt")
    out = torch.load(tmp_path / "out.ckpt", weights_only=True)
    assert out["epoch"] == 3 and out["hyper_parameters"] == ckpt["hyper_parameters"]
    assert changed(state, out["state_dict"]) == {
        "module.transformer.h.0.attn.c_attn.weight",
        "module.transformer.h.0.attn.c_attn.bias",
    }


# --------------------------------------------------------------------------- x-transformers encoder-decoder


def test_x_transformers_cross_layers_are_cross_attention_by_their_place(tmp_path):
    from x_transformers import XTransformer

    torch.manual_seed(0)
    model = XTransformer(
        dim=32,
        enc_num_tokens=20,
        enc_depth=1,
        enc_heads=4,
        enc_max_seq_len=16,
        dec_num_tokens=20,
        dec_depth=2,
        dec_heads=4,
        dec_max_seq_len=16,
    )
    src = save(model, tmp_path / "src")
    found = inspect_checkpoint(src, num_heads=4)
    types = {
        "decoder.net.attn_layers.layers": model.decoder.net.attn_layers.layer_types,
        "encoder.attn_layers.layers": model.encoder.attn_layers.layer_types,
    }
    truth = {b.module: "cross" if types[b.stack][int(b.module.split(".")[-2])] == "c" else "self" for b in found.blocks}
    assert {b.module: b.kind for b in found.blocks} == truth and "cross" in truth.values()
    reinit_checkpoint(src, output=tmp_path / "out", num_heads=4, attention="self")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert {n.rsplit(".", 2)[0] for n in changed(before, after)} == {m for m, k in truth.items() if k == "self"}


# --------------------------------------------------------------------------- lucidrains to_q + to_kv


def test_lucidrains_to_q_and_fused_to_kv(tmp_path):
    torch.manual_seed(0)
    model = Perceiver(latent_dim=32, input_dim=24)
    src = save(model, tmp_path / "src")
    found = inspect_checkpoint(src, head_dim=8)
    assert {(b.module, b.kind, b.heads) for b in found.blocks} == {
        ("cross_attend_blocks.0.fn", "cross", 4),
        ("layers.0.0.fn", "self", 4),
        ("layers.1.0.fn", "self", 4),
    }
    attn = model.layers[1][0]["fn"]
    was = observe(attn, 32)
    reinit_checkpoint(src, output=tmp_path / "out", head_dim=8, stack="layers", layers="1", heads="2")
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    now = observe(attn, 32)
    assert orthonormal_rows(now.q[2:3]) and orthonormal_rows(now.k[2:3])
    assert torch.allclose(
        now.v[2].float(), torch.eye(32)[16:24], atol=1e-5
    )  # block identity: head 2 reads features 16-23
    for role in ("q", "k", "v"):
        keep = [0, 1, 3]
        assert torch.allclose(getattr(now, role)[keep], getattr(was, role)[keep], atol=1e-5), role
    cross = model.cross_attend_blocks[0]["fn"]
    now_cross = observe(cross, 32, context_width=24)
    assert now_cross.k.shape == (4, 8, 24)  # untouched and read from the inputs' width


# --------------------------------------------------------------------------- heads from the libraries' configs

OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 8, "layers": 2, "width": 32, "head_width": 8, "patch_size": 4},
    "text_cfg": {"context_length": 6, "vocab_size": 20, "width": 24, "heads": 2, "layers": 2},
}


def test_open_clip_config_gives_each_tower_its_heads(tmp_path):
    torch.manual_seed(0)
    model = randomize_biases(OpenClip(OPEN_CLIP))
    src = save(model, tmp_path / "src")
    (tmp_path / "ViT-tiny.json").write_text(json.dumps(OPEN_CLIP))
    found = inspect_checkpoint(src, config=tmp_path / "ViT-tiny.json")
    assert {(b.stack, b.heads, b.head_dim) for b in found.blocks} == {
        ("visual.transformer.resblocks", 4, 8),
        ("transformer.resblocks", 2, 12),
    }
    reinit_checkpoint(src, output=tmp_path / "out", config=tmp_path / "ViT-tiny.json", heads="0")
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    for tower, d in ((model.transformer, 12), (model.visual.transformer, 8)):
        maps = observe_mha(tower.resblocks[1].attn)
        assert maps.q.shape[1] == d  # the library's own head split
        assert (
            orthonormal_rows(maps.q[:1])
            and orthonormal_rows(maps.k[:1])
            and not orthonormal_rows(maps.q[1:2], atol=1e-2)
        )


def test_timm_swin_heads_per_stage_from_model_args(tmp_path):
    torch.manual_seed(0)
    model = randomize_biases(Swin(embed_dim=16, depths=(1, 2), num_heads=(2, 4)))
    config = {
        "architecture": "swin_tiny_patch4_window7_224",
        "model_args": {"embed_dim": 16, "depths": [1, 2], "num_heads": [2, 4]},
    }
    src = save(model, tmp_path / "src", config)
    found = inspect_checkpoint(src)
    assert [(b.layer, b.heads, b.head_dim) for b in found.blocks] == [(0, 2, 8), (1, 4, 8), (2, 4, 8)]
    reinit_checkpoint(src, output=tmp_path / "out", heads="1")
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    for stage, width in ((model.layers[0], 16), (model.layers[1], 32)):
        maps = observe(stage.blocks[0]["attn"], width)
        assert (
            orthonormal_rows(maps.q[1:2])
            and orthonormal_rows(maps.k[1:2])
            and not orthonormal_rows(maps.q[:1], atol=1e-2)
        )
        assert torch.allclose(maps.q_bias[1].float(), torch.zeros(8), atol=1e-6)


def test_head_dim_alone_settles_the_heads(tmp_path):
    torch.manual_seed(0)
    src = save(Swin(embed_dim=16, depths=(1, 1), num_heads=(2, 4)), tmp_path / "src")
    found = inspect_checkpoint(src, head_dim=8)
    assert [b.heads for b in found.blocks] == [2, 4]


def test_open_clip_hub_folder_reads_its_open_clip_config(tmp_path):
    torch.manual_seed(0)
    src = save(OpenClip(OPEN_CLIP), tmp_path / "src")
    (src / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": OPEN_CLIP, "preprocess_cfg": {"mean": [0.5] * 3}})
    )
    found = inspect_checkpoint(src)
    assert {(b.stack, b.heads) for b in found.blocks} == {
        ("visual.transformer.resblocks", 4),
        ("transformer.resblocks", 2),
    }


def test_coatnet_1x1_conv_qkv_per_head_from_the_architecture(tmp_path):
    torch.manual_seed(0)
    model = CoAtNet(dim=32, depth=2)
    with pytest.raises(LayoutError, match="1x1-convolution.*config=PATH"):
        inspect_checkpoint(save(model, tmp_path / "bare"), head_dim=8)
    config = {"architecture": "coatnet_0_rw_224", "model_args": {"transformer_dim_head": 8}}
    src = save(model, tmp_path / "src", config)
    attn = model.stages[0].blocks[1]["attn"]

    def call(a, x):  # the probe's tokens as an NCHW image of one column
        a(x.transpose(1, 2).unsqueeze(-1))

    was = observe(attn, 32, call=call)
    reinit_checkpoint(src, output=tmp_path / "out", heads="2", layers="1")
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    now = observe(attn, 32, call=call)
    assert orthonormal_rows(now.q[2:3]) and orthonormal_rows(now.k[2:3])
    assert torch.allclose(now.v[2].float(), torch.eye(32)[16:24], atol=1e-5)
    for role in ("q", "k", "v"):
        assert torch.allclose(getattr(now, role)[[0, 1, 3]], getattr(was, role)[[0, 1, 3]], atol=1e-5), role


def test_torchvision_swin_heads_per_stage_from_the_head_size(tmp_path):
    torch.manual_seed(0)
    model = randomize_biases(TorchvisionSwin(embed_dim=16, depths=(1, 2), num_heads=(2, 4)))
    src = save(model, tmp_path / "src")
    found = inspect_checkpoint(src, head_dim=8)
    assert [(b.stack, b.layer, b.heads) for b in found.blocks] == [
        ("features", 0, 2),
        ("features", 1, 4),
        ("features", 2, 4),
    ]
    reinit_checkpoint(src, output=tmp_path / "out", head_dim=8, heads="3", layers="2")
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    maps = observe(model.features[3][1]["attn"], 32)
    assert (
        orthonormal_rows(maps.q[3:4]) and orthonormal_rows(maps.k[3:4]) and not orthonormal_rows(maps.q[:1], atol=1e-2)
    )
