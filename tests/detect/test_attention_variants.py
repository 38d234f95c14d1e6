"""Attention that departs from plain q/k/v: gated queries (Qwen3-Next), latent attention (DeepSeek:
both routes agree), Longformer's second (global) set, per-stack head counts from config keys and from hints,
and SigLIP's pooling head under a per-stack --layers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from surgeon import reinit_checkpoint
from surgeon.api import inspect_checkpoint
from surgeon.errors import LayoutError, SelectionError, UnsupportedWeightsError

from helpers.cli import expect_cli_error
from helpers.digests import tree_digest
from helpers.hybrids import attention_calls, build, load

pytestmark = pytest.mark.usefixtures("one_thread")


def orthonormal_rows(w: torch.Tensor) -> bool:
    w = w.double()
    return torch.allclose(w @ w.T, torch.eye(w.shape[0], dtype=torch.float64), atol=1e-5)


# --- gated attention -------------------------------------------------------------------------


def test_gated_query_rows_change_and_gate_rows_stay(tmp_path):
    """Qwen3-Next's q_proj: per head d query rows, then d gate rows. --layers 3: layer 3's query heads are
    semi-orthogonal, its gate rows byte-identical; through the forward, only layer 3's attention changes."""
    src, out = tmp_path / "src", tmp_path / "out"
    build("qwen3_next").save_pretrained(src)
    blocks = inspect_checkpoint(src).blocks
    assert [(b.layer, b.heads, b.kv_heads, b.head_dim, b.layout) for b in blocks] == [
        (1, 4, 2, 8, "separate, gated q"),
        (3, 4, 2, 8, "separate, gated q"),
    ]
    report = reinit_checkpoint(src, output=out, layers="3")
    assert any("gated attention" in n and "gate rows are kept" in n for n in report.notes)
    old, new = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    name = "model.layers.3.self_attn.q_proj.weight"
    heads_old, heads_new = old[name].view(4, 2, 8, 32), new[name].view(4, 2, 8, 32)  # (head, [query | gate], d, D)
    assert torch.equal(heads_old[:, 1], heads_new[:, 1])  # the gates, byte for byte
    assert all(orthonormal_rows(heads_new[h, 0]) for h in range(4))
    assert not any(orthonormal_rows(heads_old[h, 0]) for h in range(4))
    assert torch.equal(old["model.layers.1.self_attn.q_proj.weight"], new["model.layers.1.self_attn.q_proj.weight"])

    modules = ["model.layers.1.self_attn", "model.layers.3.self_attn"]
    before, after = (attention_calls(load(p), modules) for p in (src, out))
    assert torch.allclose(before[modules[0]][0], after[modules[0]][0])
    assert not torch.allclose(before[modules[1]][0], after[modules[1]][0])
    # the model's own split of q_proj's output (view(..., -1, 2d).chunk(2)): gates equal, queries not
    (q_before, g_before), (q_after, g_after) = (_query_and_gate(load(p), 3) for p in (src, out))
    assert torch.equal(g_before, g_after) and not torch.allclose(q_before, q_after)


def _query_and_gate(model, layer):
    attn = model.model.layers[layer].self_attn
    seen = []
    handle = attn.q_proj.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    with torch.no_grad():
        model(input_ids=torch.arange(1, 9).view(1, 8), use_cache=False)
    handle.remove()
    query, gate = torch.chunk(seen[0].view(1, 8, -1, attn.head_dim * 2), 2, dim=-1)
    return query, gate


