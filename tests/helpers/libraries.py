"""Minimal re-implementations of layouts from libraries that cannot be installed beside CPU torch 2.13
(timm, torchvision and open_clip pull torch 2.14 with CUDA). Each follows the named source file: the
module tree (so the state-dict names are the library's), the parameter shapes and the forward's split
into heads, written with scaled_dot_product_attention so that observe of tests/helpers/modules.py sees q, k, v.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

# --------------------------------------------------------------- torchvision/models/vision_transformer.py


class TorchvisionEncoderBlock(nn.Module):
    """EncoderBlock: ln_1, self_attention (nn.MultiheadAttention, batch_first), ln_2, mlp."""

    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden_dim)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(hidden_dim)
        self.mlp = nn.Sequential(nn.Linear(hidden_dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, hidden_dim))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class TorchvisionEncoder(nn.Module):
    """Encoder: pos_embedding, layers = Sequential(OrderedDict(encoder_layer_{i}: EncoderBlock)), ln."""

    def __init__(self, seq_length=5, num_layers=3, num_heads=4, hidden_dim=32, mlp_dim=48):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i in range(num_layers):
            layers[f"encoder_layer_{i}"] = TorchvisionEncoderBlock(num_heads, hidden_dim, mlp_dim)
        self.layers = nn.Sequential(layers)
        self.ln = nn.LayerNorm(hidden_dim)

    def forward(self, x):
        return self.ln(self.layers(x + self.pos_embedding))


class TorchvisionViT(nn.Module):
    """VisionTransformer without its patchifier: class_token, encoder, heads.head."""

    def __init__(self, **kw):
        super().__init__()
        self.encoder = TorchvisionEncoder(**kw)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(kw.get("hidden_dim", 32), 3)))

    def forward(self, x):
        return self.heads(self.encoder(x)[:, 0])


# --------------------------------------------------------------- timm/models/maxxvit.py


class MaxxVitAttentionCl(nn.Module):
    """AttentionCl: qkv Linear(dim, 3 * dim_attn); head_first=True views it (B, N, H, 3 * d) and
    chunks q | k | v per head; head_first=False (the TensorFlow ports) reshapes (B, N, 3, H, d)."""

    def __init__(self, dim: int, dim_head: int = 8, head_first: bool = True):
        super().__init__()
        self.num_heads, self.dim_head, self.head_first = dim // dim_head, dim_head, head_first
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, restore = x.shape[0], x.shape[:-1]
        if self.head_first:
            q, k, v = self.qkv(x).view(B, -1, self.num_heads, self.dim_head * 3).transpose(1, 2).chunk(3, dim=3)
        else:
            q, k, v = self.qkv(x).reshape(B, -1, 3, self.num_heads, self.dim_head).transpose(1, 3).unbind(2)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(restore + (-1,)))


class MaxxVitPartitionAttention(nn.Module):
    """PartitionAttentionCl: norm1, attn (window partitioning left out: it does not touch the weights)."""

    def __init__(self, dim: int, head_first: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MaxxVitAttentionCl(dim, head_first=head_first)

    def forward(self, x):
        return x + self.attn(self.norm1(x))


class MaxxVitBlock(nn.Module):
    """MaxxVitBlock: conv (MBConv, here one Linear), attn_block, attn_grid."""

    def __init__(self, dim: int, head_first: bool):
        super().__init__()
        self.conv = nn.Linear(dim, dim)
        self.attn_block = MaxxVitPartitionAttention(dim, head_first)
        self.attn_grid = MaxxVitPartitionAttention(dim, head_first)

    def forward(self, x):
        return self.attn_grid(self.attn_block(self.conv(x)))


class MaxxVitStage(nn.Module):
    def __init__(self, dim_in: int, dim: int, depth: int, head_first: bool):
        super().__init__()
        self.down = nn.Linear(dim_in, dim)
        self.blocks = nn.Sequential(*[MaxxVitBlock(dim, head_first) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(self.down(x))


class MaxxVit(nn.Module):
    """stages.{i}.blocks.{j}.attn_block.attn.qkv: heads = width // dim_head, so they differ per stage."""

    def __init__(self, dims=(16, 32), depths=(1, 2), head_first=True):
        super().__init__()
        ins = (dims[0],) + tuple(dims[:-1])
        self.stages = nn.Sequential(*[MaxxVitStage(i, d, n, head_first) for i, d, n in zip(ins, dims, depths)])

    def forward(self, x):
        return self.stages(x)


