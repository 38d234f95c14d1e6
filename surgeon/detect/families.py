"""Every family fact surgeon knows, as data: adding a model family or a fused layout happens here.

* :data:`RULES`: tensor names (relative to the attention module) that hold the projections, and how
  each packs its (role, head) slots (a key of :data:`surgeon.vocab.blocks.PACKINGS`).
* :data:`SAVED_SPLIT`: fused tensors in memory that a framework saves split per role (the draws' names).
* :data:`CROSS_WORDS`: module-path words that mark cross-attention.
* :data:`KV_SLOTS`: for each packing, how many key/value heads a tensor of ``slots`` head-sized
  blocks holds (used to infer grouped-query attention from shapes).

How config files spell heads, head size and width is in :mod:`surgeon.vocab.config_keys`.

Nothing here imports torch, numpy or onnx.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..vocab.blocks import SET_TAGS, STREAMS


@dataclass(frozen=True)
class Part:
    """One tensor of a layout: its weight (and bias) name under the attention module."""

    weight: str
    bias: str | None
    packing: str  # a key of blocks.PACKINGS, or "auto" (query_key_value: decided by the config)
    orientation: str = "linear"  # "linear" (out, in), "conv1d" (in, out), or "shape" (decide from shapes)
    bias_packing: str | None = None  # when the bias is packed differently (nn.MultiheadAttention)


@dataclass(frozen=True)
class Rule:
    name: str
    parts: tuple[Part, ...]
    requires: tuple[
        str, ...
    ] = ()  # other tensors the module must hold for the rule to apply (a name alone is ambiguous)


def _separate(q: str, k: str, v: str) -> Rule:
    return Rule("separate", tuple(Part(f"{m}.weight", f"{m}.bias", r) for m, r in ((q, "q"), (k, "k"), (v, "v"))))


def _fused(module: str, packing: str, orientation: str = "linear") -> Rule:
    return Rule(f"fused {module}", (Part(f"{module}.weight", f"{module}.bias", packing, orientation),))


# Tried in order at every module; rules with more tensors come first so that GPT-2's cross-attention
# (q_attn + c_attn) is not taken for a self-attention c_attn.
RULES: tuple[Rule, ...] = (
    _separate("q_proj", "k_proj", "v_proj"),  # Llama, Mistral, Qwen2, Gemma, Phi, OPT, GPT-J, BART, Whisper, CLIP
    # the Linear inside a wrapper module (Gemma-4's clippable linear, Moshi's and Inkling's projections)
    _separate("q_proj.linear", "k_proj.linear", "v_proj.linear"),
    _separate("query", "key", "value"),  # BERT, RoBERTa, ELECTRA, ViT, DeiT, Swin
    _separate("q_lin", "k_lin", "v_lin"),  # DistilBERT
    _separate("query_proj", "key_proj", "value_proj"),  # DeBERTa-v2
    _separate("wq", "wk", "wv"),  # Meta Llama reference code
    _separate("to_q", "to_k", "to_v"),  # diffusers and lucidrains-style modules
    _separate("q", "k", "v"),  # T5
    _separate(
        "linear_q", "linear_k", "linear_v"
    ),  # Conformer: wav2vec2-BERT, wav2vec2-Conformer, SeamlessM4T, FastSpeech2
    _separate("project_q", "project_k", "project_v"),  # CPM-Ant
    _separate("Wq", "Wk", "Wv"),  # CTRL
    _separate("wq_du", "wk_dv", "wv_dv"),  # Inkling 2 (checkpoint names; the model's are q_proj.linear, ...)
    _separate("q_head", "k_head", "v_head"),  # Funnel Transformer
    # CvT: each Linear after a depthwise convolution (and its BatchNorm) that mixes neighbouring tokens
    _separate("projection_query", "projection_key", "projection_value"),
    _separate("w_q", "w_k", "w_v"),  # OLMo-core (olmo_core/nn/attention: Attention.w_q/w_k/w_v, w_out)
    _separate("q_linear", "k_linear", "v_linear"),  # a widely copied from-scratch spelling
    _separate("c_q", "c_k", "c_v"),  # nanochat (gpt.py CausalSelfAttention: c_q, c_k, c_v, c_proj)
    # NeMo's transformer decoder (MultiHeadAttention: query_net, key_net, value_net, out_projection), as Cohere ASR
    # checkpoints store it (transformers' conversion_mapping renames them to self_attn/encoder_attn q/k/v_proj)
    _separate("query_net", "key_net", "value_net"),
    Rule(
        "fused cross c_attn",  # GPT-2 cross-attention: Conv1D q_attn, Conv1D c_attn holding [K | V]
        (Part("q_attn.weight", "q_attn.bias", "q", "conv1d"), Part("c_attn.weight", "c_attn.bias", "kv", "conv1d")),
    ),
    Rule(  # lucidrains-style (vit-pytorch, perceivers, IgFold): to_q, and to_kv chunked into [K | V]
        "fused to_kv",
        (Part("to_q.weight", "to_q.bias", "q"), Part("to_kv.weight", "to_kv.bias", "kv")),
    ),
    _fused("c_attn", "qkv", "shape"),  # GPT-2 (Conv1D), nanoGPT and GPTBigCode (Linear)
    _fused("query_key_value", "auto"),  # GPT-NeoX, Bloom (interleaved), Falcon (three layouts)
    _fused("Wqkv", "qkv"),  # MPT, ModernBERT
    _fused("qkv_proj", "qkv"),  # Phi-3
    _fused("qkv", "qkv"),  # timm ViT, nanoGPT-style
    _fused("to_qkv", "qkv"),
    _fused("att_proj", "qkv"),  # Bark, OLMo-1: split(embed_dim) into [Q | K | V]
    _fused("w_qkv", "qkv"),  # NeMo's ASR encoder: chunk(3) into [Q | K | V] (transformers' conversion_mapping)
    _fused("gqkv_proj", "gate_qkv"),  # HRM: chunk(4) into [gate | Q | K | V] (transformers' conversion_mapping)
    # Megatron-Core (transformer/attention.py SelfAttention.get_query_key_value_tensors): rows viewed as
    # (query groups, heads per group + 2, head dim), each group [its query heads | its key | its value]; with
    # Transformer Engine the input norm's weight sits beside it (linear_qkv.layer_norm_weight), left alone
    _fused("linear_qkv", "grouped"),
    # torchtitan (models/common/attention.py FusedQKVLinear, in memory): wqkv rows viewed as (KV heads,
    # heads per KV head + 2, head dim), split [its query heads | its key | its value]; its state-dict hook
    # saves them as qkv_linear.wq/wk/wv (the separate wq/wk/wv rule)
    _fused("qkv_linear.wqkv", "grouped"),
    # Kimi-K2.5's vision tower as its checkpoints store it (MoonViT: encoder.blocks.N.wqkv beside .wo, or beside
    # .attn.proj as transformers saves a base model; its conversion_mapping chunks wqkv into q/k/v_proj, permuting
    # rows within each head for its rotary), Ergo's attention.wqkv beside .wo: the packing by model type, since
    # torchtitan's wqkv groups its rows another way
    Rule("fused wqkv", (Part("wqkv.weight", "wqkv.bias", "auto"),), requires=("wo.weight",)),
    Rule("fused wqkv, attn.proj", (Part("wqkv.weight", "wqkv.bias", "auto"),), requires=("attn.proj.weight",)),
    # litgpt before 0.5 (lit-gpt CausalSelfAttention.attn, beside .proj): grouped per query group like
    # linear_qkv, as litgpt 0.5's own loader says (model.py _load_from_state_dict: qkv_reassemble); the name
    # alone is too common to say so: the packing comes from litgpt's model_config.yaml (FUSED_PACKING_BY_MODEL_TYPE)
    Rule("fused attn", (Part("attn.weight", "attn.bias", "auto"),), requires=("proj.weight",)),
    # DeBERTa (v1): in_proj views rows as (heads, 3 * head_dim), biases in q_bias/v_bias; in_proj alone is a
    # Mamba mixer's input projection, so the biases must be there too
    Rule("fused in_proj + q_bias", (Part("in_proj.weight", None, "interleaved"),), requires=("q_bias", "v_bias")),
    Rule("fused in_proj", (Part("in_proj_weight", "in_proj_bias", "qkv"),)),  # nn.MultiheadAttention
    Rule(  # nn.MultiheadAttention with kdim/vdim != embed_dim: separate weights, one packed bias
        "separate in_proj",
        tuple(Part(f"{r}_proj_weight", "in_proj_bias", r, bias_packing="qkv") for r in "qkv"),
    ),
)

# Fused tensors in memory that a framework's state-dict hook saves split, one tensor per role (relative to the
# attention module): a model in memory draws its heads under the saved names, as its saved checkpoint does.
SAVED_SPLIT: dict[str, dict[str, str]] = {
    # torchtitan's FusedQKVLinear._split_qkv_on_save: wqkv -> wq, wk, wv
    "qkv_linear.wqkv.weight": {r: f"qkv_linear.w{r}.weight" for r in "qkv"},
}

CROSS_WORDS = (
    "encdecattention",
    "encoder_attn",
    "crossattention",
    "cross_attn",
    "cross_attention",
    "crossattn",
    "src_attn",
    "multihead_attn",
)
# Tensors that quantization libraries put beside (or instead of) a projection's float weight.
QUANT_PARAMS = (
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "SCB",
    "weight_format",
    "weight_scale",
    "weight_packed",
    "weight_zero_point",
    "absmax",
    "quant_map",
    "quant_state",
)

# packing -> (slots in the tensor, query heads) -> key/value heads it implies, or None when the
# packing cannot say. Every entry of detect.blocks.PACKINGS has one (tests/detect/test_families_table.py).
KV_SLOTS: dict[str, Callable[[int, int], int | None]] = {
    "q": lambda slots, heads: None,
    "k": lambda slots, heads: slots,
    "v": lambda slots, heads: slots,
    "qkv": lambda slots, heads: (slots - heads) // 2 if slots > heads and (slots - heads) % 2 == 0 else None,
    "grouped": lambda slots, heads: (slots - heads) // 2 if slots > heads and (slots - heads) % 2 == 0 else None,
    "kv": lambda slots, heads: slots // 2 if slots % 2 == 0 else None,
    "interleaved": lambda slots, heads: None,  # as many key/value heads as query heads
    "codegen": lambda slots, heads: None,  # as many key/value heads as query heads
    "gated": lambda slots, heads: None,  # queries and gates only
    "gate_qkv": lambda slots, heads: None,  # as many key/value heads as query heads
}


def projection_names() -> list[str]:
    """Each rule's projection tensors ("q_proj/k_proj/v_proj", "c_attn"), for "no attention found" messages."""
    return list(dict.fromkeys("/".join(p.weight.removesuffix(".weight") for p in rule.parts) for rule in RULES))


