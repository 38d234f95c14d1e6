"""Self-check of the test-side ground truth (``helpers.observe.observe``).

``observe`` recovers the q/k/v maps through each model's own forward code and
knows nothing about weight layouts.  Here -- and only here -- the per-family
layout knowledge is written down, and the two must agree.  Also checked: every
attention module is found, negative controls (the capture really sits at the
attention kernel; non-linearities are refused), that ``observe`` leaves the
model untouched, and that every family round-trips through
``save_pretrained`` / ``Family.load``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

try:  # tests/ on sys.path (pytest rootdir-relative import, no __init__.py)
    from helpers.families import FAMILIES
    from helpers.observe import ObservationError, ObservedBlock, observe
except ImportError:  # tests/ is a package
    from ._families import FAMILIES
    from ._observe import ObservationError, ObservedBlock, observe

ATOL = 1e-5  # observed errors are ~1e-8; weights are ~1e-2, so any layout/scale slip is >> ATOL

# --------------------------------------------------------------------------- layouts


def _heads(w, b, n, d):
    """Rows of a (n*d, D) weight / (n*d,) bias as (n, d, D) / (n, d)."""
    din = w.shape[-1]
    bias = torch.zeros(n * d) if b is None else b
    return w.reshape(n, d, din), bias.reshape(n, d)


def _exp(q, k, v, cross=False):
    (qw, qb), (kw, kb), (vw, vb) = q, k, v
    return dict(cross=cross, q=qw, q_bias=qb, k=kw, k_bias=kb, v=vw, v_bias=vb)


def _separate(model, qn, kn, vn, shape_fn, cross_fn=lambda name: False):
    """Families with three nn.Linear projections: rows h*d..(h+1)*d are head h."""
    out = {}
    for name, m in model.named_modules():
        if all(isinstance(getattr(m, a, None), torch.nn.Linear) for a in (qn, kn, vn)):
            H, KV, d = shape_fn(m)
            q, k, v = getattr(m, qn), getattr(m, kn), getattr(m, vn)
            out[name] = _exp(
                _heads(q.weight, q.bias, H, d),
                _heads(k.weight, k.bias, KV, d),
                _heads(v.weight, v.bias, KV, d),
                cross=cross_fn(name),
            )
    return out


def _from_config(H, KV, d):
    return lambda m: (H, KV, d)


def exp_llama_like(model):
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return _separate(model, "q_proj", "k_proj", "v_proj", _from_config(c.num_attention_heads, c.num_key_value_heads, d))


def exp_mha_sep(qn, kn, vn, cross_marker=None):
    def f(model):
        c = model.config
        H = c.num_attention_heads
        d = c.hidden_size // H
        cross = (lambda n: cross_marker in n) if cross_marker else (lambda n: False)
        return _separate(model, qn, kn, vn, _from_config(H, H, d), cross)

    return f


def exp_distilbert(model):
    c = model.config
    return _separate(model, "q_lin", "k_lin", "v_lin", _from_config(c.n_heads, c.n_heads, c.dim // c.n_heads))


def exp_swin(model):
    c = model.config

    def shape(m):  # heads differ per stage: read them from the stage's width
        width = m.q_proj.out_features
        stage = [i for i in range(len(c.depths)) if c.embed_dim * 2**i == width][0]
        H = c.num_heads[stage]
        return H, H, width // H

    return _separate(model, "q_proj", "k_proj", "v_proj", shape)


def exp_t5(model):
    c = model.config
    H, d = c.num_heads, c.d_kv
    return _separate(model, "q", "k", "v", _from_config(H, H, d), lambda n: "EncDecAttention" in n)


def exp_gpt2(model):
    # Conv1D: y = x @ W + b, W of shape (D, 3D), columns [Q | K | V], head h = cols h*d..(h+1)*d
    c = model.config
    H, D = c.n_head, c.n_embd
    d = D // H
    out = {}
    for i, blk in enumerate(model.transformer.h):
        w, b = blk.attn.c_attn.weight, blk.attn.c_attn.bias
        parts = [_heads(w[:, j * D : (j + 1) * D].T, b[j * D : (j + 1) * D], H, d) for j in range(3)]
        out[f"transformer.h.{i}.attn"] = _exp(*parts)
    return out


def _fused_rows(model, prefix, attr, layers, split):
    out = {}
    for i, blk in enumerate(layers):
        lin = getattr(blk, attr.split(".")[0])
        for a in attr.split(".")[1:]:
            lin = getattr(lin, a)
        b = lin.bias if lin.bias is not None else torch.zeros(lin.weight.shape[0])
        out[prefix.format(i)] = _exp(*split(lin.weight, b))
    return out


def exp_gpt_neox(model):
    # query_key_value rows viewed (H, 3, d): per head [q | k | v] interleaved
    c = model.config
    H = c.num_attention_heads
    d = c.hidden_size // H

    def split(w, b):
        w3, b3 = w.reshape(H, 3, d, -1), b.reshape(H, 3, d)
        return [(w3[:, j], b3[:, j]) for j in range(3)]

    return _fused_rows(model, "gpt_neox.layers.{}.attention", "attention.query_key_value", model.gpt_neox.layers, split)


def exp_bloom(model):
    # query_key_value rows viewed (H, 3, d), like gpt_neox
    c = model.config
    H = c.n_head
    d = c.hidden_size // H

    def split(w, b):
        w3, b3 = w.reshape(H, 3, d, -1), b.reshape(H, 3, d)
        return [(w3[:, j], b3[:, j]) for j in range(3)]

    return _fused_rows(
        model, "transformer.h.{}.self_attention", "self_attention.query_key_value", model.transformer.h, split
    )


def exp_falcon(model):
    c = model.config
    H = c.num_attention_heads
    d = c.hidden_size // H
    if c.new_decoder_architecture:
        # rows viewed (KV, H/KV + 2, d): per kv group [q_0..q_{g-1} | k | v]
        KV = c.num_kv_heads
        g = H // KV

        def split(w, b):
            w4, b4 = w.reshape(KV, g + 2, d, -1), b.reshape(KV, g + 2, d)
            return [
                (w4[:, :g].reshape(H, d, -1), b4[:, :g].reshape(H, d)),
                (w4[:, g], b4[:, g]),
                (w4[:, g + 1], b4[:, g + 1]),
            ]
    elif c.multi_query:
        # rows viewed (H + 2, d): [q_0..q_{H-1} | k | v]
        def split(w, b):
            w2, b2 = w.reshape(H + 2, d, -1), b.reshape(H + 2, d)
            return [(w2[:H], b2[:H]), (w2[H : H + 1], b2[H : H + 1]), (w2[H + 1 :], b2[H + 1 :])]
    else:
        # rows viewed (H, 3, d), like bloom
        def split(w, b):
            w3, b3 = w.reshape(H, 3, d, -1), b.reshape(H, 3, d)
            return [(w3[:, j], b3[:, j]) for j in range(3)]

    return _fused_rows(
        model, "transformer.h.{}.self_attention", "self_attention.query_key_value", model.transformer.h, split
    )


def _blocked(H, d):
    # rows [Q | K | V] blocks of H*d rows each
    def split(w, b):
        w3, b3 = w.reshape(3, H, d, -1), b.reshape(3, H, d)
        return [(w3[j], b3[j]) for j in range(3)]

    return split


def exp_mpt(model):
    c = model.config
    H = c.n_heads
    return _fused_rows(
        model, "transformer.blocks.{}.attn", "attn.Wqkv", model.transformer.blocks, _blocked(H, c.d_model // H)
    )


def exp_modernbert(model):
    c = model.config
    H = c.num_attention_heads
    return _fused_rows(model, "layers.{}.attn", "attn.Wqkv", model.layers, _blocked(H, c.hidden_size // H))


def exp_phi3(model):
    # qkv_proj rows [Q (H*d) | K (KV*d) | V (KV*d)]
    c = model.config
    H, KV = c.num_attention_heads, c.num_key_value_heads
    d = c.hidden_size // H

    def split(w, b):
        sizes = [H * d, KV * d, KV * d]
        ws, bs = w.split(sizes), b.split(sizes)
        return [_heads(ws[0], bs[0], H, d), _heads(ws[1], bs[1], KV, d), _heads(ws[2], bs[2], KV, d)]

    return _fused_rows(model, "model.layers.{}.self_attn", "self_attn.qkv_proj", model.model.layers, split)


def exp_gpt_bigcode(model):
    # multi_query: c_attn is an nn.Linear with rows [Q (H*d) | K (d) | V (d)]
    c = model.config
    assert c.multi_query
    H = c.n_head
    d = c.n_embd // H

    def split(w, b):
        ws, bs = w.split([H * d, d, d]), b.split([H * d, d, d])
        return [_heads(ws[0], bs[0], H, d), _heads(ws[1], bs[1], 1, d), _heads(ws[2], bs[2], 1, d)]

    return _fused_rows(model, "transformer.h.{}.attn", "attn.c_attn", model.transformer.h, split)


def exp_whisper(model):
    # Whisper: k_proj has no bias; q is pre-scaled in forward (observer undoes it)
    return exp_mha_sep("q_proj", "k_proj", "v_proj", "encoder_attn")(model)


def _enc_dec_count(enc, dec):
    return enc + 2 * dec


SPECS = {
    # name: (expected-map function, expected number of attention blocks)
    "llama": (exp_llama_like, lambda c: c.num_hidden_layers),
    "mistral": (exp_llama_like, lambda c: c.num_hidden_layers),
    "qwen2": (exp_llama_like, lambda c: c.num_hidden_layers),
    "gemma": (exp_llama_like, lambda c: c.num_hidden_layers),
    "gpt2": (exp_gpt2, lambda c: c.n_layer),
    "gpt_neox": (exp_gpt_neox, lambda c: c.num_hidden_layers),
    "bloom": (exp_bloom, lambda c: c.n_layer),
    "falcon_new": (exp_falcon, lambda c: c.num_hidden_layers),
    "falcon_mqa": (exp_falcon, lambda c: c.num_hidden_layers),
    "falcon_mha": (exp_falcon, lambda c: c.num_hidden_layers),
    "mpt": (exp_mpt, lambda c: c.n_layers),
    "modernbert": (exp_modernbert, lambda c: c.num_hidden_layers),
    "phi3": (exp_phi3, lambda c: c.num_hidden_layers),
    "opt": (exp_mha_sep("q_proj", "k_proj", "v_proj"), lambda c: c.num_hidden_layers),
    "gptj": (exp_mha_sep("q_proj", "k_proj", "v_proj"), lambda c: c.n_layer),
    "bert": (exp_mha_sep("query", "key", "value"), lambda c: c.num_hidden_layers),
    "roberta": (exp_mha_sep("query", "key", "value"), lambda c: c.num_hidden_layers),
    "distilbert": (exp_distilbert, lambda c: c.n_layers),
    "vit": (exp_mha_sep("q_proj", "k_proj", "v_proj"), lambda c: c.num_hidden_layers),
    "t5": (exp_t5, lambda c: _enc_dec_count(c.num_layers, c.num_decoder_layers)),
    "bart": (
        exp_mha_sep("q_proj", "k_proj", "v_proj", "encoder_attn"),
        lambda c: _enc_dec_count(c.encoder_layers, c.decoder_layers),
    ),
    "whisper": (exp_whisper, lambda c: _enc_dec_count(c.encoder_layers, c.decoder_layers)),
    "clip_text": (exp_mha_sep("q_proj", "k_proj", "v_proj"), lambda c: c.num_hidden_layers),
    "swin": (exp_swin, lambda c: sum(c.depths)),
    "gpt_bigcode": (exp_gpt_bigcode, lambda c: c.n_layer),
}

# Hand-written expectations on the configs themselves (what the factories promise).
SHAPES = {
    # name: (H, KV, d) of the first attention block
    "llama": (8, 2, 8),
    "mistral": (6, 2, 8),
    "qwen2": (8, 4, 8),
    "gemma": (4, 2, 16),  # head_dim 16 != 48 / 4
    "phi3": (8, 2, 8),
    "falcon_new": (8, 2, 8),
    "falcon_mqa": (8, 1, 8),
    "falcon_mha": (8, 8, 8),
    "gpt_bigcode": (4, 1, 12),
    "t5": (4, 4, 8),  # inner dim 32 != d_model 48
}


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    # tiny models: intra-op threads only add overhead (and thrash on a shared CPU)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Where observe() captures q/k/v for each family (see _observe's docstring).
CAPTURE = {name: "attention-interface" for name in FAMILIES}
CAPTURE.update(
    bloom="matmul/softmax",  # alibi.baddbmm(batch1=Q, batch2=K^T) ... softmax ... bmm(P, V)
    mpt="matmul/softmax",  # matmul(Q, K^T) ... softmax ... matmul(P, V)
)  # falcon: through the attention interface since transformers 5.25 (its inline sdpa/eager code before)


def test_specs_cover_all_families():
    assert set(SPECS) == set(FAMILIES) == set(CAPTURE)


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = FAMILIES[name].make()
        return cache[name]

    return get


def _assert_block_matches(name, obs: ObservedBlock, exp: dict):
    assert obs.module == name
    assert obs.cross == exp["cross"], name
    for key in ("q", "q_bias", "k", "k_bias", "v", "v_bias"):
        got, want = getattr(obs, key), exp[key].detach().float()
        assert got.shape == want.shape, f"{name}.{key}: {tuple(got.shape)} != {tuple(want.shape)}"
        err = (got - want).abs().max().item()
        assert err < ATOL, f"{name}.{key}: max abs error {err:.2e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_observed_maps_equal_weight_layout(family, built):
    model = built(family)
    obs = observe(model)
    expected_fn, count_fn = SPECS[family]
    expected = expected_fn(model)

    # every attention module is found, and nothing else
    assert len(expected) == count_fn(model.config), "layout spec does not see every attention module"
    assert list(obs) == list(expected), f"observed {list(obs)} != expected {list(expected)}"

    for name, exp in expected.items():
        _assert_block_matches(name, obs[name], exp)

    if FAMILIES[family].encoder_decoder:
        n_cross = sum(b.cross for b in obs.values())
        assert 0 < n_cross < len(obs)
    else:
        assert not any(b.cross for b in obs.values())

    assert {b.capture for b in obs.values()} == {CAPTURE[family]}

    if family in SHAPES:
        first = next(iter(obs.values()))
        assert (first.num_heads, first.num_kv_heads, first.head_dim) == SHAPES[family]


@pytest.mark.parametrize("family", ["llama", "falcon_new", "bloom", "t5", "whisper", "swin"])
def test_observe_work_is_bounded(family, built):
    """Two whole-model forwards: a batch of one, then a capture batch of at most 3*D + 8 sequences (a fit
    needs 3*D + 8 probe rows and every sequence gives at least one). A bound on the work done, not on
    time: wall times are printed by benchmarks/bench_observe.py."""
    model = built(family)
    batches = []

    def count(_module, args, kwargs):
        first = next(t for t in (*args, *kwargs.values()) if torch.is_tensor(t))
        batches.append(first.shape[0])

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        observe(model)
    finally:
        handle.remove()
    widths = {m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(batches) == 2 and batches[0] == 1, batches
    assert 1 <= batches[1] <= 3 * max(widths) + 8, batches


def test_biases_are_nonzero_where_present(built):
    # the factories randomise biases, so bias handling is really exercised
    for family in ("llama", "qwen2", "gemma", "gpt2", "bloom", "falcon_new", "bert", "bart", "whisper", "modernbert"):
        obs = observe(built(family))
        blk = next(iter(obs.values()))
        assert blk.q_bias.abs().max() > 1e-3, family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_roundtrip_save_load(family, built, tmp_path):
    model = built(family)
    model.save_pretrained(tmp_path)
    again = FAMILIES[family].load(tmp_path)
    assert type(again) is type(model)
    assert not again.training
    a, b = observe(model), observe(again)
    assert list(a) == list(b)
    for name in a:
        for key in ("q", "q_bias", "k", "k_bias", "v", "v_bias"):
            assert torch.allclose(getattr(a[name], key), getattr(b[name], key), atol=ATOL), (name, key)


def test_factories_are_deterministic():
    a, b = FAMILIES["llama"].make(), FAMILIES["llama"].make()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


# --------------------------------------------------------------------- negative controls


def test_capture_sits_at_the_kernel_not_the_weights():
    """Permute the heads of q_proj's *output* with a hook: weights are untouched,
    but the observed map must follow what enters the attention product."""
    model = FAMILIES["llama"].make()
    c = model.config
    H, d = c.num_attention_heads, c.head_dim
    perm = torch.arange(H).flip(0)
    attn = model.model.layers[0].self_attn

    def permute_heads(mod, args, out):
        return out.unflatten(-1, (H, d))[..., perm, :].flatten(-2)

    h = attn.q_proj.register_forward_hook(permute_heads)
    try:
        obs = observe(model)
    finally:
        h.remove()
    w, b = _heads(attn.q_proj.weight, attn.q_proj.bias, H, d)
    assert torch.allclose(obs["model.layers.0.self_attn"].q, w[perm], atol=ATOL)
    assert torch.allclose(obs["model.layers.0.self_attn"].q_bias, b[perm], atol=ATOL)
    # layer 1 is unaffected
    w1, _ = _heads(model.model.layers[1].self_attn.q_proj.weight, None, H, d)
    assert torch.allclose(obs["model.layers.1.self_attn"].q, w1, atol=ATOL)


def test_nonlinearity_between_projection_and_attention_is_refused():
    model = FAMILIES["gpt2"].make()
    h = model.transformer.h[1].attn.c_attn.register_forward_hook(lambda m, a, out: torch.tanh(20 * out))
    try:
        with pytest.raises(ObservationError, match="transformer.h.1.attn"):
            observe(model)
    finally:
        h.remove()
    observe(model)  # fine again once the hook is gone


def test_qk_norm_is_refused():
    cfg = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with pytest.raises(ObservationError, match="QK-norm"):
        observe(model)


def test_mpt_clip_qkv_is_refused():
    cfg = transformers.MptConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        expansion_ratio=2,
        max_seq_len=64,
        attn_config={"clip_qkv": 0.5},
    )
    torch.manual_seed(0)
    model = transformers.MptForCausalLM(cfg).eval()
    with pytest.raises(ObservationError, match="clip_qkv"):
        observe(model)


@pytest.mark.parametrize("family", ["falcon_new", "falcon_mqa", "falcon_mha", "llama", "bart"])
def test_eager_attention_paths(family):
    """Families configured as eager give the same maps as under their default kernel (falcon included: since
    transformers 5.25 its eager path goes through the attention interface too; bloom and mpt keep the inline
    matmul/softmax pattern, test_observed_maps_equal_weight_layout)."""
    model = FAMILIES[family].make()
    ref = observe(model)
    for cfg in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        cfg._attn_implementation_internal = "eager"
    got = observe(model)
    assert list(got) == list(ref)
    assert {b.capture for b in got.values()} == {"attention-interface"}
    for name in ref:
        for key in ("q", "q_bias", "k", "k_bias", "v", "v_bias"):
            assert torch.allclose(getattr(got[name], key), getattr(ref[name], key), atol=ATOL), (name, key)


@pytest.mark.parametrize("family", ["llama", "falcon_new", "bloom", "t5", "gpt2"])
def test_observe_leaves_model_untouched(family):
    model = FAMILIES[family].make()
    model.train()
    model.transformer.h[0].eval() if hasattr(model, "transformer") else None
    flags = {n: m.training for n, m in model.named_modules()}
    impls = {n: m.config._attn_implementation for n, m in model.named_modules() if hasattr(m, "config")}
    hooks = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}

    observe(model)

    assert flags == {n: m.training for n, m in model.named_modules()}
    assert impls == {n: m.config._attn_implementation for n, m in model.named_modules() if hasattr(m, "config")}
    assert hooks == {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    # and the model still runs normally
    model.eval()
    ids = torch.randint(3, 90, (1, 8))
    kw = {"decoder_input_ids": ids} if FAMILIES[family].encoder_decoder else {}
    with torch.no_grad():
        model(input_ids=ids, **kw)


def test_non_float32_model_is_refused():
    model = FAMILIES["bert"].make().to(torch.bfloat16)
    with pytest.raises(ObservationError, match="float32"):
        observe(model)


def test_leaf_softmax_module_counts_for_its_caller():
    """An inline-attention module whose softmax is an nn.Softmax child (older
    code style) is still recognised by the matmul/softmax pattern."""

    class Attn(torch.nn.Module):
        def __init__(self, dim=16, heads=4):
            super().__init__()
            self.h, self.d = heads, dim // heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.softmax = torch.nn.Softmax(dim=-1)

        def forward(self, hidden_states):
            b, n, _ = hidden_states.shape
            q, k, v = self.qkv(hidden_states).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
            p = self.softmax(torch.matmul(q, k.transpose(-1, -2)))
            return torch.matmul(p, v).transpose(1, 2).reshape(b, n, -1)

    class Net(torch.nn.Module):
        main_input_name = "pixel_values"

        def __init__(self):
            super().__init__()
            self.config = transformers.PretrainedConfig(image_size=4, num_channels=16)
            self.blocks = torch.nn.ModuleList([Attn(), Attn()])

        def forward(self, pixel_values):
            x = pixel_values.flatten(2).transpose(1, 2)  # (B, 16 tokens, 16)
            for blk in self.blocks:
                x = blk(x)
            return x

    torch.manual_seed(0)
    net = Net().eval()
    obs = observe(net)
    assert list(obs) == ["blocks.0", "blocks.1"]
    for i, blk in enumerate(net.blocks):
        w3 = blk.qkv.weight.view(3, 4, 4, 16)
        b3 = blk.qkv.bias.view(3, 4, 4)
        o = obs[f"blocks.{i}"]
        assert o.capture == "matmul/softmax"
        assert torch.allclose(o.q, w3[0], atol=ATOL) and torch.allclose(o.q_bias, b3[0], atol=ATOL)
        assert torch.allclose(o.k, w3[1], atol=ATOL) and torch.allclose(o.k_bias, b3[1], atol=ATOL)
        assert torch.allclose(o.v, w3[2], atol=ATOL) and torch.allclose(o.v_bias, b3[2], atol=ATOL)