# --- multi-head latent attention -------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_module_route_agrees_with_the_checkpoint_route(name, tmp_path):
    """Both routes rewrite the same tensors to the same bytes (tests/detect/test_latent_attention.py judges the maps
    through the model's own code); the down-projections stay as they were."""
    from surgeon import reinit_

    src = tmp_path / name
    build(name).save_pretrained(src)
    report = reinit_checkpoint(src, output=tmp_path / "out", seed=5)
    assert {b.layout for b in report.blocks} == {"latent (MLA)"}
    written = load_file(next((tmp_path / "out").glob("*.safetensors")))
    model = build(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reinit_(model, seed=5)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight")) for k in changed)
    assert all(torch.equal(after[k], written[k]) for k in changed)


# --- Longformer: the global set ---------------------------------------------------------------


def test_longformer_global_projections_are_reinitialized_and_named(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LongformerConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        attention_window=[4, 4],
        max_position_embeddings=64,
    )
    src, out = tmp_path / "src", tmp_path / "out"
    tf.LongformerModel(config).save_pretrained(src)
    report = reinit_checkpoint(src, output=out, layers="1")
    touched = sorted({r.block.module for r in report.rows})
    assert touched == ["encoder.layer.1.attention.self", "encoder.layer.1.attention.self[global]"]
    assert "encoder.layer.1 [global] self" in report.render()
    model = tf.LongformerModel.from_pretrained(out).eval()
    attn = model.encoder.layer[1].attention.self
    for q in (attn.query_global, attn.key_global):
        assert all(orthonormal_rows(q.weight[h * 8 : (h + 1) * 8]) for h in range(4))
    assert torch.allclose(attn.value_global.weight, torch.eye(32), atol=1e-6)
    # the forward with a global token runs the global projections, and they are the ones written
    used = []
    handles = [
        m.register_forward_hook(lambda m, a, o: used.append(m))
        for m in (attn.query_global, attn.key_global, attn.value_global)
    ]
    with torch.no_grad():
        model(input_ids=torch.arange(1, 9).view(1, 8), global_attention_mask=torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0]]))
    for h in handles:
        h.remove()
    assert {id(m) for m in used} == {id(attn.query_global), id(attn.key_global), id(attn.value_global)}
    untouched = tf.LongformerModel.from_pretrained(src).encoder.layer[0].attention.self.query_global.weight
    assert torch.equal(model.encoder.layer[0].attention.self.query_global.weight, untouched)


# --- per-stack heads ----------------------------------------------------------------------------


