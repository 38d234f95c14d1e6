"""The census judges a type whose forward it cannot run by what its attention modules were built with
(tests/helpers/census.py ``declared_attention``: each module's own heads and head size, from its attributes or
its constructor's arguments), and builds towers no model class wraps from their own config. Each judgement
here is shown able to fail: a checkpoint whose config.json says other heads than the modules were built with
is judged wrong, never right."""

from __future__ import annotations

import json

import torch

from helpers.census import _judge, _load, build, census_one, declared_attention


def test_a_type_whose_forward_cannot_run_is_judged_by_its_modules(tmp_path):
    """BROS's forward needs bounding boxes the census cannot make: its attention modules, as its own code
    built them, judge the re-initialization (every layer's heads and head size, each head conditioned)."""
    model, config = build("bros", tmp_path / "model")
    declared = declared_attention(model)
    layers = model.encoder.layer
    assert set(declared) == {f"encoder.layer.{i}.attention.self" for i in range(len(layers))}
    for i, layer in enumerate(layers):
        seen = declared[f"encoder.layer.{i}.attention.self"]
        own = layer.attention.self
        assert (seen.heads, seen.head_dim) == (own.num_attention_heads, own.attention_head_size)
    verdict = _judge("bros", model, config, tmp_path / "model", tmp_path)
    assert verdict.verdict == "right" and verdict.judged_by == "construction", verdict.detail


def test_construction_judgement_fails_a_checkpoint_cut_into_other_heads(tmp_path):
    """The same BROS checkpoint with config.json saying half the heads (each twice as wide): surgeon cuts
    the projections into those heads, and the modules the model was built with call it wrong."""
    model, config = build("bros", tmp_path / "model")
    path = tmp_path / "model" / "config.json"
    saved = json.loads(path.read_text())
    saved["num_attention_heads"] //= 2
    path.write_text(json.dumps(saved))
    verdict = _judge("bros", model, config, tmp_path / "model", tmp_path)
    assert verdict.kind == "wrong", verdict.verdict
    # each of the wider heads surgeon drew spans two of the module's own heads: one orthonormal block
    assert "heads 0 and 1 of the forward are one orthonormal block" in verdict.detail, verdict.detail


def test_constructor_arguments_are_captured_where_a_module_keeps_no_attribute(tmp_path):
    """Evolla's sequence-compressor resampler attention is built as ``(dim, dim_head, heads)`` and keeps only
    ``heads`` and a scale: its head size is read from the arguments its constructor received, and both
    are the resampler's own (config.resampler_heads, resampler_dim_head), not the protein encoder's."""
    model, config = build("evolla", tmp_path / "model")
    declared = declared_attention(model)
    resampler = {n: s for n, s in declared.items() if ".sequence_compressor_resampler." in n}
    assert resampler, sorted(declared)[:6]
    for name, seen in resampler.items():
        module = model.get_submodule(name)
        assert not hasattr(module, "dim_head") and not hasattr(module, "head_dim")
        assert seen.via == "constructor"
        assert (seen.heads, seen.head_dim) == (config.resampler_heads, config.resampler_dim_head)
        assert seen.heads * seen.head_dim == module.to_q.out_features
    encoder = config.protein_encoder_config
    assert (config.resampler_heads, config.resampler_dim_head) != (
        encoder.num_attention_heads,
        encoder.hidden_size // encoder.num_attention_heads,
    )


def test_a_tower_no_model_class_wraps_is_built_from_its_own_config(tmp_path):
    """SAM's mask decoder has a config type of its own but no model class: the census builds the module its
    config builds (SamMaskDecoder), saves its config and weights, judges it by its attention modules (its
    forward needs image embeddings), and its own class loads the output back strictly."""
    verdict = census_one("sam_mask_decoder", work=tmp_path)
    assert verdict.verdict == "right" and verdict.judged_by == "construction", verdict.verdict
    model, _ = build("sam_mask_decoder", tmp_path / "model")
    assert type(model).__name__ == "SamMaskDecoder"
    loaded, why = _load(model, tmp_path / "model")
    assert loaded is not None, why
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_attention_under_the_checkpoints_own_names_is_refused_by_name(tmp_path):
    """Conditional DETR as transformers saves it holds its decoder's attention under the original key names
    (decoder.layers.N.sa_qcontent_proj, ca_qpos_sine_proj, ...), each head's query a sum of a content and a
    position projection: --layers all is refused naming the decoder layer, nothing written; the encoder alone
    is re-initialized, the report names the decoder as left untouched, the decoder's weights stay byte for
    byte, and the model's own class loads the output back."""
    from safetensors.torch import load_file

    import surgeon
    from surgeon.errors import SelectionError

    model, _ = build("conditional_detr", tmp_path / "model")
    saved = load_file(next((tmp_path / "model").glob("*.safetensors")))
    assert "decoder.layers.0.sa_qcontent_proj.weight" in saved  # the checkpoint's own names, not the modules'
    try:
        surgeon.reinit_checkpoint(tmp_path / "model", layers="all", output=tmp_path / "all")
    except SelectionError as e:
        assert "decoder.layers.0" in str(e) and "sa_qcontent_proj + sa_qpos_proj" in str(e), str(e)
    else:
        raise AssertionError("--layers all re-initialized a model whose decoder attention surgeon cannot read")
    assert not (tmp_path / "all").exists()
    report = surgeon.reinit_checkpoint(tmp_path / "model", stack="encoder", output=tmp_path / "out")
    assert {b.module for b in report.blocks} == {
        f"encoder.layers.{i}.self_attn" for i in range(len(model.encoder.layers))
    }
    assert any("left untouched: decoder.layers.0 uses conditional attention" in n for n in report.notes), report.notes
    after = load_file(next((tmp_path / "out").glob("*.safetensors")))
    assert all(torch.equal(after[n], t) for n, t in saved.items() if n.startswith("decoder."))
    loaded, why = _load(model, tmp_path / "out")
    assert loaded is not None, why


