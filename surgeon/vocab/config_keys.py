"""How config files spell each fact detection reads: config.json's keys for heads, head size and width (per
tower, per layer type, per layer, per stage), the families whose fused packing or head count depends on their
model type, Megatron-LM's legacy query_key_value by checkpoint version, and training frameworks' own config
files read in config.json's terms (:func:`framework_config`, shared by opening a checkpoint and detecting a
module; :func:`nested` reads a dotted path into nested entries).

Nothing here imports torch, numpy or onnx.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HEADS_KEYS = ("num_attention_heads", "num_heads", "n_head", "n_heads", "attention_heads", "heads")
KV_HEADS_KEYS = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_head_kv",
    "kv_n_heads",
    "num_kv_heads_per_layer",
    "multi_query_group_num",
    "n_kv_head",  # nanochat (gpt.py GPTConfig)
)
HEAD_DIM_KEYS = ("head_dim", "d_kv", "attention_head_dim", "kv_channels", "head_size", "dim_head")
# Where the value heads are of another size than query and key (MiMo-V2-Flash: v_head_dim), read for a
# separate value projection only
V_HEAD_DIM_KEYS = ("v_head_dim",)
# A config key that divides the attention's heads, and how much of the width those heads keep: ConvBERT
# (modeling_convbert.py ConvBertSelfAttention) computes max(1, num_attention_heads // head_ratio) heads of
# (hidden_size // heads) // 2; the other half of the width goes to its span-based convolution. Only
# ConvBERT's config has head_ratio (transformers 5.24).
# Families whose config head_dim describes one side only (D-FINE, DEIMv2: d_model // decoder_attention_heads,
# configuration_d_fine.py); the other side's attention derives its own from its width.
HEAD_DIM_SIDE = {"d_fine": "decoder", "deimv2": "decoder"}
HEAD_RATIOS = {"head_ratio": 2}  # key -> the width divisor
# Families whose code derives the heads from the width, by model type: BridgeTower's vision tower runs
# nn.MultiheadAttention(hidden_size, hidden_size // 64) (modeling_bridgetower.py), its config has no heads.
# Attention that runs as many heads as a config key other than its heads says: DaViT's channel attention (Florence-2's
# vision tower, modeling_florence2.py Florence2VisionChannelAttention) splits its channels into num_groups groups.
# Read as num_heads where the two agree (every released config); refused where they differ.
GROUP_HEADS = {"channel_attn": "num_groups"}
HEAD_WIDTHS = {"bridgetower_vision_model": 64}
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "width")
# Where a tower's config is nested (CLIP, SigLIP, LLaVA, encoder-decoder wrappers): the words in a
# stack's module path that select it.
SUBCONFIG_WORDS = {
    "text_config": ("text", "language", "llm"),
    "vision_config": ("vision", "visual", "image"),
    "audio_config": ("audio", "speech"),
    "encoder": ("encoder",),
    "decoder": ("decoder",),
    # a detection or segmentation model's backbone (MaskFormer, Mask2Former, OneFormer keep it in
    # pixel_level_module.encoder): its heads are the backbone's own, often one per stage
    "backbone_config": ("backbone", "pixel_level_module"),
}
# Towers whose heads another tower's config gives, by model type and the path word that holds them
# (the modeling file named builds that module from that config): Aria's projector cross-attention runs
# config.vision_config.num_attention_heads heads (modeling_aria.py). The config may be nested ("a.b"); a
# "key/prefix" takes the keys of that config under a prefix (X-CLIP's mit: vision_config.mit_num_attention_heads);
# a whole stack path (with a dot) names the config of that stack alone.
SUBCONFIG_BY_PATH = {
    "aria": {"multi_modal_projector": "vision_config"},  # AriaCrossAttention: vision_config.num_attention_heads
    "bridgetower": {"cross_modal_image_layers": "text_config", "cross_modal_text_layers": "text_config"},
    "clvp": {"conditioning_encoder": "decoder_config"},  # mel_attn_blocks: ClvpSelfAttention(decoder_config)
    "deepseek_ocr2_vision": {"vision_encoder": "encoder_config", "sam_encoder": "sam_config"},
    "ernie4_5_vl_moe": {"layers": "text_config"},  # the language model's layers at the top level
    "grounding-dino": {"text_backbone": "text_config"},
    "mm-grounding-dino": {"text_backbone": "text_config"},
    "pix2struct": {"decoder": "text_config", "encoder": "vision_config"},
    "pp_formulanet": {"decoder": "text_config", "encoder": "vision_config"},
    # the checkpoint's own names: sam_model (SAM encoder), vision_model (CLIP encoder), layers (language model)
    "unlimited_ocr": {
        "layers": "text_config",
        "sam_model": "vision_config.sam_config",
        "vision_model": "vision_config.encoder_config",
    },
    "video_llava": {"video_tower": "vision_config"},  # video and image towers: one CLIP vision config
    "xclip": {"mit": "vision_config/mit_", "prompts_generator": "/prompt_"},  # multi-frame integration, prompts
    "x_clip": {"mit": "vision_config/mit_", "prompts_generator": "/prompt_"},
    "edgetam_video": {"spatial_perceiver": "/perceiver_resampler_"},  # EdgeTamVideoPerceiverResampler
    # the structure head is built from its diffusion_module config, its atom decoder's layers from that
    # config's atom_encoder (modeling_esmfold2.py EsmFold2AtomDecoder)
    "esmfold2": {
        "structure_head": "structure_head.diffusion_module",
        "structure_head.atom_decoder.layers": "structure_head.diffusion_module.atom_encoder",
    },
    "t5gemma2": {"encoder.layers": "encoder.text_config"},  # the encoder's text layers; its vision tower apart
    "unlimited_ocr_vision": {"vision_encoder": "encoder_config", "sam_encoder": "sam_config"},
    "videoprism": {"video_model": "vision_config"},
    # the protein encoder's resampler runs resampler_heads heads of resampler_dim_head (modeling_evolla.py
    # EvollaSequenceCompressorResampler), not its protein_encoder_config's heads
    "evolla": {"protein_encoder.sequence_compressor_resampler.layers": "/resampler_"},
    "vjepa2": {"predictor": "/pred_"},  # the predictor: pred_num_attention_heads, pred_hidden_size
    # JEV (modeling_jev.py JevForDecision): its model is built from text_config (Qwen3.5 by default), under model
    "jev": {"model": "text_config"},
    # Gemma 3n's audio conformer (modeling_gemma3n.py Gemma3nAudioAttention): conf_num_attention_heads heads over
    # hidden_size; in the whole model, its audio tower is built from audio_config
    "gemma3n_audio": {"conformer": "/conf_"},
    "gemma3n": {"audio_tower.conformer": "audio_config/conf_"},
    # Idefics2PerceiverAttention: perceiver_config.resampler_n_heads heads of resampler_head_dim (modeling_idefics2.py),
    # not the vision or text tower's heads; its key/value heads follow from k_proj's rows
    "idefics2": {"connector": "perceiver_config/resampler_"},
    "idefics2_perceiver": {"layers": "/resampler_"},
    # Qwen2.5-Omni (modeling_qwen2_5_omni.py): the thinker's language model is built from thinker_config.text_config,
    # token2wav's DiT from its dit_config
    "qwen2_5_omni": {
        "thinker.model.layers": "thinker_config.text_config",
        "token2wav.code2wav_dit_model.transformer_blocks": "token2wav_config.dit_config",
    },
    "qwen2_5_omni_token2wav": {"code2wav_dit_model.transformer_blocks": "dit_config"},
    # the checkpoint's own names, as its head class saves them (transformers' conversion mappings rename them at
    # load): HunYuan-VL's vision tower under vit, Nemotron-3.5-Transcribe's word-timestamp encoder under ctc_timestamp
    "hunyuan_vl": {"vit": "vision_config"},
    "nemo_speechlm": {
        "ctc_timestamp.decoder.transformer.layers": "word_timestamp_config",
        "perception.encoder.asr_encoder.layers": "audio_config.asr_config",
        "perception.encoder.diarization_model.encoder.layers": "audio_config.diarization_config.audio_config",
        "word_timestamp_encoder": "word_timestamp_config",
    },
    # Qwen3-Omni-MoE (modeling_qwen3_omni_moe.py): the thinker's language model from thinker_config.text_config, the
    # talker's from talker_config.text_config, its code predictor from talker_config.code_predictor_config,
    # code2wav's pre-transformer from code2wav_config
    "qwen3_omni_moe": {
        "thinker.model.layers": "thinker_config.text_config",
        "talker.model.layers": "talker_config.text_config",
        "talker.code_predictor.model.layers": "talker_config.code_predictor_config",
        "code2wav.pre_transformer.layers": "code2wav_config",
    },
}
# Megatron-LM's legacy (pre-Core) models: how query_key_value packs its rows, by the checkpoint_version saved beside
# them (model_optim_rng.pt's checkpoint_version; Megatron's loader reads a missing one as 0). Its
# checkpointing.py fix_query_key_value_ordering converts versions below 2.0 on load: 0 stored the rows as
# [3, heads, d] (Q | K | V blocked), 1.0 as [heads, d, 3] (q, k, v alternating row by row: no packing surgeon
# writes, refused naming the version). 2.0 and 3.0 are read as stored: legacy/model/transformer.py
# ParallelAttention views the rows as [query groups, (heads per group + 2) * d], per group [q heads | k | v]
# (2.0 predates grouped-query attention: one group per head, per head [q | k | v]).
MEGATRON_VERSION = "checkpoint_version"  # Megatron's own key, which formats.torchfile carries into the config
MEGATRON_LEGACY_QKV = {0.0: "qkv", 2.0: "grouped", 3.0: "grouped"}
# How a fused tensor packs q/k/v where a family departs from the default of its tensor name
# (blocks.PACKINGS); flag-dependent families (Falcon, ChatGLM, GPTBigCode) are in ConfigView.fused_packing.
FUSED_PACKING_BY_MODEL_TYPE = {
    ("query_key_value", "gpt_neox"): "interleaved",
    ("query_key_value", "gpt_neox_japanese"): "interleaved",
    ("query_key_value", "bloom"): "interleaved",
    ("query_key_value", "persimmon"): "interleaved",
    ("query_key_value", "sarvam_moe"): "qkv",  # Split(dim=0) into q/k/v by their sizes (conversion_mapping.py)
    # litgpt (model_config.yaml, FRAMEWORK_CONFIGS): 0.5's qkv splits into [Q | K | V] (model.py
    # CausalSelfAttention.forward: qkv.split((n_head, n_query_groups, n_query_groups) * head_size)); the older attn
    # and the query_key_value of its GPT-NeoX/Falcon exports (scripts/convert_lit_checkpoint.py qkv_reassemble)
    # are per query group [its query heads | key | value]
    ("qkv", "litgpt"): "qkv",
    ("attn", "litgpt"): "grouped",
    ("query_key_value", "litgpt"): "grouped",
    ("qkv_proj", "codegen"): "codegen",
    # Kimi-K2.5's vision tower: Chunk(dim=0) into q/k/v_proj (conversion_mapping.py)
    ("wqkv", "kimi_k25_vision"): "qkv",
    ("wqkv", "ergo"): "qkv",  # renamed to qkv_proj, split (heads, kv heads, kv heads) per head (modeling_ergo.py)
    # gated attention: q_proj holds per head [query | gate] (view(..., -1, 2 * head_dim).chunk(2))
    ("q_proj", "qwen3_next"): "gated",
    ("q_proj", "qwen3_5_text"): "gated",
    ("q_proj", "qwen3_5_moe_text"): "gated",
    ("q_proj", "qwen4_exp_text"): "gated",
}

# Why a fused tensor of packing "auto" needs the config, by tensor name (the refusal names --config).
AUTO_PACKING_WHY = {
    "query_key_value": "it is interleaved per head in GPT-NeoX/Bloom and grouped in Falcon",
    "attn": "litgpt before 0.5 groups it per query group, but its name alone does not say it is litgpt's",
    "wqkv": "Kimi-K2.5's vision tower and Ergo stack [Q | K | V], torchtitan groups it per key/value head",
}


# --- training frameworks' own config files ------------------------------------------------------
@dataclass(frozen=True)
class FrameworkConfig:
    """A framework's config file beside its weights, read in config.json's terms: ``fields`` maps its
    field (a dotted path into nested entries) to config.json's key; ``model_type`` names the family
    (FUSED_PACKING_BY_MODEL_TYPE)."""

    file: str
    weights: str  # the framework's own weight file, for which this config wins over a config.json beside it
    config_classes: tuple[str, ...]  # its config objects' classes in memory (a model's ``config``), module.qualname
    model_type: str
    fields: dict[str, str]


FRAMEWORK_CONFIGS = (
    # litgpt: utils.py save_config writes asdict(litgpt.Config) as YAML beside lit_model.pth (pretrain, finetune,
    # convert_hf_checkpoint); n_query_groups is its key/value heads, head_size filled in by Config.__post_init__
    FrameworkConfig(
        "model_config.yaml",
        "lit_model.pth",
        ("litgpt.config.Config", "litgpt.lora.Config"),  # a LoRA model's is refused by its tensors (REFUSED)
        "litgpt",
        {
            "n_head": "num_attention_heads",
            "n_query_groups": "num_key_value_heads",
            "head_size": "head_dim",
            "n_embd": "hidden_size",
            "n_layer": "num_hidden_layers",
            # multi-head latent attention (model.py MultiheadLatentAttention): its sizes nest in one entry
            **{
                f"latent_attention.{k}": k
                for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
            },
        },
    ),
)


def framework_config(framework: FrameworkConfig, data: Mapping[str, Any]) -> dict:
    """A framework's own config (its file's fields, or its config object's attributes) in config.json's terms:
    the family's model type and the counts its FRAMEWORK_CONFIGS entry maps."""
    facts = {key: nested(dict(data), field) for field, key in framework.fields.items()}
    counts = {k: v for k, v in facts.items() if isinstance(v, int) and not isinstance(v, bool)}
    return {"model_type": framework.model_type, **counts}