class TwoWidths(nn.Module):
    """A chytorch-like model: a 16-head 256-wide encoder layer and a 4-head 64-wide pooling attention."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList([nn.ModuleDict({"attn": nn.MultiheadAttention(256, 16)})])
        self.pool = nn.ModuleDict({"attn": nn.MultiheadAttention(64, 4)})


def test_one_num_heads_for_blocks_of_different_widths_is_refused(tmp_path, cli):
    torch.manual_seed(0)
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in TwoWidths().state_dict().items()}, path)
    with pytest.raises(
        LayoutError,
        match=r"num_heads=16 for attention blocks of different widths \(256 wide: encoder.0.attn; 64 wide: pool.attn\)",
    ):
        inspect_checkpoint(path, num_heads=16)
    expect_cli_error(
        cli,
        tmp_path,
        "reinit",
        path,
        "--num-heads",
        "16",
        "-o",
        tmp_path / "o.safetensors",
        match="give each stack its own count (--num-heads encoder=N,pool.attn=N)",
    )
    with pytest.raises(LayoutError, match="names 'decoder', which is no stack of this model"):
        inspect_checkpoint(path, num_heads="encoder=16,decoder=4")
    out = tmp_path / "out.safetensors"
    cli("reinit", path, "--num-heads", "encoder=16,pool=4", "-o", out)
    model = TwoWidths()
    model.load_state_dict(load_file(out))
    for mha, heads in ((model.encoder[0]["attn"], 16), (model.pool["attn"], 4)):
        d = mha.embed_dim // heads
        q = mha.in_proj_weight[: mha.embed_dim]
        assert all(orthonormal_rows(q[h * d : (h + 1) * d]) for h in range(heads))  # each real head: kappa 1
    # the model's own forward splits the 64-wide block into 4 heads: its output is finite and changed
    x = torch.randn(5, 1, 64)
    before = TwoWidths()
    before.load_state_dict(load_file(path))
    assert not torch.allclose(model.pool["attn"](x, x, x)[0], before.pool["attn"](x, x, x)[0])


def test_per_stack_config_keys_moonshine(tmp_path):
    """Moonshine spells heads encoder_num_attention_heads / decoder_num_key_value_heads only."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MoonshineConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        encoder_num_hidden_layers=2,
        decoder_num_hidden_layers=2,
        encoder_num_attention_heads=8,
        decoder_num_attention_heads=8,
        encoder_num_key_value_heads=8,
        decoder_num_key_value_heads=8,
    )
    model = tf.MoonshineForConditionalGeneration(config)
    model.save_pretrained(tmp_path / "m")
    found = {(b.stack, b.kind): (b.heads, b.kv_heads, b.head_dim) for b in inspect_checkpoint(tmp_path / "m").blocks}
    attn = model.model.encoder.layers[0].self_attn
    expected = (model.config.encoder_num_attention_heads, attn.k_proj.out_features // attn.head_dim, attn.head_dim)
    assert found == {
        ("model.encoder.layers", "self"): expected,
        ("model.decoder.layers", "self"): expected,
        ("model.decoder.layers", "cross"): expected,
    }
    # per-stack hints agree with the config where they say the same, and are refused where they do not
    inspect_checkpoint(tmp_path / "m", num_heads="encoder=8,decoder=8")
    with pytest.raises(LayoutError, match="num_heads=4 contradicts config.json, which says 8 for model.decoder.layers"):
        inspect_checkpoint(tmp_path / "m", num_heads="decoder=4")


# --- SigLIP: a stack without the selected layer -------------------------------------------------


def test_a_stack_without_the_layer_is_skipped_with_a_note(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    text = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=16,
    )
    vision = dict(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=8
    )
    src = tmp_path / "siglip"
    tf.SiglipModel(tf.SiglipConfig(text_config=text, vision_config=vision)).save_pretrained(src)
    report = reinit_checkpoint(src, output=tmp_path / "out", layers="1")
    assert {r.block.module for r in report.rows} == {
        "text_model.encoder.layers.1.self_attn",
        "vision_model.encoder.layers.1.self_attn",
    }
    assert any(n.startswith("vision_model.head.attention skipped: layer 1 is out of range") for n in report.notes), (
        report.notes
    )
    before = tree_digest(tmp_path)
    with pytest.raises(SelectionError, match="layer 2 is out of range"):
        reinit_checkpoint(src, output=tmp_path / "never", layers="2")
    assert tree_digest(tmp_path) == before


def test_latent_attention_in_an_onnx_export_is_named_and_refused(tmp_path):
    import warnings

    model = build("deepseek_v3")

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask, use_cache=False).logits

    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Logits().eval(),
            (torch.arange(1, 9).view(1, 8), torch.ones(1, 8, dtype=torch.long)),
            str(path),
            input_names=["ids", "mask"],
            dynamo=False,
            opset_version=18,
        )
    with pytest.raises(
        UnsupportedWeightsError, match=r"uses multi-head latent attention \(MLA: .*\(kv_a_proj_with_mqa, kv_b_proj\)"
    ):
        inspect_checkpoint(path, device="cpu")


def test_a_per_stack_hint_is_read_by_the_first_word_it_names():
    from surgeon.detect.hints import Hints
    from surgeon.errors import OptionError

    hints = Hints(num_heads="encoder=4,decoder=2,vision=8")
    assert hints.get("num_heads", "decoder.bert.encoder.layer") == 2  # an EncoderDecoderModel's decoder
    assert hints.get("num_heads", "encoder.encoder.layer") == 4
    assert hints.get("num_heads", "vision_model.encoder.layers") == 8
    assert (
        hints.get("num_heads", "text_model.layers") is None
        and hints.spelled("num_heads") == "encoder=4,decoder=2,vision=8"
    )
    assert Hints(num_heads="16").num_heads == 16 and Hints(num_heads={"pool": 4}).get("num_heads", "pool.attn") == 4
    for bad in ("encoder=", "=4", "encoder=0", "x", 0, True):
        with pytest.raises(OptionError):
            Hints(num_heads=bad)