def test_a_tower_no_forward_reached_is_judged_as_built(tmp_path, monkeypatch):
    """Kimi-K2.5 as transformers saves it holds its vision tower's attention as one fused
    ``vision_tower.blocks.N.wqkv`` beside ``attn.proj``; the census's text forward never enters the tower, so
    the tower's attention modules, as built, are judged too: with the rule that reads ``wqkv`` removed from
    surgeon, the tower is left as it was without a word, and the census says so (silently wrong); with it,
    every head of the tower is re-initialized in the heads its modules were built with."""
    from surgeon.detect import by_name, families

    right = census_one("kimi_k25", work=tmp_path)
    assert right.verdict == "right" and "more as built" in right.detail, right.detail
    without = tuple(r for r in families.RULES if not r.name.startswith("fused wqkv"))
    assert len(without) == len(families.RULES) - 2
    monkeypatch.setattr(by_name, "RULES", without)
    monkeypatch.setattr(by_name.match_modules, "__defaults__", (without,))
    wrong = census_one("kimi_k25", work=tmp_path)
    assert wrong.kind == "wrong", wrong.verdict
    assert "vision_tower.layers.0.attn runs attention, left untouched without a word" in wrong.detail, wrong.detail


def test_a_config_no_class_builds_alone_is_judged_inside_the_type_that_nests_it(tmp_path):
    """T5Gemma2's decoder config has no model class of its own: it is judged inside T5Gemma2, whose decoder
    the model's own code builds from it, and takes that verdict, saying so."""
    from transformers import T5Gemma2DecoderConfig

    model, _ = build("t5gemma2", tmp_path / "model")
    from helpers.census import _built_from

    roots, decoder = _built_from(model, T5Gemma2DecoderConfig)
    assert roots and decoder and all(".decoder." in f".{name}" for name in decoder), decoder
    verdict = census_one("t5gemma2_decoder", work=tmp_path)
    assert verdict.verdict == "right" and verdict.judged_by == "inside t5gemma2", verdict.verdict
    assert "judged inside t5gemma2 (its decoder)" in verdict.detail


def test_a_sub_config_the_nesting_model_never_builds_from_is_not_judged(tmp_path):
    """Idefics declares its perceiver config as a sub-config but builds no module from it by default (no
    resampler): the type stays unbuildable, with that reason, never counted right on the strength of the
    nesting type's own attention."""
    verdict = census_one("idefics_perciever", work=tmp_path)
    assert verdict.kind == "unbuildable", verdict.verdict
    assert verdict.reason == "built only inside a type that leaves it out", verdict.verdict


def test_a_sub_config_whose_modules_hold_no_attention_is_none(tmp_path):
    """Gemma 4 unified builds its audio embedder from its audio config (given): no attention module in it,
    the nesting type right: the sub-config's verdict is none, never right."""
    verdict = census_one("gemma4_unified_audio", work=tmp_path)
    assert verdict.kind == "none" and verdict.judged_by == "inside gemma4_unified", verdict.verdict
    assert "Gemma4UnifiedAudioConfig" in verdict.verdict


def test_a_shared_block_changed_for_the_last_layer_must_be_named(tmp_path, monkeypatch):
    """Zamba's hybrid layers 2 and 7 run one shared attention block (tied weights, stored once): --layers -1
    re-initializes it, which changes layer 2 too. The census accepts that only because the report says so;
    with surgeon's note dropped, the same run is a silent change outside the selection."""
    from surgeon.plan import planner

    assert census_one("zamba", work=tmp_path).verdict == "right"
    monkeypatch.setattr(planner, "_layer_notes", lambda *args, **kwargs: [])
    verdict = census_one("zamba", work=tmp_path)
    assert verdict.kind == "wrong", verdict.verdict
    assert "layers.2.shared_transf.self_attn changed, not in the last layer" in verdict.detail, verdict.detail
