"""Non-Hugging-Face attention modules for the module tests, and a way to read their effective
per-head q/k/v maps through their own forward.

The modules are written out here because the libraries they mirror are not importable on this
machine (timm needs torchvision, which has no CPU wheel beside torch 2.13) or are not packages at
all (lucidrains-style blocks, Meta's reference Llama). Each follows its original's forward closely:
how projections are split into heads, where the scale is applied, how the attention product is
written (scaled_dot_product_attention, matmul + softmax, einsum).

``observe(attn, x, context=None)`` calls one attention module on a known Gaussian probe, catches the
q, k, v that reach its attention product (scaled_dot_product_attention, or the products around the
softmax) and solves each head's map ``W x + b`` by least squares. It knows nothing about parameter
names or layouts: it is the ground truth the library is checked against. For
``nn.MultiheadAttention``, whose functional forward hides its internals from a TorchFunctionMode,
the capture happens at the ATen kernel instead (``observe_mha``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# --------------------------------------------------------------------------- timm-style ViT


class TimmAttention(nn.Module):
    """timm.layers.Attention: one fused ``qkv`` Linear viewed (B, N, 3, H, d); SDPA when fused_attn,
    else ``q * scale``, ``q @ k.transpose(-2, -1)``, ``softmax``, ``attn @ v``."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, fused_attn=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            if attn_mask is not None:
                attn = attn + attn_mask
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(self.norm(x)))


class TimmMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimmBlock(nn.Module):
    def __init__(self, dim, num_heads, **attn_kwargs):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TimmAttention(dim, num_heads, **attn_kwargs)
        self.ls1 = nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = TimmMlp(dim, 2 * dim)
        self.ls2 = nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class TimmPatchEmbed(nn.Module):
    def __init__(self, img_size, patch_size, in_chans, dim):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.Identity()

    def forward(self, x):
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))  # (B, N, C)


class TimmVisionTransformer(nn.Module):
    """timm.models.VisionTransformer reduced to its structure: patch embedding, class token,
    position embedding, blocks, final norm, head. The model's input is an image, so surgeon cannot
    call it with a (batch, tokens, width) probe and has to find the blocks underneath."""

    def __init__(self, img_size=16, patch_size=4, dim=48, depth=3, num_heads=6, num_classes=5, **attn_kwargs):
        super().__init__()
        self.patch_embed = TimmPatchEmbed(img_size, patch_size, 3, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(dim, num_heads, **attn_kwargs) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


# --------------------------------------------------------------------------- custom modules


class LucidAttention(nn.Module):
    """lucidrains-style: ``to_q`` and ``to_kv`` ... here ``to_q``/``to_k``/``to_v`` with an inner width
    ``heads * dim_head`` that differs from the model width, optional ``context`` (cross-attention),
    scaled_dot_product_attention, ``to_out``."""

    def __init__(self, dim, heads=4, dim_head=6, context_dim=None, bias=True):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(context_dim or dim, inner, bias=bias)
        self.to_v = nn.Linear(context_dim or dim, inner, bias=bias)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x, context=None):
        context = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # b n (h d) -> b h n d
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).flatten(2))


class FusedEinsumAttention(nn.Module):
    """``to_qkv`` chunked in three along the features, heads split per chunk, einsum attention."""

    def __init__(self, dim, heads=4, dim_head=8):
        super().__init__()
        self.heads, self.scale = heads, dim_head**-0.5
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x):
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).flatten(2))


class InterleavedQKV(nn.Module):
    """A fused ``qkv`` whose rows are interleaved per head, (B, N, H, 3, d), like GPT-NeoX: the name
    ``qkv`` alone would suggest timm's blocked (3, H, d) layout, and only the forward tells."""

    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class Stack(nn.Module):
    """Pre-norm residual blocks around any attention module (called with the hidden states only)."""

    def __init__(self, make, dim, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(dim), "attn": make()}) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["attn"](layer["norm"](x))
        return x


