"""Per-type settings for the census (:mod:`helpers.census`): sizes a type's config ties together that the
generic shrink cannot keep in step, and values a type's default config lacks that its own code needs (a real
checkpoint's config.json has them). Each is set after the shrink (a dotted key sets a sub-config's: ``text_config.
hidden_size``); a top-level key is also given when the config is created (a default its own validator refuses).
Each entry says which rule of the type's own config, or which read of its own code, it satisfies.
"""

from __future__ import annotations

# [kernel, stride, padding] per convolution of PP-OCR's detection neck, as its released det config.json has them
_INTRACLASS_BLOCK = {
    "reduce_channel": [1, 1, 0],
    "return_channel": [1, 1, 0],
    "vertical_long_to_small_conv_longratio": [[7, 1], [1, 1], [3, 0]],
    "vertical_long_to_small_conv_midratio": [[5, 1], [1, 1], [2, 0]],
    "vertical_long_to_small_conv_shortratio": [[3, 1], [1, 1], [1, 0]],
    "horizontal_small_to_long_conv_longratio": [[1, 7], [1, 1], [0, 3]],
    "horizontal_small_to_long_conv_midratio": [[1, 5], [1, 1], [0, 2]],
    "horizontal_small_to_long_conv_shortratio": [[1, 3], [1, 1], [0, 1]],
    "symmetric_conv_long_longratio": [[7, 7], [1, 1], [3, 3]],
    "symmetric_conv_long_midratio": [[5, 5], [1, 1], [2, 2]],
    "symmetric_conv_long_shortratio": [[3, 3], [1, 1], [1, 1]],
}
_PP_OCR_DET = {
    "intraclass_block_config": _INTRACLASS_BLOCK,
    "scale_factor_list": [1, 2, 4, 8],
    "kernel_list": [3, 2, 2],
}
# rotary parameters per layer type (the rotary embedding reads rope_parameters[layer_type]); a 16-wide head's
# multimodal sections
_COMPASS_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 50000.0, "mrope_section": [4, 2, 2]}}
# the sizes of Qwen4-exp's QSA indexer, which its default layer_types use and its default config leaves unset
_QSA = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}

_GEMMA3N_TYPES = ["sliding_attention"] * 4 + ["full_attention"]
# DaViT (Florence-2's vision tower): per-stage widths, heads and channel-attention groups, one entry per stage;
# 32-wide heads and groups as released (embed_dim[i] / num_heads[i] == 32)
_DAVIT = {"embed_dim": [32, 64, 128, 256], "num_heads": [1, 2, 4, 8], "num_groups": [1, 2, 4, 8]}
# Apertus 1.5's VQ encoder: per-stage widths are base_channels * channel_multiplier (GroupNorm(32) needs multiples
# of 32); the codebook vectors' embed_dim and the encoder's latent_channels are free sizes
_APERTUS_VQ = {"base_channels": 32, "latent_channels": 32, "embed_dim": 32}