# Modules named like attention whose tensors no rule reads are named in the report; these are attention
# without a query-key product, left alone with a note rather than refused: the tensor that marks them.
NOT_QK_ATTENTION = {"sampling_offsets": "multi-scale deformable attention (sampled points, no query-key product)"}
# Attention with no query/key/value projections to re-initialize, by the module word that holds its tensors:
# named in the report as left alone. Inkling 2's attention residuals (modeling_inkling2.py
# Inkling2BlockAttentionResidual) attend from a learned query over the normalized outputs of earlier layers.
NO_PROJECTION_ATTENTION = {
    "attn_queries": "attention residuals (a learned query over earlier layers' outputs, no query/key/value projections)"
}
ATTENTION_WORDS = ("attn", "attention")  # a module-path word holding one of these names attention
# ...and so does a module with children named for the query, the key and the value, whatever the module's own
# name (NeMo's first_sub_layer.query_net/key_net): each word a part of the child's name split on "_"
QUERY_KEY_WORDS = (("query", "q"), ("key", "k"), ("value", "v"))
NOT_ATTENTION_WORDS = ("norm", "linear_attn", "linear_attention")  # ...unless it holds one of these


# Attention modules whose heads and kind their family fixes in code, by model type and a word of the
# module's path: GroupViT's token assignment (modeling_groupvit.py GroupViTAssignAttention) is one head over
# the whole width, its queries the group tokens and its keys the image tokens; WavTokenizer's positional net
# (WavTokenizerVocosAttention) is single-head self-attention over time.
MODULE_FACTS: dict[tuple[str, str], tuple[int, Literal["self", "cross"]]] = {
    ("groupvit", "assign"): (1, "cross"),
    ("groupvit_vision_model", "assign"): (1, "cross"),
    ("wavtokenizer", "pos_net"): (1, "self"),
}


