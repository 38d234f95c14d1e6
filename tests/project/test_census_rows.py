"""One test per family row the census turned from a refusal or a silent wrong answer into a right one: the
type is built tiny with transformers' own code and judged by the attention its own forward runs
(tests/helpers/census.py), never by surgeon's tables. Each fails with its row removed from surgeon/detect."""

from __future__ import annotations

import pytest

import surgeon
from surgeon.errors import SelectionError

from helpers.census import build, census_one

ROWS = {
    "convbert": "HEAD_RATIOS: heads divided by head_ratio",
    "maskformer": "SUBCONFIG_WORDS backbone_config via pixel_level_module, decoder_config by its stem",
    "blip-2": "a nested config named by its key's stem (qformer -> qformer_config)",
    "depth_pro": "image_encoder -> image_model_config",
    "dia": "cross-attention's own keys (cross_num_attention_heads, cross_head_dim)",
    "granite_speech": "HEAD_DIM_KEYS dim_head",
    "gemma4_unified_text": "PER_LAYER_CONFIG_KEYS: Gemma-4's per_layer_config head sizes",
    "laguna": "PER_LAYER_SUFFIX: num_attention_heads_per_layer",
    "inkling_text": "LAYER_TYPE_PREFIXES: swa_ keys of the sliding layers",
    "cpmant": "rule project_q/project_k/project_v",
    "ctrl": "rule Wq/Wk/Wv",
    "deberta": "rule in_proj + q_bias/v_bias (interleaved per head)",
    "fastspeech2_conformer": "rule linear_q/linear_k/linear_v",
    "groupvit": "MODULE_FACTS: the token assignment is one cross head",
    "bridgetower": "HEAD_WIDTHS and SUBCONFIG_BY_PATH",
    "video_llava": "SUBCONFIG_BY_PATH video_tower -> vision_config",
    "colpali": "transformers' defaults where config.json leaves a tower's heads out",
    "lw_detr": "decoder_self_attention_heads",
    "cvt": "rule projection_query/projection_key/projection_value",
    "hrm_text": "rule gqkv_proj, packing gate_qkv ([gate | Q | K | V])",
    "moshi": "rule q_proj.linear/k_proj.linear/v_proj.linear (a Linear inside a wrapper module)",
    "inkling2_text": "rule wq_du/wk_dv/wv_dv, NO_PROJECTION_ATTENTION attn_queries",
    "mimo_v2_flash": "V_HEAD_DIM_KEYS v_head_dim, LAYER_TYPE_SCALES (sliding layers' kv heads)",
    "sam2_hiera_det_model": "BLOCKS_PER_STAGE_KEYS and num_attention_heads_per_stage over a flat block list",
    "hiera": "the head size from the tensor's own width (a pyramid stage narrower than hidden_size)",
    "deimv2": "HEAD_DIM_SIDE: the config's head_dim is the decoder's",
    "t5gemma2": "SUBCONFIG_BY_PATH, a whole stack path (encoder.layers -> encoder.text_config)",
    "xclip": "SUBCONFIG_BY_PATH prompts_generator -> prompt_*",
    "edgetam_video": "SUBCONFIG_BY_PATH spatial_perceiver -> perceiver_resampler_*",
    "unlimited_ocr_vision": "SUBCONFIG_BY_PATH vision_encoder -> encoder_config",
    "sarvam_moe": "FUSED_PACKING_BY_MODEL_TYPE: query_key_value split into [Q | K | V] by their sizes",
    "mistral_large4_text": "LATENTS: Mistral's wq/wkv_a_with_mqa/wkv_b spelling of latent attention",
    "nemo_speechlm": "rule w_qkv ([Q | K | V])",
    "glm4_moe_lite": "LATENTS: latent attention with a query latent (q_a_proj/q_b_proj)",
    "idefics2": "SUBCONFIG_BY_PATH connector -> perceiver_config.resampler_* with its own num_key_value_heads",
    "idefics2_perceiver": "SUBCONFIG_BY_PATH layers -> resampler_*",
    "kimi_k25": "rule fused wqkv beside attn.proj, FUSED_PACKING_BY_MODEL_TYPE (wqkv, kimi_k25_vision): [Q | K | V]",
    "ergo": "rule fused wqkv beside wo, FUSED_PACKING_BY_MODEL_TYPE (wqkv, ergo): [Q | K | V] by head counts",
    "qwen2_5_omni": "SUBCONFIG_BY_PATH thinker.model.layers and token2wav's DiT, whole stack paths",
    "qwen3_omni_moe": "SUBCONFIG_BY_PATH thinker's and talker's language models, code predictor, code2wav",
}


@pytest.mark.parametrize("model_type", sorted(ROWS))
def test_row_makes_the_type_right(model_type, tmp_path):
    verdict = census_one(model_type, work=tmp_path)
    assert verdict.verdict in ("right", "unjudged") or verdict.verdict.startswith("unjudged"), (
        f"{ROWS[model_type]}: {verdict.verdict} {verdict.detail}"
    )
    assert not verdict.verdict.startswith("unjudged: the forward did not run"), verdict.verdict


def test_one_unreadable_block_refuses_only_a_selection_that_includes_it(tmp_path):
    """Reformer's LSH attention (layer 1: one shared query_key projection) is no layout surgeon reads:
    --layers all is refused naming it; layer 0's local attention alone is re-initialized, and every tensor
    of layer 1 stays byte for byte."""
    from safetensors.torch import load_file

    build("reformer", tmp_path / "model")
    with pytest.raises(
        SelectionError, match=r"encoder\.layers\.1\.attention\.self_attention.*leave it out of the selection"
    ):
        surgeon.reinit_checkpoint(tmp_path / "model", layers="all", output=tmp_path / "all")
    assert not (tmp_path / "all").exists()
    report = surgeon.reinit_checkpoint(tmp_path / "model", layers="0", output=tmp_path / "out")
    assert any("left untouched" in n and "encoder.layers.1.attention.self_attention" in n for n in report.notes)
    before = load_file(next((tmp_path / "model").glob("*.safetensors")))
    after = load_file(next((tmp_path / "out").glob("*.safetensors")))
    changed = {n for n in before if not (before[n] == after[n]).all()}
    assert changed and all(n.startswith("encoder.layers.0.attention.") for n in changed), sorted(changed)[:4]