TYPE_SETTINGS: dict[str, dict[str, object]] = {
    "florence_vision": dict(_DAVIT),
    "florence2": {f"vision_config.{k}": v for k, v in _DAVIT.items()},
    # VibeVoiceConfig ties diffusion_head_config.hidden_size to text_config.hidden_size (its validator)
    "vibevoice": {"diffusion_head_config.hidden_size": 64},
    # the VQ attention's width (hidden_size) is base_channels * channel_multiplier[-1], as Emu3's vq_config
    "emu3_vqgan": {"base_channels": 32, "hidden_size": 128, "num_attention_heads": 1},
    "apertus1p5_vision_tokenizer": {**_APERTUS_VQ, "codebook_size": 1024},
    # its validator runs at creation: image_token_offset + the vision codebook_size == audio_token_offset keeps
    # the default offsets, and the vocabulary reaches audio_token_offset + the audio codebook_size;
    # output_vocab_size (within vocab_size) is the LM head's width
    "apertus1p5": {
        "text_config.vocab_size": 262344 + 1024,
        "text_config.output_vocab_size": 1024,
        "audio_config.codebook_size": 1024,
        **{f"vision_config.{k}": v for k, v in _APERTUS_VQ.items()},
    },
    # adapter_in_dim == the vision width, adapter_input_size == the audio width, both adapters' out_dim == the
    # text width (its validators); swa_* are the released checkpoints' top-level keys for the sliding layers
    # (key/value heads == heads, its validator); the MLA ranks and indexer heads are free sizes
    "dots3_note": {
        "vision_config.adapter_in_dim": 64,
        "vision_config.adapter_out_dim": 64,
        "audio_config.adapter_input_size": 64,
        "audio_config.adapter_out_dim": 64,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 128,
        "swa_kv_lora_rank": 64,
        "text_config.q_lora_rank": 128,
        "text_config.kv_lora_rank": 64,
        "text_config.index_n_heads": 4,
    },
    # Mamba hybrids whose default places no attention layer (Bamba-9B's own config places [9, 18, 27];
    # granite-4.0-h mixes both)
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
    # n_input_layers + n_recurrent_layers + n_output_layers == num_hidden_layers
    "dory": {"num_hidden_layers": 4, "n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    # adapter_input_size == hidden_size (given together: top-level keys go in at creation too)
    "dots3_note_audio_encoder": {"hidden_size": 64, "num_attention_heads": 4, "adapter_input_size": 64},
    # adapter_in_dim == hidden_size
    "dots3_note_vision_encoder": {"hidden_size": 64, "num_attention_heads": 4, "adapter_in_dim": 64},
    # hidden_size == out_features[-1]: its four stages kept, one block each
    "efficientloftr": {"num_attention_layers": 2, "stage_num_blocks": [1, 1, 1, 1]},
    # adaptor_config.intermediate_size == text_config.hidden_size // 4
    "fun_asr_nano": {"adaptor_config.intermediate_size": 16},
    # its validator wants no per-layer inputs, which its own default has (given at creation)
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # a tower's output width == text_config.hidden_size
    "granite_docling": {"vision_config.out_hidden_size": 64},
    "llava_onevision1_5": {"vision_config.out_hidden_size": 64},
    "inkling2": {"vision_config.text_hidden_size": 64},
    "inkling2_loop": {"vision_config.text_hidden_size": 64},
    "muse_spark": {"audio_config.out_hidden_size": 64},
    # index_layers are derived for 5 layers; index_num_heads <= num_attention_heads // num_key_value_heads
    "kolibri1_1": {"num_hidden_layers": 5, "index_num_heads": 2},
    # Mimi's depthwise upsample: groups == its width
    "csm": {"codec_config.upsample_groups": 64},
    # KV-shared layers (as its checkpoints have them) need an earlier layer of each type producing the cache
    "gemma3n_text": {
        "num_hidden_layers": 10,
        "num_kv_shared_layers": 5,
        "layer_types": _GEMMA3N_TYPES + _GEMMA3N_TYPES,
        "intermediate_size": [128] * 10,
        "activation_sparsity_pattern": [0.95] * 5 + [0.0] * 5,
    },
    # attention_hidden_size == 2 * hidden_size; two hybrid layers share the one attention block
    "zamba": {
        "attention_hidden_size": 128,
        "num_hidden_layers": 8,
        "layers_block_type": ["linear_attention", "linear_attention", "hybrid"] + ["linear_attention"] * 4 + ["hybrid"],
    },
    # ChameleonImageVocabularyMapping calls vocab_map.get: the image token's id, inside the vocabulary
    "chameleon": {"vocabulary_map": {"<image>": 8711}},
    "cohere_compass": {"text_config.rope_parameters": _COMPASS_ROPE},
    "cohere_compass_text": {"rope_parameters": _COMPASS_ROPE},
    # the attention reads attn_config.rope_theta and clamps by clip_qkv; DbrxConfig sets ffn_config.hidden_size
    # to d_model when it is built, which the shrink does not keep in step
    "dbrx": {
        "attn_config.rope_theta": 500000.0,
        "attn_config.clip_qkv": 8.0,
        "ffn_config.hidden_size": 64,
        "ffn_config.ffn_hidden_size": 128,
    },
    # the decoder layer indexes mlp_layer_types (the first layer dense, the rest sparse)
    "deepseek_ocr2": {"text_config.mlp_layer_types": ["dense", "sparse"]},
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    # its default config makes every fourth latent-attention layer rotary-free (no_rope_layers, 0: no rotary part,
    # modeling_mistral_large4.py), which two shrunk layers would not reach: the second of them rotary-free
    "mistral_large4_text": {"no_rope_layers": [1, 0]},
    "mistral_large4": {"text_config.no_rope_layers": [1, 0]},
    # the shrink leaves 8 expert groups over 4 experts (none per group): one group, as DeepSeek-V2-Lite's config
    "axk1": {"n_group": 1, "topk_group": 1},
    # a denoiser's rotary needs 3 * 2 + 10 pairs (its validator: head_dim >= 32); the diffusion module's atom
    # encoder outputs its hidden_size
    "esmfold2": {
        "atom_encoder.num_attention_heads": 2,
        "atom_encoder.head_dim": 32,
        "structure_head.diffusion_module.atom_encoder.num_attention_heads": 2,
        "structure_head.diffusion_module.atom_encoder.head_dim": 32,
        "structure_head.diffusion_module.atom_encoder.output_dim": 64,
    },
    # no feature levels by default (projector_scale_factors=()): LW-DETR's own tiny/small/medium configs use one
    "lw_detr": {"projector_scale_factors": [1.0]},
    # the diarization head reads the audio encoder's features: its audio_hidden_size is the encoder's width
    "nemo_speechlm": {"audio_config.diarization_config.head_config.audio_hidden_size": 64},
    # the conformer's pointwise and depthwise-separable convolutions output hidden_size channels
    "phi4_multimodal": {
        "audio_config.ext_pw_out_channel": 64,
        "audio_config.depthwise_separable_out_channel": 64,
    },
    "phi4_multimodal_audio": {"ext_pw_out_channel": 64, "depthwise_separable_out_channel": 64},
    # the config recomputes intermediate_size = int(hidden_size * mlp_ratio) when it loads: 373 for a width of 64
    "step3p5_vision": {"intermediate_size": 373},
    "step3p7": {"vision_config.intermediate_size": 373},
    # the vocabulary mapping needs its map (the eol token); the VQ attention's width (vq_config.hidden_size) is
    # base_channels * channel_multiplier[-1]
    "emu3": {
        "vocabulary_map": {"<|extra_200|>": 151846},
        "vq_config.base_channels": 32,
        "vq_config.hidden_size": 128,
        "vq_config.num_attention_heads": 1,
    },
    # one Q-Former projector per [vision layer, language layer] pair; the projector splits downsample_rate "q/w"
    "granite4_vision": {"deepstack_layer_map": [[-1, 0]], "downsample_rate": "1/4"},
    # the decoder layer indexes layer_types (None by default): LFM2-MoE's own prefix, conv, conv, attention
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "conv", "full_attention"]},
    # the decoder reads config.num_key_value_heads, which the config class does not declare
    "moonshine_streaming": {"num_key_value_heads": 4},
    # _init_weights reads initializer_range (Pix2StructConfig hands it to its text_config)
    "pix2struct_text_model": {"initializer_range": 0.02},
    # the neck and head index these three (None by default)
    "pp_ocrv5_server_det": _PP_OCR_DET,
    # and a detection backbone: four stage outputs at strides 4 to 32 (the released stem and stages, 2 blocks each)
    "pp_ocrv6_medium_det": {
        "backbone_config.out_features": ["stage1", "stage2", "stage3", "stage4"],
        "backbone_config.stem_channels": [3, 64, 128],
        "backbone_config.block_configs": [
            [[3, 128, 128, 1, True], [3, 128, 128, 1, False]],
            [[3, 128, 256, 2, False], [3, 256, 256, 1, True]],
            [[3, 256, 512, 2, False], [3, 512, 512, 1, True]],
            [[3, 512, 896, 2, False], [3, 896, 896, 1, True]],
        ],
        "backbone_config.depths": [2, 2, 2, 2],
        "backbone_config.stage_out_channels": [128, 256, 512, 896],
        **_PP_OCR_DET,
    },
    # the talker's MoE reads shared_expert_intermediate_size, the talker spatial_merge_size: neither declared
    "qwen3_omni_moe": {
        "talker_config.text_config.shared_expert_intermediate_size": 128,
        "talker_config.spatial_merge_size": 2,
    },
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": 128},
    "qwen4_exp": {f"text_config.{k}": v for k, v in _QSA.items()},
    # head_dim from the start too: its validator wants the rotary size within indexer_head_dim
    "qwen4_exp_text": {"head_dim": 16, **_QSA},
    # the model reads dropout_rate (T5Gemma2Config hands it to its encoder's text_config)
    "t5gemma2_encoder": {"text_config.dropout_rate": 0.0},
    # the code concatenates a list and these (config.json gives lists; the defaults are tuples)
    "vitmatte": {"convstream_hidden_sizes": [48, 96, 192], "fusion_hidden_sizes": [256, 128, 64, 32]},
}