# --- hybrids: blocks that several layers run -------------------------------------------------
@dataclass(frozen=True)
class SharedBlocks:
    """One attention block that several layers run (a shared transformer): ``word`` is the module
    under each layer that holds it; the layers that run one are those whose entry in the config
    list ``types_key`` is ``type_name``; they cycle through ``count_key`` distinct blocks (1 if None),
    and a checkpoint stores each block once, under the first layer that runs it."""

    word: str
    types_key: str
    type_name: str
    count_key: str | None = None
    adapters_flag: str | None = None  # config flag of per-layer adapters added to the shared q/k/v (kept as they are)


SHARED_BLOCKS = {
    "zamba": SharedBlocks("shared_transf", "layers_block_type", "hybrid"),
    "zamba2": SharedBlocks(
        "shared_transformer", "layers_block_type", "hybrid", "num_mem_blocks", "use_shared_attention_adapter"
    ),
}


# --- attention that surgeon names and refuses ----------------------------------------------
@dataclass(frozen=True)
class Refused:
    """An attention layout surgeon recognizes by its tensors (under one module) but does not rewrite."""

    name: str
    weights: tuple[str, ...]  # all present under one module
    why: str


REFUSED = (  # MLA: in an ONNX graph (the by-name route reads it: LATENT); the others: anywhere
    Refused(
        "multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi K2)",
        ("kv_a_proj_with_mqa.weight", "kv_b_proj.weight"),
        "its per-head projections (q_b_proj, kv_b_proj over the latents) are read by their names in a PyTorch or "
        "safetensors checkpoint, not traced in an ONNX graph; re-initialize the checkpoint, then export it",
    ),
    # Conditional DETR's and DAB-DETR's decoders (modeling_conditional_detr.py ConditionalDetrDecoderLayer, as the
    # checkpoint names it: sa_/ca_ projections on the layer; modeling_dab_detr.py): a head's query and key are the
    # sum of a content and a position projection, and the cross-attention's query and key heads are each two
    # halves (content+position | sine position); no single q/k/v projection holds a head
    Refused(
        "conditional attention (Conditional DETR's decoder: content + position query/key projections)",
        ("sa_qcontent_proj.weight", "sa_kcontent_proj.weight", "sa_v_proj.weight"),
        "each head's query and key are sums of a content and a position projection (sa_qcontent_proj + sa_qpos_proj), "
        "and its cross-attention's heads concatenate a sine position query (ca_qpos_sine_proj)",
    ),
    Refused(
        "conditional attention (DAB-DETR's decoder self-attention: content + position query/key projections)",
        ("self_attn_query_content_proj.weight", "self_attn_key_content_proj.weight", "self_attn_value_proj.weight"),
        "each head's query and key are sums of a content and a position projection (self_attn_query_content_proj + "
        "self_attn_query_pos_proj)",
    ),
    Refused(
        "conditional attention (DAB-DETR's decoder cross-attention: content + position query/key projections)",
        ("cross_attn_query_content_proj.weight", "cross_attn_key_content_proj.weight", "cross_attn_value_proj.weight"),
        "each head's query and key are two halves, content + position and a sine position query "
        "(cross_attn_query_pos_sine_proj)",
    ),
    Refused(  # litgpt/lora.py LoRAQKVLinear: the frozen base qkv in .linear, the low-rank update beside it
        "litgpt LoRA (qkv.linear with lora_A/lora_B)",
        ("qkv.linear.weight", "qkv.lora_A", "qkv.lora_B"),
        "the adapted projection is the base plus the LoRA update; merge them first (litgpt merge_lora "
        "CHECKPOINT_DIR), then re-initialize the merged lit_model.pth",
    ),
)