# --------------------------------------------------------------- timm/models/eva.py


class EvaAttention(nn.Module):
    """EvaAttention with qkv_fused=True: qkv Linear without bias; q_bias and v_bias parameters, k_bias a
    zero buffer (not saved); the forward adds cat(q_bias, k_bias, v_bias) inside F.linear."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.randn(dim) * 0.1)
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.v_bias = nn.Parameter(torch.randn(dim) * 0.1)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class Eva(nn.Module):
    def __init__(self, dim=32, depth=2, num_heads=4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm1": nn.LayerNorm(dim), "attn": EvaAttention(dim, num_heads)}) for _ in range(depth)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block["attn"](block["norm1"](x))
        return x


# --------------------------------------------------------------- nanoGPT model.py


class NanoCausalSelfAttention(nn.Module):
    """CausalSelfAttention: c_attn Linear(n_embd, 3 n_embd) split q, k, v = [Q | K | V], c_proj."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoGPT(nn.Module):
    """GPT: transformer.wte, transformer.h.{i}.{ln_1, attn, ln_2, mlp}, lm_head."""

    def __init__(self, n_layer=2, n_head=4, n_embd=32, vocab_size=40):
        super().__init__()
        blocks = [
            nn.ModuleDict({"ln_1": nn.LayerNorm(n_embd), "attn": NanoCausalSelfAttention(n_embd, n_head)})
            for _ in range(n_layer)
        ]
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(vocab_size, n_embd), "h": nn.ModuleList(blocks)})
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx):
        x = self.transformer["wte"](idx)
        for block in self.transformer["h"]:
            x = x + block["attn"](block["ln_1"](x))
        return self.lm_head(x)


# --------------------------------------------------------------- vit-pytorch cross_vit.py / perceiver-pytorch


class LucidrainsAttention(nn.Module):
    """Attention(dim, heads, dim_head, context_dim): to_q Linear(dim, inner, bias=False), to_kv
    Linear(context_dim, 2 * inner, bias=False) chunked into k | v, to_out; context defaults to x."""

    def __init__(self, dim: int, heads: int = 4, dim_head: int = 8, context_dim: int | None = None):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(context_dim or dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x, context=None):
        context = x if context is None else context
        q, (k, v) = self.to_q(x), self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        return self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Perceiver(nn.Module):
    """perceiver-pytorch names: cross_attend_blocks.0.fn (latents read the inputs), layers.{i}.0.fn (latent self-attention)."""

    def __init__(self, latent_dim=32, input_dim=24, depth=2):
        super().__init__()
        self.cross_attend_blocks = nn.ModuleList(
            [nn.ModuleDict({"fn": LucidrainsAttention(latent_dim, context_dim=input_dim)})]
        )
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.ModuleDict({"fn": LucidrainsAttention(latent_dim)})]) for _ in range(depth)
        )


# --------------------------------------------------------------- open_clip/transformer.py, model.py