def nested(scope: dict, path: str) -> Any:
    """The entry of ``scope`` at a dotted path of keys ("structure_head.diffusion_module"), or None."""
    value: Any = scope if path else None
    for key in path.split(".") if path else ():
        value = value.get(key) if isinstance(value, dict) else None
    return value


# --- layers whose facts differ from the stack's ------------------------------------------------
# Config lists naming each layer's type (Qwen3-Next, Kimi-Linear, Gemma, Inkling).
LAYER_TYPE_KEYS = ("layer_types", "layers_block_type")
# Layer types that are not softmax attention: their projections (often q_proj/k_proj/v_proj too, e.g.
# Kimi-Linear's delta attention) are left alone, with a note.
LINEAR_LAYER_TYPES = ("linear_attention",)
# Layer types whose heads use keys of their own, by the prefix those keys carry: Inkling's sliding layers
# ("hybrid_sliding") run swa_num_attention_heads heads of swa_head_dim (modeling_inkling.py).
LAYER_TYPE_PREFIXES = {"hybrid_sliding": "swa_"}
# Layer types whose facts a family's code scales from the config's: (model type, layer type) -> key -> factor.
# MiMo-V2-Flash's sliding layers run twice num_key_value_heads (modeling_mimo_v2_flash.py).
LAYER_TYPE_SCALES = {("mimo_v2_flash", "sliding_attention"): {"num_key_value_heads": 2}}
# Per-layer overrides: a dict from layer number to facts (Gemma-4's per_layer_config, {"05": {"head_dim":
# 512}}: its full-attention layers' head size), or a list per layer of a fact (Laguna's
# num_attention_heads_per_layer: the fact is the key less this suffix).
PER_LAYER_CONFIG_KEYS = ("per_layer_config",)
PER_LAYER_SUFFIX = "_per_layer"
# Latent attention layers a family's code builds without a rotary part, by model type: the config list that marks
# them and the entry that does. Mistral Large 4 (modeling_mistral_large4.py MistralLarge4TextAttention): where
# no_rope_layers[i] is 0 (its default: every fourth layer), that layer's qk_rope_head_dim is 0 and its
# qk_nope_head_dim is qk_nope_head_dim + qk_rope_head_dim, so kv_b_proj holds per head that many key rows; its
# queries keep qk_nope_head_dim + qk_rope_head_dim rows per head.
ROTARY_FREE_LATENT_LAYERS = {"mistral_large4_text": ("no_rope_layers", 0)}
# Per-stage lists over one flat list of blocks: the key that gives each stage's number of blocks, and the
# suffix of the per-stage lists it indexes, read as the fact less the suffix for a block of that stage (SAM 2's
# Hiera: blocks_per_stage, num_attention_heads_per_stage, beside a stale scalar num_attention_heads).
BLOCKS_PER_STAGE_KEYS = ("blocks_per_stage",)
PER_STAGE_SUFFIX = "_per_stage"