# --- multi-head latent attention ------------------------------------------------------------
@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, ...: modeling_deepseek_v3.py
    DeepseekV3Attention): each head's query is rows of ``query`` (over the q_lora_rank latent, or the hidden
    state without one); ``kv`` holds per head [key without rotary part | value] rows over the kv_lora_rank
    latent that ``marker`` projects down to (with the rotary key part every head shares)."""

    query: tuple[str, ...]  # the first present
    kv: str
    marker: str
    nope_key: str  # config keys of the head sizes
    rope_key: str
    value_key: str
    latent_key: str


_SIZES = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
LATENTS = (
    Latent(("q_b_proj", "q_proj"), "kv_b_proj", "kv_a_proj_with_mqa", *_SIZES),  # transformers' names
    Latent(("wq_b", "wq"), "wkv_b", "wkv_a_with_mqa", *_SIZES),  # Mistral's (Mistral Large 4 checkpoints)
)


# --- a second query/key/value set in one module ----------------------------------------------
# (tag, rule): where a module that matched a rule also holds these projections, they form a second
# block named "<module>[tag]" (Longformer's global attention: query_global, key_global, value_global).
SECOND_SETS: tuple[tuple[str, Rule], ...] = ((SET_TAGS[0], _separate("query_global", "key_global", "value_global")),)


# --- libraries beyond transformers (docs/formats.md "Libraries") ----------------------------------

# Layer-list entries named with their index instead of numbered, read as that number (torchvision
# vision_transformer.py: encoder.layers.encoder_layer_3.self_attention).
INDEXED_NAMES = (r"^(?:encoder_|decoder_)?layer_(\d+)$",)

# Where a library maps query head h to key/value head h % KV (spec.KV_MAPS "interleaved") rather than
# h // (H/KV): a module-path fragment only that library writes. x-transformers (x_transformers.py
# AttentionLayers, attend.py repeats key/value heads as 'b kvh n d -> b (r kvh) n d').
KV_MAP_BY_PATH = {"attn_layers.layers": "interleaved"}

# Separate bias parameters beside a fused weight without its own bias: tensor -> role -> bias name.
# timm EVA (eva.py EvaAttention, qkv_fused): qkv.weight with q_bias, v_bias (k_bias is a zero buffer).
SEPARATE_BIASES = {"qkv": {"q": "q_bias", "k": "k_bias", "v": "v_bias"}, "in_proj": {"q": "q_bias", "v": "v_bias"}}

# A second stream's projections in the same attention (its own rows, the same heads): the context
# stream of diffusers' joint attention (SD3, Flux: attention_processor.py JointAttnProcessor2_0 and
# FluxAttnProcessor concatenate add_q/k/v_proj(encoder_hidden_states) with to_q/k/v(hidden_states)).
# Re-initialized with its block, reported as the block's module + the suffix.
COMPANION_STREAMS = (("add_q_proj", "add_k_proj", "add_v_proj", ":" + STREAMS[0]),)

# diffusers classes whose config's attention_head_dim is the number of heads (when num_attention_heads
# is unset): unet_2d_condition.py and its kin say "num_attention_heads = num_attention_heads or
# attention_head_dim". UNet2DModel and the transformers read it as a head size.
DIFFUSERS_HEADS_AS_HEAD_DIM = (
    "UNet2DConditionModel",
    "UNet3DConditionModel",
    "ControlNetModel",
    "ControlNetUnionModel",
    "SparseControlNetModel",
    "UNetFlatConditionModel",
    "AudioLDM2UNet2DConditionModel",
)

# Cross-attention by the module's role in its block (not a word that says "cross"): diffusers'
# BasicTransformerBlock (attention.py) and PixArt/Transformer2DModel blocks hold self-attention in
# attn1 and cross-attention in attn2 (unless the config sets double_self_attention / only_cross_attention).
CROSS_ROLES = (("transformer_blocks", "attn2"),)
# Where an attn2 is not that: the block also holds joint attention (an ``attn`` with the context stream's
# add_q_proj), so it is diffusers' JointTransformerBlock with use_dual_attention (SD3.5), whose forward calls
# self.attn2(hidden_states=norm_hidden_states2): a second self-attention over the same tokens. (leaf, sibling tensor)
SELF_BESIDE = (("attn2", "attn.add_q_proj.weight"),)
# Cross-attention by the whole module path, where the library's module tree says so and no word does: vit-pytorch
# cross_vit.py, whose MultiScaleEncoder layers are [small-patch Transformer, large-patch Transformer, CrossTransformer];
# each CrossTransformer layer holds two ProjectInOut(fn=Attention) whose CLS token reads the other branch's patch
# tokens (sm_attend_lg(sm_cls, context=lg_patch_tokens, kv_include_self=True)).
CROSS_BY_PATH = (
    r"(^|\.)multi_scale_encoder\.layers\.\d+\.2\.layers\.\d+\.[01]\.fn$",
    # NeMo's TransformerDecoderBlock (nemo transformer_modules.py): first_sub_layer self-attention, second_sub_layer
    # the encoder-decoder attention, third_sub_layer the feed-forward (Cohere ASR's transf_decoder._decoder)
    r"(^|\.)_decoder\.layers\.\d+\.second_sub_layer$",
)

# timm fused qkv whose packing depends on the model, by config.json "architecture" (first match wins).
# maxxvit.py (MaxViT, MaxxViT, CoAtNet): head_first=True packs per head [q_h | k_h | v_h] ("interleaved"),
# except the TensorFlow ports (maxvit_*_tf, _tf_cfg: head_first=False) that pack [Q | K | V].
FUSED_PACKING_BY_ARCHITECTURE = (
    ("qkv", r"^maxvit_\w+_tf(_|\.|$)", "qkv"),
    ("qkv", r"^(maxvit|maxxvit|coatnet|coatnext)", "interleaved"),
)
# Module-path words only timm maxxvit.py writes (MaxxVitBlock: attn_block.attn, attn_grid.attn): their
# qkv packing is one of the two above, so without the architecture it cannot be told.
MAXXVIT_WORDS = ("attn_block", "attn_grid")

# timm defaults where config.json names an architecture but no model_args: heads per architecture
# prefix (lists: per stage), or head_dim where the heads follow from each stage's width.
TIMM_HEADS: dict[str, int | list[int]] = {
    "vit_tiny": 3,
    "vit_small": 6,
    "vit_medium": 8,
    "vit_base": 12,
    "vit_large": 16,
    "vit_huge": 16,
    "deit_tiny": 3,
    "deit_small": 6,
    "deit_base": 12,
    "deit3_small": 6,
    "deit3_base": 12,
    "deit3_large": 16,
    "eva02_tiny": 3,
    "eva02_small": 6,
    "eva02_base": 12,
    "eva02_large": 16,
    "swin_tiny": [3, 6, 12, 24],
    "swin_small": [3, 6, 12, 24],
    "swin_base": [4, 8, 16, 32],
    "swin_large": [6, 12, 24, 48],
}
TIMM_HEAD_DIM = {
    "maxvit": 32,
    "maxxvit": 32,
    "coatnet": 32,
    "coatnext": 32,
}  # maxxvit.py MaxxVitTransformerCfg.dim_head

# Layer lists whose entries alternate attention and feedforward, where the second attention entry
# between two feedforwards is cross-attention: x-transformers AttentionLayers (x_transformers.py:
# default_block ('a', 'c', 'f') with cross_attend; entries attn_layers.layers.N.1, feedforward .N.1.ff).
CROSS_BY_POSITION = {"attn_layers.layers": ".1.ff."}
# Layouts whose keys may read another input than the queries, with no name that says so: cross-attention
# where the key/value projection reads another width (a perceiver's latents reading the inputs).
CROSS_BY_WIDTH = ("fused to_kv",)

# OLMo-core's own config of a run (olmo_core Config.as_config_dict(): config.json of its ConfigSaverCallback, the
# experiment's {"model": ..., "trainer": ...}, or the model's TransformerConfig alone): the model config's class,
# where a block keeps its attention config (OLMo-core 3: sequence_mixer; 2: attention), and that config's keys.
OLMO_CORE_MODEL_CLASS = "olmo_core.nn.transformer.config.TransformerConfig"
OLMO_CORE_ATTENTION_KEYS = ("sequence_mixer", "attention")
OLMO_CORE_HEADS = {"n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim"}