class OpenClipResidualAttentionBlock(nn.Module):
    """ResidualAttentionBlock: ln_1, attn (nn.MultiheadAttention, batch_first), ln_2, mlp (c_fc, gelu, c_proj)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(c_fc=nn.Linear(width, 2 * width), gelu=nn.GELU(), c_proj=nn.Linear(2 * width, width))
        )


class OpenClipTransformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        self.resblocks = nn.ModuleList(OpenClipResidualAttentionBlock(width, heads) for _ in range(layers))


class OpenClip(nn.Module):
    """CLIP: the vision tower under ``visual`` (heads = width // head_width), the text tower at the top
    level (``transformer``, ``token_embedding``, ``ln_final``: heads = text_cfg.heads)."""

    def __init__(self, cfg: dict):
        super().__init__()
        v, t = cfg["vision_cfg"], cfg["text_cfg"]
        self.visual = nn.Module()
        self.visual.conv1 = nn.Conv2d(3, v["width"], v["patch_size"], v["patch_size"], bias=False)
        self.visual.ln_pre = nn.LayerNorm(v["width"])
        self.visual.transformer = OpenClipTransformer(v["width"], v["layers"], v["width"] // v.get("head_width", 64))
        self.token_embedding = nn.Embedding(t["vocab_size"], t["width"])
        self.transformer = OpenClipTransformer(t["width"], t["layers"], t.get("heads", 8))
        self.ln_final = nn.LayerNorm(t["width"])


# --------------------------------------------------------------- timm/models/swin_transformer.py


class SwinWindowAttention(nn.Module):
    """WindowAttention: qkv Linear(dim, 3 dim) viewed (B, N, 3, heads, d) (blocked [Q | K | V])."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, -1))


class Swin(nn.Module):
    """layers.{stage}.blocks.{j}.attn.qkv, the width doubling and the heads changing per stage."""

    def __init__(self, embed_dim=16, depths=(1, 2), num_heads=(2, 4)):
        super().__init__()
        self.layers = nn.ModuleList()
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            stage = nn.Module()
            stage.blocks = nn.ModuleList(
                nn.ModuleDict(
                    {"norm1": nn.LayerNorm(embed_dim * 2**i), "attn": SwinWindowAttention(embed_dim * 2**i, heads)}
                )
                for _ in range(depth)
            )
            self.layers.append(stage)


# --------------------------------------------------------------- VITS / Piper TTS attentions.py


class VitsMultiHeadAttention(nn.Module):
    """MultiHeadAttention: conv_q/conv_k/conv_v/conv_o are Conv1d(channels, channels, 1); the channels
    are split as view(b, n_heads, k_channels, t).transpose(2, 3); matmul, softmax, matmul."""

    def __init__(self, channels: int, n_heads: int):
        super().__init__()
        self.n_heads, self.k_channels = n_heads, channels // n_heads
        self.conv_q, self.conv_k, self.conv_v, self.conv_o = (nn.Conv1d(channels, channels, 1) for _ in range(4))

    def forward(self, x, c):
        q, k, v = self.conv_q(x), self.conv_k(c), self.conv_v(c)
        b, d, t_s, t_t = (*k.size(), q.size(2))
        query = q.view(b, self.n_heads, self.k_channels, t_t).transpose(2, 3)
        key = k.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        value = v.view(b, self.n_heads, self.k_channels, t_s).transpose(2, 3)
        scores = torch.matmul(query / self.k_channels**0.5, key.transpose(-2, -1))
        out = torch.matmul(torch.softmax(scores, dim=-1), value)
        return self.conv_o(out.transpose(2, 3).contiguous().view(b, d, t_t))


class VitsEncoder(nn.Module):
    """Encoder: attn_layers.{i} (self-attention over (batch, channels, time)), norm_layers_1."""

    def __init__(self, channels=16, n_heads=2, n_layers=2):
        super().__init__()
        self.attn_layers = nn.ModuleList(VitsMultiHeadAttention(channels, n_heads) for _ in range(n_layers))

    def forward(self, x):
        for attn in self.attn_layers:
            x = x + attn(x, x)
        return x


class MaxxVitAttention2d(nn.Module):
    """maxxvit.py Attention2d (CoAtNet's transformer blocks): qkv Conv2d(dim, 3 dim, 1) on NCHW;
    head_first=True views it (B, H, 3 d, -1) and chunks q | k | v per head."""

    def __init__(self, dim: int, dim_head: int = 8):
        super().__init__()
        self.num_heads, self.dim_head = dim // dim_head, dim_head
        self.qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        q, k, v = self.qkv(x).view(B, self.num_heads, self.dim_head * 3, -1).chunk(3, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return self.proj(out.transpose(-1, -2).reshape(B, -1, H, W))


class CoAtNet(nn.Module):
    """stages.{i}.blocks.{j}.attn (TransformerBlock2d) for the transformer stages."""

    def __init__(self, dim=32, depth=2):
        super().__init__()
        stage = nn.Module()
        stage.blocks = nn.ModuleList(nn.ModuleDict({"attn": MaxxVitAttention2d(dim)}) for _ in range(depth))
        self.stages = nn.ModuleList([stage])


class TorchvisionSwin(nn.Module):
    """torchvision/models/swin_transformer.py: features = [patch embed, stage, PatchMerging, stage, ...];
    stage blocks at features.{1,3,5,7}.{j}.attn.qkv (blocked [Q | K | V]); head size 32 at full size."""

    def __init__(self, embed_dim=16, depths=(1, 2), num_heads=(2, 4)):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(3, embed_dim)]
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            dim = embed_dim * 2**i
            layers.append(
                nn.ModuleList(
                    nn.ModuleDict({"norm1": nn.LayerNorm(dim), "attn": SwinWindowAttention(dim, heads)})
                    for _ in range(depth)
                )
            )
            layers.append(nn.Linear(dim, 2 * dim))  # PatchMerging's reduction
        self.features = nn.Sequential(*layers)


# --------------------------------------------------------------- vit-pytorch cross_vit.py (CrossViT)


class CrossVitAttention(nn.Module):
    """Attention: norm, to_q Linear(dim, inner, bias=False), to_kv Linear(dim, 2 * inner, bias=False) chunked
    k | v, einsum products around a softmax; ``context`` (default: x) feeds to_kv, with x prepended when
    kv_include_self (the CLS token also attends to itself)."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head**-0.5
        self.norm = nn.LayerNorm(dim)
        self.attend = nn.Softmax(dim=-1)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(0.0))

    def forward(self, x, context=None, kv_include_self=False):
        x = self.norm(x)
        context = x if context is None else context
        if kv_include_self:
            context = torch.cat((x, context), dim=1)
        qkv = (self.to_q(x), *self.to_kv(context).chunk(2, dim=-1))
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in qkv)
        attn = self.attend(torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).flatten(2))


class CrossVitFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        return self.net(x)


class CrossVitTransformer(nn.Module):
    """Transformer: layers.{j} = [Attention, FeedForward], norm (one branch's self-attention)."""

    def __init__(self, dim: int, depth: int, heads: int, dim_head: int, mlp_dim: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([CrossVitAttention(dim, heads, dim_head), CrossVitFeedForward(dim, mlp_dim)])
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.norm(x)


class CrossVitProjectInOut(nn.Module):
    """ProjectInOut: project_in / project_out Linear where the two branches' widths differ, around fn."""

    def __init__(self, dim_in: int, dim_out: int, fn: nn.Module):
        super().__init__()
        self.fn = fn
        self.project_in = nn.Linear(dim_in, dim_out) if dim_in != dim_out else nn.Identity()
        self.project_out = nn.Linear(dim_out, dim_in) if dim_in != dim_out else nn.Identity()

    def forward(self, x, *args, **kwargs):
        return self.project_out(self.fn(self.project_in(x), *args, **kwargs))


class CrossVitCrossTransformer(nn.Module):
    """CrossTransformer: layers.{j} = [sm_attend_lg, lg_attend_sm]; each branch's CLS token attends to the
    other branch's patch tokens (context=..., kv_include_self=True)."""

    def __init__(self, sm_dim: int, lg_dim: int, depth: int, heads: int, dim_head: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [
                    CrossVitProjectInOut(sm_dim, lg_dim, CrossVitAttention(lg_dim, heads, dim_head)),
                    CrossVitProjectInOut(lg_dim, sm_dim, CrossVitAttention(sm_dim, heads, dim_head)),
                ]
            )
            for _ in range(depth)
        )

    def forward(self, sm_tokens, lg_tokens):
        (sm_cls, sm_patch), (lg_cls, lg_patch) = ((t[:, :1], t[:, 1:]) for t in (sm_tokens, lg_tokens))
        for sm_attend_lg, lg_attend_sm in self.layers:
            sm_cls = sm_attend_lg(sm_cls, context=lg_patch, kv_include_self=True) + sm_cls
            lg_cls = lg_attend_sm(lg_cls, context=sm_patch, kv_include_self=True) + lg_cls
        return torch.cat((sm_cls, sm_patch), dim=1), torch.cat((lg_cls, lg_patch), dim=1)


class CrossVitPatches(nn.Module):
    """einops Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)'): no parameters."""

    def __init__(self, patch: int):
        super().__init__()
        self.patch = patch

    def forward(self, img):
        b, c, h, w = img.shape
        p = self.patch
        x = img.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (h // p) * (w // p), p * p * c)


class CrossVitImageEmbedder(nn.Module):
    def __init__(self, dim: int, image_size: int, patch_size: int, channels: int = 3):
        super().__init__()
        patches, patch_dim = (image_size // patch_size) ** 2, channels * patch_size**2
        self.to_patch_embedding = nn.Sequential(
            CrossVitPatches(patch_size), nn.LayerNorm(patch_dim), nn.Linear(patch_dim, dim), nn.LayerNorm(dim)
        )
        self.pos_embedding = nn.Parameter(torch.randn(1, patches + 1, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))

    def forward(self, img):
        x = self.to_patch_embedding(img)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return x + self.pos_embedding[:, : x.shape[1]]


class CrossViT(nn.Module):
    """CrossViT: sm/lg image embedders, multi_scale_encoder.layers.{i} = [sm Transformer, lg Transformer,
    CrossTransformer], sm/lg MLP heads (the logits summed)."""

    def __init__(self, image_size=8, sm_dim=16, lg_dim=24, sm_patch=2, lg_patch=4, heads=2, dim_head=8, depth=1):
        super().__init__()
        self.sm_image_embedder = CrossVitImageEmbedder(sm_dim, image_size, sm_patch)
        self.lg_image_embedder = CrossVitImageEmbedder(lg_dim, image_size, lg_patch)
        encoder = nn.Module()
        encoder.layers = nn.ModuleList(
            nn.ModuleList(
                [
                    CrossVitTransformer(sm_dim, 1, heads, dim_head, 2 * sm_dim),
                    CrossVitTransformer(lg_dim, 2, heads, dim_head, 2 * lg_dim),
                    CrossVitCrossTransformer(sm_dim, lg_dim, 1, heads, dim_head),
                ]
            )
            for _ in range(depth)
        )
        self.multi_scale_encoder = encoder
        self.sm_mlp_head = nn.Sequential(nn.LayerNorm(sm_dim), nn.Linear(sm_dim, 3))
        self.lg_mlp_head = nn.Sequential(nn.LayerNorm(lg_dim), nn.Linear(lg_dim, 3))

    def forward(self, img):
        sm, lg = self.sm_image_embedder(img), self.lg_image_embedder(img)
        for sm_enc, lg_enc, cross_attend in self.multi_scale_encoder.layers:
            sm, lg = cross_attend(sm_enc(sm), lg_enc(lg))
        return self.sm_mlp_head(sm[:, 0]) + self.lg_mlp_head(lg[:, 0])


def save(model, folder, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def changed(before: dict, after: dict) -> set[str]:
    return {n for n in before if not torch.equal(before[n], after[n])}