# Meta's reference Llama (llama/model.py), without the KV cache: wq/wk/wv/wo, grouped-query
# attention through repeat_kv, rotary embeddings as complex multiplication, matmul + softmax.


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs_cis).flatten(
        3
    ).type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class MetaAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class MetaBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.attention = MetaAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = nn.Sequential(
            nn.Linear(dim, 2 * dim, bias=False), nn.SiLU(), nn.Linear(2 * dim, dim, bias=False)
        )
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x, start_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaTransformer(nn.Module):
    def __init__(self, vocab=64, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MetaBlock(dim, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.freqs_cis = precompute_freqs_cis(dim // n_heads, max_seq * 2)

    def forward(self, tokens, start_pos=0):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        mask = torch.full((seqlen, seqlen), float("-inf")).triu(1) if seqlen > 1 else None
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        return self.output(self.norm(h)).float()


def randomize_biases(module, std=0.1, seed=0):
    """Non-zero biases so that zeroing them is visible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module


# --------------------------------------------------------------------------- observation


@dataclass
class Maps:
    """Per-head maps of one attention call: weights (H, d, in) and biases (H, d) for q, k, v."""

    q: torch.Tensor
    q_bias: torch.Tensor
    k: torch.Tensor
    k_bias: torch.Tensor
    v: torch.Tensor
    v_bias: torch.Tensor


class _Capture(TorchFunctionMode):
    """(q, k, v) as (B, H, L, d) at scaled_dot_product_attention or around the first softmax."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "scaled_dot_product_attention":
            self.events.append(("sdpa", args[0], args[1], args[2]))
        elif name in ("matmul", "__matmul__"):
            self.events.append(("prod", args[0], args[1]))
        elif name == "einsum" and args[0].replace(" ", "") == "bhid,bhjd->bhij":
            self.events.append(("prod", args[1], args[2].transpose(-1, -2)))
        elif name == "einsum" and args[0].replace(" ", "") == "bhij,bhjd->bhid":
            self.events.append(("prod", args[1], args[2]))
        elif name == "softmax":
            self.events.append(("softmax",))
        return func(*args, **kwargs)

    def qkv(self):
        sdpa = [e for e in self.events if e[0] == "sdpa"]
        if sdpa:
            assert len(sdpa) == 1, "one attention call per observation"
            return sdpa[0][1:]
        s = next(i for i, e in enumerate(self.events) if e[0] == "softmax")
        _, q, kt = [e for e in self.events[:s] if e[0] == "prod"][-1]
        _, _, v = [e for e in self.events[s + 1 :] if e[0] == "prod"][0]
        return q, kt.transpose(-1, -2), v


def _solve(x, states):
    """W (H, d, D), b (H, d) with states[b, h, n] = W[h] @ x[b, n] + b[h], checked to be exact."""
    B, H, N, d = states.shape
    X = torch.cat([x.reshape(B * N, -1), torch.ones(B * N, 1)], dim=1).double()
    Y = states.permute(0, 2, 1, 3).reshape(B * N, H * d).double()
    sol = torch.linalg.lstsq(X, Y).solution
    assert (X @ sol - Y).norm() <= 1e-4 * Y.norm() + 1e-9, "not an affine map of the probe"
    return sol[:-1].T.reshape(H, d, -1), sol[-1].reshape(H, d)


def probe(width, rows=None, seed=11):
    rows = rows or 3 * width + 8
    return torch.randn(1, rows, width, generator=torch.Generator().manual_seed(seed))


def observe(attn, width, *, context_width=None, call=None, q_scale=1.0):
    """The maps of one attention module, called as ``attn(x)`` / ``attn(x, context=y)`` / ``call(attn, x)``.

    ``q_scale``: a factor the module multiplies its query by before the product (timm's unfused path).
    """
    x = probe(width)
    y = probe(context_width, rows=x.shape[1], seed=12) if context_width else None
    mode = _Capture()
    with torch.no_grad(), mode:
        if call is not None:
            call(attn, x)
        elif y is not None:
            attn(x, context=y)
        else:
            attn(x)
    q, k, v = mode.qkv()
    q = q / q_scale
    (qw, qb), (kw, kb), (vw, vb) = (
        _solve(x, q.float()),
        _solve(y if y is not None else x, k.float()),
        _solve(y if y is not None else x, v.float()),
    )
    return Maps(qw, qb, kw, kb, vw, vb)


class KernelCapture(TorchDispatchMode):
    """q, k, v at the ATen attention kernel (seen even inside F.multi_head_attention_forward)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.name():
            self.calls.append(tuple(a.detach().clone() for a in args[:3]))
        return func(*args, **(kwargs or {}))


def observe_mha(mha: nn.MultiheadAttention, *, cross=False):
    width, kv_width = mha.embed_dim, mha.kdim
    x = probe(width)
    y = probe(kv_width, rows=x.shape[1], seed=12) if cross or kv_width != width else x
    xs, ys = (x, y) if mha.batch_first else (x.transpose(0, 1), y.transpose(0, 1))
    mode = KernelCapture()
    with torch.enable_grad(), mode:  # grad on keeps nn.MultiheadAttention off its fused fast path
        mha(xs, ys, ys, need_weights=False)
    ((q, k, v),) = mode.calls
    (qw, qb), (kw, kb), (vw, vb) = _solve(x, q), _solve(y, k), _solve(y, v)
    return Maps(qw, qb, kw, kb, vw, vb)


# --------------------------------------------------------------------------- checks


def assert_conditioned(maps: Maps, *, kv_groups: int = 1, atol=1e-4):
    """Semi-orthogonal q/k heads, block-identity v (head h reads features of key/value head h // groups),
    zero biases."""
    for w in (maps.q, maps.k):
        for h in w:
            gram = h @ h.T if h.shape[0] <= h.shape[1] else h.T @ h
            assert torch.allclose(gram, torch.eye(gram.shape[0], dtype=gram.dtype), atol=atol), gram.diagonal()
    heads, d, width = maps.v.shape
    for h in range(heads):
        kv = h // kv_groups
        expected = torch.eye(width, dtype=maps.v.dtype)[kv * d : (kv + 1) * d] if (kv + 1) * d <= width else None
        if expected is not None:
            assert torch.allclose(maps.v[h], expected, atol=atol), f"value head {h}"
    for b in (maps.q_bias, maps.k_bias, maps.v_bias):
        assert torch.allclose(b, torch.zeros_like(b), atol=atol)


def assert_same(a: Maps, b: Maps, atol=1e-6):
    for field in ("q", "q_bias", "k", "k_bias", "v", "v_bias"):
        assert torch.allclose(getattr(a, field), getattr(b, field), atol=atol, rtol=1e-5), field
