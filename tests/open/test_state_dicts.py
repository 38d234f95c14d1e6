"""Plain PyTorch state dicts (no config.json): nn.Transformer*, nn.MultiheadAttention, timm-style ViT.

Effects are checked through each module's own forward: the q, k, v it hands to
scaled_dot_product_attention are captured, and the per-head maps solved from a known probe input.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from surgeon import reinit_checkpoint
from surgeon.api import inspect_checkpoint

from helpers.modules import KernelCapture as CaptureSDPA


def solve_heads(x, states):
    """Per-head maps W (H, d, D) and biases (H, d) with states[b, h, n] = W[h] @ x[b, n] + bias[h]."""
    B, H, N, d = states.shape
    X = torch.cat([x.reshape(B * N, -1), torch.ones(B * N, 1)], dim=1).double()
    Y = states.permute(0, 2, 1, 3).reshape(B * N, H * d).double()
    sol = torch.linalg.lstsq(X, Y).solution  # (D + 1, H*d)
    W = sol[:-1].T.reshape(H, d, -1)
    return W, sol[-1].reshape(H, d)


def observe_mha(mha: nn.MultiheadAttention, q_width: int, kv_width: int):
    torch.manual_seed(123)
    xq, xkv = torch.randn(2, 3 * q_width, q_width), torch.randn(2, 3 * q_width, kv_width)
    mode = CaptureSDPA()
    with torch.enable_grad(), mode:  # grad on: keeps nn.MultiheadAttention off its fused fast path
        mha(xq, xkv, xkv, need_weights=False)
    ((q, k, v),) = mode.calls
    return solve_heads(xq, q), solve_heads(xkv, k), solve_heads(xkv, v)


def conditioned(q, k, v, atol=1e-4):
    for W in (q[0], k[0]):
        gram = W @ W.transpose(1, 2)
        assert torch.allclose(gram, torch.eye(W.shape[1], dtype=gram.dtype).expand_as(gram), atol=atol)
    H, d, D = v[0].shape
    eye = torch.eye(H * d, D, dtype=v[0].dtype).reshape(H, d, D)
    assert torch.allclose(v[0], eye, atol=atol)
    for _, b in (q, k, v):
        assert torch.allclose(b, torch.zeros_like(b), atol=1e-5)


def same(a, b):
    for (wa, ba), (wb, bb) in zip(a, b):
        assert torch.allclose(wa, wb, atol=1e-6) and torch.allclose(ba, bb, atol=1e-6)


def test_transformer_encoder_and_decoder(tmp_path):
    torch.manual_seed(0)
    model = nn.Transformer(
        d_model=32,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=48,
        batch_first=True,
        dropout=0.0,
    )
    for name, p in model.named_parameters():
        if name.endswith("in_proj_bias"):
            nn.init.normal_(p, std=0.1)  # make bias handling visible
    torch.save(model.state_dict(), tmp_path / "transformer.pt")
    report = inspect_checkpoint(tmp_path / "transformer.pt", num_heads=4)
    assert [(b.stack, b.layer, b.kind, b.layout) for b in report.blocks] == [
        ("encoder.layers", 0, "self", "fused in_proj"),
        ("encoder.layers", 1, "self", "fused in_proj"),
        ("decoder.layers", 0, "self", "fused in_proj"),
        ("decoder.layers", 0, "cross", "fused in_proj"),
        ("decoder.layers", 1, "self", "fused in_proj"),
        ("decoder.layers", 1, "cross", "fused in_proj"),
    ]
    reinit_checkpoint(tmp_path / "transformer.pt", output=tmp_path / "out.pt", num_heads=4, layers="1", seed=3)
    after = nn.Transformer(
        d_model=32,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=48,
        batch_first=True,
        dropout=0.0,
    )
    after.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    modules = {
        "encoder.layers.0.self_attn": False,
        "encoder.layers.1.self_attn": True,
        "decoder.layers.0.self_attn": False,
        "decoder.layers.0.multihead_attn": False,
        "decoder.layers.1.self_attn": True,
        "decoder.layers.1.multihead_attn": True,
    }
    for name, changed in modules.items():
        new = observe_mha(after.get_submodule(name), 32, 32)
        if changed:
            conditioned(*new)
        else:
            same(new, observe_mha(model.get_submodule(name), 32, 32))


def test_multihead_attention_with_kdim_vdim(tmp_path):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(embed_dim=32, num_heads=4, kdim=16, vdim=16, batch_first=True)
    nn.init.normal_(mha.in_proj_bias, std=0.1)
    torch.save(mha.state_dict(), tmp_path / "mha.pt")
    (block,) = inspect_checkpoint(tmp_path / "mha.pt", num_heads=4).blocks
    assert (block.layout, block.heads, block.head_dim, block.k.in_features) == ("separate in_proj", 4, 8, 16)
    reinit_checkpoint(tmp_path / "mha.pt", output=tmp_path / "out.pt", num_heads=4)
    new = nn.MultiheadAttention(embed_dim=32, num_heads=4, kdim=16, vdim=16, batch_first=True)
    new.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    q, k, v = observe_mha(new, 32, 16)
    conditioned(q, k, (v[0][:2], v[1][:2]))  # heads 0-1 read input features 0-15 ...
    assert torch.allclose(v[0][2:], v[0][:2], atol=1e-12)  # ... heads 2-3 tile the 16-wide value input


class TimmStyleAttention(nn.Module):
    """timm's ``Attention`` forward, written out here because timm cannot be imported on this machine
    (its torchvision dependency has no CPU wheel beside torch 2.13): one fused ``qkv`` Linear whose
    output is viewed (B, N, 3, H, d), then scaled_dot_product_attention."""

    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class TimmStyleViT(nn.Module):
    def __init__(self, dim=48, heads=6, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm1": nn.LayerNorm(dim), "attn": TimmStyleAttention(dim, heads)}) for _ in range(depth)
        )


def observe_timm(attn, dim):
    torch.manual_seed(5)
    x = torch.randn(2, 3 * dim, dim)
    mode = CaptureSDPA()
    with torch.no_grad(), mode:
        attn(x)
    ((q, k, v),) = mode.calls
    return solve_heads(x, q), solve_heads(x, k), solve_heads(x, v)


@pytest.mark.parametrize("config", [True, False], ids=["config", "num-heads"])
def test_timm_style_vit(tmp_path, config):
    import json

    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = TimmStyleViT()
    for blk in model.blocks:
        nn.init.normal_(blk["attn"].qkv.bias, std=0.1)
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    kwargs = {"num_heads": 6}
    if config:
        (tmp_path / "config.json").write_text(json.dumps({"architecture": "vit_tiny", "num_heads": 6, "embed_dim": 48}))
        kwargs = {}
    reinit_checkpoint(tmp_path / "model.safetensors", output=tmp_path / "out.safetensors", layers="0,2", **kwargs)
    new = TimmStyleViT()
    new.load_state_dict(load_file(tmp_path / "out.safetensors"))
    for i in range(3):
        got = observe_timm(new.blocks[i]["attn"], 48)
        if i in (0, 2):
            conditioned(*got)
        else:
            same(got, observe_timm(model.blocks[i]["attn"], 48))


def test_conventional_fused_layout_is_reported(tmp_path):
    from safetensors.torch import save_file

    save_file(TimmStyleViT().state_dict(), tmp_path / "model.safetensors")
    report = inspect_checkpoint(tmp_path / "model.safetensors", num_heads=6)
    assert any("read as blocked [Q | K | V] (the timm/nanoGPT convention" in n for n in report.notes)
    assert "note: qkv tensors are read as blocked" in report.render()
