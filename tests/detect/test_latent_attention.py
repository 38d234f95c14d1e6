"""Multi-head latent attention (DeepSeek-V3's DeepseekV3Attention), judged through the model's own code: the
per-head key and value maps are what its own ``expand_kv`` makes of each latent feature, the query maps what
its own query projection makes of each feature of its input; the shared down-projections stay as they were."""

from __future__ import annotations

import pytest
import torch

import surgeon

SIZES = dict(qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=64)


def _model(tmp_path, heads: int, q_lora_rank: int | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora_rank,
        vocab_size=100,
        **SIZES,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "model")
    return model


def _maps(attn):
    """Per head (query, key without rotary part, value) maps, (heads, out, in), through the module's own code."""
    r = attn.kv_b_proj.in_features
    latent = torch.eye(r)[None, None]  # one token per latent feature
    key, value = attn.expand_kv(latent, torch.zeros(1, 1, r, attn.qk_rope_head_dim))
    query_in = attn.q_b_proj if attn.q_proj is None else attn.q_proj
    n = query_in.in_features
    query = query_in(torch.eye(n)).view(n, attn.num_heads, -1).permute(1, 2, 0)
    return query, key[0, :, :, : attn.qk_nope_head_dim].transpose(1, 2), value[0].transpose(1, 2)


@pytest.mark.parametrize(("heads", "q_lora_rank"), [(4, 32), (8, None)])
def test_latent_heads_are_conditioned_through_the_model_code(tmp_path, heads, q_lora_rank):
    model = _model(tmp_path, heads, q_lora_rank)
    report = surgeon.reinit_checkpoint(tmp_path / "model", output=tmp_path / "out", seed=3)
    assert len(report.blocks) == 2 and {b.layout for b in report.blocks} == {"latent (MLA)"}
    assert any("multi-head latent attention" in n for n in report.notes)
    loaded = type(model).from_pretrained(tmp_path / "out").eval()
    old, new = model.state_dict(), loaded.state_dict()
    changed = {n for n in old if not torch.equal(old[n], new[n])}
    query_name = "q_proj" if q_lora_rank is None else "q_b_proj"
    assert changed == {f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1) for p in (query_name, "kv_b_proj")}
    r, v = SIZES["kv_lora_rank"], SIZES["v_head_dim"]
    tiled = heads * v > r
    assert any("value identity tiles them" in n for n in report.notes) == tiled
    with torch.no_grad():
        for layer in loaded.model.layers:
            query, key, value = _maps(layer.self_attn)
            for maps in (query, key):  # each head: orthonormal rows, an independent draw per head
                gram = maps @ maps.transpose(1, 2)
                assert torch.allclose(gram, torch.eye(maps.shape[1]).expand_as(gram), atol=1e-5)
                assert (maps[0] @ maps[1].T).abs().max() > 1e-3
            for h in range(heads):  # the block value identity over the latent, tiled where heads are wider
                start = (h % (r // v)) * v
                assert torch.equal(value[h], torch.eye(r)[start : start + v])
        ids = torch.randint(0, 100, (1, 6))
        assert torch.isfinite(loaded(ids).logits).all()


def test_latent_sizes_missing_from_the_config_are_refused(tmp_path):
    import json

    _model(tmp_path, 4, 32)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    del config["qk_nope_head_dim"], config["model_type"]  # no family defaults to fall back on
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(surgeon.SurgeonError, match=r"latent attention.*qk_nope_head_dim"):
        surgeon.reinit_checkpoint(tmp_path / "model", output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


# Mistral Large 4 (modeling_mistral_large4.py): its config's own default makes every fourth layer rotary-free
# (no_rope_layers), where kv_b_proj holds per head qk_nope_head_dim + qk_rope_head_dim key rows; the queries keep
# that many rows per head in every layer
ML4_SIZES = dict(qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=64)


def _mistral_large4(tmp_path):
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(
        "mistral_large4_text",
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=4,
        vocab_size=100,
        **ML4_SIZES,
    )
    torch.manual_seed(0)
    model = AutoModel.from_config(config).eval()
    model.save_pretrained(tmp_path / "model")
    return model


@pytest.mark.parametrize(("layers", "chosen"), [("all", (0, 1, 2, 3)), ("-1", (3,)), ("3", (3,))])
def test_rotary_free_latent_layers_are_sized_as_the_model_builds_them(tmp_path, layers, chosen):
    model = _mistral_large4(tmp_path)
    attns = [layer.self_attn for layer in model.layers]
    rope = ML4_SIZES["qk_rope_head_dim"]
    assert [a.qk_rope_head_dim for a in attns] == [rope, rope, rope, 0]  # the model's own layers differ
    surgeon.reinit_checkpoint(tmp_path / "model", output=tmp_path / "out", layers=layers, seed=3)
    loaded = type(model).from_pretrained(tmp_path / "out").eval()
    old, new = model.state_dict(), loaded.state_dict()
    changed = {n for n in old if not torch.equal(old[n], new[n])}
    assert changed == {f"layers.{i}.self_attn.{p}.weight" for i in chosen for p in ("q_proj", "kv_b_proj")}
    r, v = ML4_SIZES["kv_lora_rank"], ML4_SIZES["v_head_dim"]
    with torch.no_grad():
        for i in chosen:
            attn = loaded.layers[i].self_attn
            query, key, value = _maps(attn)
            assert key.shape[1] == attn.qk_nope_head_dim == (40 if i == 3 else 24)
            for maps in (query, key):  # each head: orthonormal rows at the size this layer's code uses
                gram = maps @ maps.transpose(1, 2)
                assert torch.allclose(gram, torch.eye(maps.shape[1]).expand_as(gram), atol=1e-5)
            for h in range(attn.num_heads):
                start = (h % (r // v)) * v
                assert torch.equal(value[h], torch.eye(r)[start : start + v])
        assert torch.isfinite(loaded(torch.randint(0, 100, (1, 6))).last_hidden_state).all()


@pytest.mark.parametrize(
    "model_type",
    [
        "mistral_large4_text",  # no_rope_layers (its census settings keep a rotary-free layer)
        "dots3_note_text",  # per_layer_config: its sliding layers' own heads and key sizes
    ],
)
def test_latent_sizes_per_layer_in_the_census(model_type, tmp_path):
    from helpers.census import census_one

    verdict = census_one(model_type, work=tmp_path)
    assert verdict.verdict == "right", f"{verdict.verdict} {verdict.detail}"
