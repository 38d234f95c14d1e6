"""The census of every transformers model type: build the smallest random model of each type offline,
re-initialize its checkpoint with surgeon, and judge the result against the model's own code.

One type, :func:`census_one`, ends in one verdict:

* ``right``: every attention module the model's forward runs (caught where it hands q/k/v to an attention
  kernel: transformers' AttentionInterface, ``scaled_dot_product_attention``, or a softmax over a score
  matrix) is re-initialized with the heads, key/value heads and head size its forward uses, or named in the
  report as left alone; nothing else changed; the output loads back into the model's own class with every
  key; ``--layers -1`` changes exactly the last layer of each attention stack. Attention modules no forward
  entered, and every attention module of a type whose forward cannot run, are judged the same way by the
  heads and head size they were built with (:func:`declared_attention`; ``Verdict.judged_by``).
* ``refused: REASON``: surgeon stopped with its one-line error; REASON is a word of :data:`REASONS`.
* ``none``: surgeon finds no attention, and the model's forward runs none either (a CNN, an SSM).
* ``wrong: WHAT``: a silent wrong answer (exit 0) -- the worst bug there is.
* ``crash: ...``: an exception that is not one of surgeon's errors.
* ``unbuildable: WHY`` / ``unjudged: WHY``: transformers cannot build the type from its config offline, or
  neither its forward nor its modules' declared heads judge it (such a type is never counted right).

Nothing here reads surgeon's tables: heads come from the shapes the model's forward hands its kernel, or from
what the model's own code built each attention module with.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from helpers.census_settings import TYPE_SETTINGS

MAX_PARAMS = 80_000_000
WIDTH_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "width", "hidden_dim")
HEAD_KEYS = (
    "num_attention_heads",
    "num_heads",
    "n_head",
    "n_heads",
    "attention_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_num_attention_heads",
    "decoder_num_attention_heads",
)
KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_n_heads", "multi_query_group_num")
LAYER_KEY = re.compile(
    r"^(num_(hidden_)?layers|n_layers?|num_\w*_layers|\w*_layers|encoder_layers|decoder_layers|depth)$"
)
# a component's own heads (Idefics2's resampler_n_heads, with its resampler_head_dim)
PREFIXED_HEADS = re.compile(r"^(?!mamba|ssm|linear|conv|index)([a-z]+)_(n_heads|num_heads|num_attention_heads)$")
FFN_KEY = re.compile(r"intermediate_size|ffn_dim|d_ff|n_inner|ffn_hidden|mlp_dim|\w*_intermediate_size$")
# The refusal vocabulary: the first pattern found in surgeon's message names the reason.
REASONS = (
    ("latent attention (MLA)", r"latent attention"),
    ("quantized", r"quantized"),
    ("no attention", r"no attention found"),
    ("needs --num-heads", r"cannot tell the number of heads"),
    ("shapes do not fit", r"do not fit|is not divisible by"),
    ("packing unknown", r"packs query/key/value|packing surgeon cannot tell"),
    ("unknown projections", r"looks like attention"),
    ("unreadable block", r"cannot be read|unknown projections|left untouched|does not re-initialize"),
    ("shared block", r"shared block"),
    ("not 2-D", r"must be 2-D"),
    ("format", r"cannot read|not a|unsupported"),
)


# Why a type is not judged, in a fixed vocabulary (the verdict's free text says the rest): the first that matches.
NOT_JUDGED: dict[str, tuple[tuple[str, str], ...]] = {
    "unbuildable": (
        ("no model class", r"no model class"),
        ("built only inside a type that leaves it out", r"no module built from"),
        ("too large even shrunk", r"parameters even shrunk"),
        ("needs a package", r"ImportError|ModuleNotFoundError|requires the \S+ library"),
        ("the config refuses the shrunk sizes", r"ValidationError|ValueError"),
        ("the model's code fails on the shrunk config", r"."),
    ),
    "unjudged": (
        ("the forward needs inputs the census cannot make", r"the forward did not run"),
        ("a changed projection no forward runs", r"changed, and no forward runs it"),
        ("the class does not load its own checkpoint", r"does not load its own checkpoint"),
        ("a softmax that is not torch's", r"softmax is not torch's"),
    ),
}


@dataclass
class Verdict:
    model_type: str
    verdict: str  # right | refused: R | wrong: W | crash: E | unbuildable: W | unjudged: W
    detail: str = ""
    blocks: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # "forward": by the attention the model's forward ran; "construction": by what its attention modules were
    # built with (heads, head size), where no forward could be run
    judged_by: str = "forward"

    @property
    def kind(self) -> str:
        return self.verdict.split(":")[0]

    @property
    def reason(self) -> str | None:
        """Why an unbuildable or unjudged type is not judged, from NOT_JUDGED (None for other verdicts, and for
        a text no entry matches: a new kind of failure, to be named there)."""
        import re

        rest = self.verdict.partition(": ")[2]
        return next((r for r, pattern in NOT_JUDGED.get(self.kind, ()) if re.search(pattern, rest)), None)


# ------------------------------------------------------------------------------------------ build
def _configs(config):
    """The config and every config nested in it (sub-configs, backbones), each once."""
    from transformers import PretrainedConfig

    seen, out = set(), []

    def walk(cfg):
        if id(cfg) in seen:
            return
        seen.add(id(cfg))
        out.append(cfg)
        for value in list(vars(cfg).values()):
            if isinstance(value, PretrainedConfig):
                walk(value)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    if isinstance(v, PretrainedConfig):
                        walk(v)

    walk(config)
    return out


def _shrink(cfg, width: bool) -> None:
    """Fewer layers (enough for every layer type), fewer experts, narrower feed-forwards; ``width``: also
    fewer, narrower heads where the config spells width and heads as plain numbers."""
    d = vars(cfg)
    per_layer = [k for k, v in d.items() if isinstance(v, list) and k in ("layer_types", "layers_block_type")]
    periods = [
        v
        for k, v in d.items()
        if re.search(r"interval|period|offset|every|pattern", k)
        and isinstance(v, int)
        and not isinstance(v, bool)
        and 0 < v < 12
    ]
    for key, value in list(d.items()):
        if isinstance(value, bool) or not isinstance(value, int) or not LAYER_KEY.match(key) or value <= 2:
            continue
        if isinstance(d.get("depths"), list) and len(d["depths"]) == value:
            continue  # the number of stages (Swin): their lists stay whole
        n = max([2] + [p + 1 for p in periods])
        for k, v in d.items():  # a repeating pattern of block types (RecurrentGemma's block_types): one whole cycle
            if re.search(r"types|pattern", k) and isinstance(v, list) and 0 < len(v) < value:
                if all(isinstance(t, str) for t in v):
                    n = max(n, len(v))
        for k in per_layer:
            types = d[k]
            if len(types) == value:
                firsts = [types.index(t) for t in dict.fromkeys(types)]
                n = max(n, max(firsts) + 1)
        n = min(n, value)
        d[key] = n
        for k in per_layer:
            if len(d[k]) == value:
                d[k] = d[k][:n]
        for k, v in list(d.items()):  # per-layer lists of the same length (per-layer head counts, indexer
            # types, wav2vec2's conv_dim for num_feat_extract_layers)
            if k not in per_layer and isinstance(v, (list, tuple)) and len(v) == value and value > n:
                d[k] = type(v)(v[:n])
    if isinstance(d.get("_out_indices"), (list, tuple)) and isinstance(d.get("stage_names"), list):
        layers = next((d[k] for k in ("num_hidden_layers", "num_layers") if isinstance(d.get(k), int)), None)
        if layers is not None and len(d["stage_names"]) > layers + 1:  # a backbone's outputs: stages it still has
            d["stage_names"] = d["stage_names"][: layers + 1]
            d["_out_features"], d["_out_indices"] = [d["stage_names"][-1]], [layers]
    if isinstance(d.get("depths"), list):
        d["depths"] = [min(v, 2) if isinstance(v, int) else v for v in d["depths"]]
    for key, value in list(d.items()):
        if isinstance(value, int) and not isinstance(value, bool):
            if (
                re.fullmatch(r"(num_|n_)?(local_|routed_)?experts|num_experts|n_routed_experts|moe_num_experts", key)
                and value > 4
            ):
                d[key] = 4
            elif key in ("num_experts_per_tok", "moe_k", "top_k", "num_selected_experts") and value > 2:
                d[key] = 2
    if not width:
        return
    wkey = next((k for k in WIDTH_KEYS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    hkeys = [
        k
        for k in d
        if (k in HEAD_KEYS or PREFIXED_HEADS.match(k)) and isinstance(d[k], int) and not isinstance(d[k], bool)
    ]
    if wkey is None or not hkeys or d[wkey] < 64:
        return
    if any(isinstance(v, list) and re.search(r"dim|hidden|width|channel", k) for k, v in d.items()):
        return  # widths per stage (SAM 2's Hiera embed_dim_per_stage): the scalar width is not the blocks' own
    heads = {k: d[k] for k in hkeys}
    new_heads = {k: min(4, v) for k, v in heads.items()}
    head_dim = d.get("head_dim") if isinstance(d.get("head_dim"), int) else None
    hd = 16
    for key in WIDTH_KEYS:  # every width of this config (a vision tower's embed_dim and its output hidden_size)
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool) and d[key] >= 64:
            d[key] = max(new_heads.values()) * hd
    d.update(new_heads)
    if head_dim is not None and "qk_rope_head_dim" not in d:  # latent attention: head_dim is the rotary part
        d["head_dim"] = hd
    prefixed = [m.group(1) + "_head_dim" for m in map(PREFIXED_HEADS.match, hkeys) if m]  # resampler_head_dim
    for k in (
        "d_kv",
        "d_head",
        "kv_channels",
        "attention_head_dim",
        "head_size",
        "dim_head",
        *prefixed,
    ):  # the head size
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] > hd:
            d[k] = hd

    def kv(n: int) -> int:  # never more than the query heads
        return 1 if n == 1 else (2 if n < max(heads.values()) else max(new_heads.values()))

    for k in [k for k in d if k in KV_KEYS or re.search(r"key_value\w*heads", k)]:
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
            d[k] = kv(d[k])
        elif isinstance(d.get(k), list) and all(isinstance(n, int) and not isinstance(n, bool) for n in d[k]):
            d[k] = [kv(n) for n in d[k]]  # per layer (Sapiens2's num_key_value_heads_per_layer)
    for key in ("rope_parameters", "rope_scaling"):  # multimodal rope sections cover half a head
        if isinstance(d.get("qk_rope_head_dim"), int) and not isinstance(d.get("qk_rope_head_dim"), bool):
            break  # latent attention (HY-V4-VL): the rotary part the sections cover keeps its size
        rope = d.get(key)
        section = rope.get("mrope_section") if isinstance(rope, dict) else None
        if (
            isinstance(rope, dict)
            and section is None
            and "mrope_section" in getattr(cfg, "ignore_keys_at_rope_validation", ())
        ):
            section = [16, 24, 24]  # the Qwen2-VL family's default when the config gives none
        if isinstance(section, list) and section and all(isinstance(x, int) for x in section):
            total, half = sum(section), hd // 2
            new = [max(1, x * half // total) for x in section]
            new[0] += half - sum(new)
            d[key] = {**rope, "mrope_section": new}
    for key, value in list(d.items()):
        if FFN_KEY.search(key) and isinstance(value, int) and not isinstance(value, bool) and value > 2 * d[wkey]:
            d[key] = 2 * d[wkey]


# sizes the last shrink leaves alone: token ids, positions, lengths, rates, image geometry
KEEP_SIZE = re.compile(r"_id$|_ids$|index|token|position|max_|length|rate|window|image_size|patch|seq|chunk|stride")
SQUEEZE = re.compile(r"vocab|size|dim|embed|channel|hidden|entit|codebook|intermediate|ffn|latent|inner|width")


def _squeeze(cfg) -> None:
    """The last shrink, for a type still over the budget: every remaining large size (vocabularies, widths of
    towers the plain shrink cannot tell heads of, codebooks, per-layer embeddings) divided down to at most
    1024, keeping its multiples of 64 (a width stays divisible by its heads)."""
    d = vars(cfg)
    for key, value in list(d.items()):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 1024:
            continue
        if SQUEEZE.search(key) and not KEEP_SIZE.search(key):
            factor = -(-value // 1024)
            d[key] = max(64, value // factor // 64 * 64) if value % 64 == 0 else max(64, value // factor)
    # a convolutional tower whose channels double per stage (VibeVoice's tokenizers: num_filters * 2**stage over
    # len(downsampling_ratios) stages, depths one longer for the stem): its first two stages, two blocks each
    depths = d.get("depths")
    if isinstance(depths, (list, tuple)) and depths and all(isinstance(v, int) for v in depths):
        for key, value in list(d.items()):
            if key.endswith("ratios") and isinstance(value, (list, tuple)) and len(value) > 2:
                if len(depths) - len(value) in (0, 1):
                    d["depths"] = type(depths)(min(v, 2) for v in depths[: 2 + len(depths) - len(value)])
                    d[key] = type(value)(value[:2])
                    break


def _own_backbones(config) -> None:
    """A detector's timm ResNet backbone (DETR's resnet50) replaced by transformers' own ResNet with the same
    outputs, where timm is not installed: the census judges the detector's
    attention, which reads the backbone's features whatever built them."""
    import importlib.util

    from transformers import PretrainedConfig, ResNetConfig

    if importlib.util.find_spec("timm") is not None:
        return
    for cfg in _configs(config):
        for key, value in list(vars(cfg).items()):
            if isinstance(value, PretrainedConfig) and value.model_type == "timm_backbone":
                name, indices = str(getattr(value, "backbone", "")), list(getattr(value, "out_indices", None) or [])
                if name.startswith("resnet") and indices:
                    setattr(cfg, key, ResNetConfig(out_indices=indices))


FEATURE_LAYERS = re.compile(r"feature_layers?$|select_layers?$|feature_layer_ids?$")


def _fit_references(cfg) -> None:
    """What the shrink left pointing past the layers it kept: a tower's feature layers counted from the end
    (Molmo2's vision_feature_layer [24, 18] -> [-1, -2]); a forecast length the default leaves unset."""
    d = vars(cfg)
    for key, value in list(d.items()):
        if FEATURE_LAYERS.search(key):
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                d[key] = -1
            elif isinstance(value, list) and all(isinstance(v, int) for v in value) and any(v > 1 for v in value):
                d[key] = [-1 - i for i in range(len(value))]
    if "prediction_length" in d and d["prediction_length"] is None:  # time-series transformers: a required size
        d["prediction_length"] = 4
    if "context_length" in d and d["context_length"] is None and isinstance(d.get("prediction_length"), int):
        d["context_length"] = d["prediction_length"]  # their documented default
    width = next((d[k] for k in WIDTH_KEYS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    heads = d.get("num_attention_heads")
    for key, value in UNSET_SIZES.items():
        if key in d and d[key] is None:
            if value == "width/heads":
                if isinstance(width, int) and isinstance(heads, int) and heads:
                    d[key] = width // heads
            elif value == "heads":
                if isinstance(heads, int):
                    d[key] = heads
            elif value == "2*width":
                if isinstance(width, int):
                    d[key] = 2 * width
            else:
                d[key] = value
    _fit_mamba(cfg)


# a Mamba-2 mixer's (heads, head size, expansion, groups), as each family spells them
MAMBA_TIES = (
    ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_n_groups"),
    ("mamba_num_heads", "mamba_head_dim", "expand", "n_groups"),
    ("num_heads", "head_dim", "expand", "n_groups"),
)


def _fit_mamba(cfg) -> None:
    """A Mamba-2 mixer's heads x head size is its inner width, expand x width (its config's validator): after
    the width shrink, heads of 16 filling the shrunk inner width, a multiple of its groups."""
    d = vars(cfg)
    width = next((d[k] for k in WIDTH_KEYS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    for keys in MAMBA_TIES:
        if width is None or not all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for k in keys):
            continue
        heads, head, expand, groups = keys
        inner = d["mamba_d_ssm"] if isinstance(d.get("mamba_d_ssm"), int) else d[expand] * width
        if d[heads] * d[head] == inner or inner % 16 or (inner // 16) % d[groups]:
            continue
        d[heads], d[head] = inner // 16, 16


# Sizes a type's default config leaves unset (None) where its own code needs a number: what the config's
# documentation gives as their meaning (a head size of width / heads; as many key/value heads as heads)
UNSET_SIZES: dict[str, object] = {
    "head_dim": "width/heads",
    "num_key_value_heads": "heads",
    "vocab_size": 64,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "top_k_experts": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": "2*width",
}


BASE_FIRST = (
    "MODEL_MAPPING",
    "MODEL_FOR_CAUSAL_LM_MAPPING",
    "MODEL_FOR_PRETRAINING_MAPPING",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
    "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING",
    "MODEL_FOR_BACKBONE_MAPPING",
)
# The class a checkpoint on the Hub is usually saved from (a head model: Qwen2VLForConditionalGeneration saves
# model.layers.N and visual.blocks.N, its base model language_model.layers.N)
HEAD_FIRST = (
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
    "MODEL_FOR_CAUSAL_LM_MAPPING",
    "MODEL_FOR_PRETRAINING_MAPPING",
    "MODEL_MAPPING",
)


def build(
    model_type: str, folder: Path, mappings: tuple[str, ...] = BASE_FIRST, created: dict | None = None, **settings
):
    """The smallest model of ``model_type`` that builds, saved to ``folder``; (model, config) or raise.
    ``mappings``: transformers' Auto mappings tried for its class, in order; ``created``: config values given
    when the config is created (a tower its default leaves out: ``{"audio_config": {}}``); ``settings``: config
    values set after the shrink (a dotted key sets a sub-config's: ``text_config.num_attention_heads``)."""
    from transformers import AutoConfig, PretrainedConfig

    settings = {**TYPE_SETTINGS.get(model_type, {}), **settings}
    # a default config its own validator refuses: the top-level settings from the start
    created = {**{k: v for k, v in settings.items() if "." not in k}, **(created or {})}
    errors: list[Exception] = []
    for width, squeeze in ((True, False), (False, False), (True, True)):
        if squeeze and not any("even shrunk" in str(e) for e in errors):
            break
        try:
            config = AutoConfig.for_model(model_type, **created)
            _own_backbones(config)
            for cfg in _configs(config):
                _shrink(cfg, width)
                if squeeze:
                    _squeeze(cfg)
            for cfg in _configs(config):
                _fit_references(cfg)
            for key, value in settings.items():
                if (
                    "." not in key
                    and isinstance(value, dict)
                    and isinstance(getattr(config, key, None), PretrainedConfig)
                ):
                    continue  # a sub-config's values given at creation (its validator needs them): shrunk as built
                *path, leaf = key.split(".")
                target = config
                for part in path:
                    target = getattr(target, part)
                setattr(target, leaf, value)
            config = _as_reloaded(config)
            for cfg in _configs(config):  # sizes the config ties together (saving would refuse them later)
                if callable(getattr(cfg, "validate", None)):
                    cfg.validate()
            with torch.device("meta"):  # count first: a shrunk config may still be huge
                n = sum(p.numel() for p in _instantiate(config, mappings).parameters())
            if n > MAX_PARAMS:
                raise RuntimeError(f"{n / 1e6:.0f}M parameters even shrunk")
            model = _instantiate(config, mappings)
            model.eval()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _save(model, config, folder)  # saving validates the config: a shrink it refuses is the next try's
        except Exception as e:  # noqa: BLE001 - the census records why a type does not build
            errors.append(e)
            continue
        return model, config
    raise RuntimeError(_one_line(errors[0]))


def _as_reloaded(config):
    """The config as its config.json loads back: what a composite config derives from its parts when it is
    created (HunYuan-VL's vision text_hidden_size from its text_config, Step3.5's intermediate_size from
    mlp_ratio) derived again from the shrunk sizes, so the model built is the one its own checkpoint loads
    into. The config as it is where it does not load back."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(config).from_dict(config.to_dict())
    except Exception:  # noqa: BLE001 - kept as built; a config its own loader refuses fails at the save
        return config


def _instantiate(config, mappings: tuple[str, ...] = BASE_FIRST):
    """The model class transformers' own Auto mappings give the config (``mappings`` in order), built while
    :func:`_constructed` records what each module was built with."""
    import transformers.models.auto.modeling_auto as auto

    # then any other of transformers' task mappings (UperNet is a segmentation model only)
    others = sorted(n for n in vars(auto) if n.startswith("MODEL_") and n.endswith("_MAPPING") and n not in mappings)
    for mapping in (*mappings, *others):
        table = getattr(auto, mapping, None)
        try:
            cls = table[type(config)] if table is not None else None
        except (KeyError, TypeError, ValueError):  # ValueError: a class the mapping names, not exported
            continue
        if cls is not None and _built_for_part(cls, config):  # a part's class (MusicgenModel: the decoder alone)
            continue
        break
    else:
        cls = _model_of_module(config)  # a tower's own config (clap_audio_model): its model class in the same module
    if cls is None:
        raise RuntimeError("no model class in transformers' Auto mappings or the config's own module")
    if isinstance(cls, tuple):  # a type with several base classes (Funnel's full and base model): the first
        cls = cls[0]
    torch.manual_seed(0)
    with _constructed() as (built, made_from):
        model = cls(config)
    for m in model.modules():
        if id(m) in built:
            m.__dict__["_census_built_with"] = built[id(m)]
        if id(m) in made_from:
            m.__dict__["_census_configs"] = made_from[id(m)]
    return model


def _built_for_part(cls, config) -> bool:
    """Whether model class ``cls`` is built from one of ``config``'s own sub-configs, not from it: an Auto
    mapping that gives a composite type its part's class (MODEL_MAPPING's musicgen -> MusicgenModel, the
    decoder alone, built from MusicgenDecoderConfig)."""
    own = getattr(cls[0] if isinstance(cls, tuple) else cls, "config_class", None)
    return (
        isinstance(own, type) and not isinstance(config, own) and any(isinstance(c, own) for c in _configs(config)[1:])
    )


@contextlib.contextmanager
def _constructed():
    """({id(module): the integer arguments its class's ``__init__`` (and its parents') received}, {id(module):
    the configs it was given}) for every module built inside: what a module was constructed with, read from the
    constructor's own frame."""
    import sys

    built: dict[int, dict[str, int]] = {}
    made_from: dict[int, list] = {}
    original = torch.nn.Module.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        frame, found = sys._getframe(1), {}
        while frame is not None and frame.f_locals.get("self") is self:
            code = frame.f_code
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            for n in names:
                v = frame.f_locals.get(n)
                if isinstance(v, int) and not isinstance(v, bool) and n not in found:
                    found[n] = v
                elif hasattr(v, "model_type") and hasattr(v, "to_dict"):  # a config, by any name
                    made_from.setdefault(id(self), []).append(v)
            frame = frame.f_back
        if found:
            built[id(self)] = found

    torch.nn.Module.__init__ = init  # type: ignore[method-assign]
    try:
        yield built, made_from
    finally:
        torch.nn.Module.__init__ = original  # type: ignore[method-assign]


def _model_of_module(config):
    """A class of the config's own modeling module built from the config alone: a model class declaring the
    config as its own; else, for a tower's or a decoder's config no model class declares (sam_mask_decoder,
    canary_decoder), the largest module whose constructor takes that config alone (the tower itself, not one
    of its layers). None where there is none."""
    import importlib

    from transformers import PreTrainedModel

    try:
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, torch.nn.Module)]
    found = [
        c
        for c in classes
        if issubclass(c, PreTrainedModel)
        and getattr(c, "config_class", None) is type(config)
        and c.__name__.endswith("Model")
        and not c.__name__.endswith("PreTrainedModel")
    ]
    if found:
        return min(found, key=lambda c: len(c.__name__))
    takes = [c for c in classes if _takes_only(c, config)]
    sizes = {}
    for c in takes:
        with contextlib.suppress(Exception), torch.device("meta"):
            sizes[c] = sum(p.numel() for p in c(config).parameters())
    sizes = {c: n for c, n in sizes.items() if n}  # a rotary embedding holds no weights: not the tower
    # a model class before a plain module, then the largest: the tower, not one of its parts
    return max(sizes, key=lambda c: (issubclass(c, PreTrainedModel), sizes[c])) if sizes else None


def _takes_only(cls, config) -> bool:
    """Whether ``cls(config)`` is how ``cls`` is built: its constructor's ``config`` is annotated with the
    config's class, and it needs no other argument."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    if not params or params[0].name != "config":
        return False
    note = params[0].annotation
    if note is not type(config) and note != type(config).__name__:
        return False
    return all(
        p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params[1:]
    )


def _save(model, config, folder: Path) -> None:
    """The model saved as transformers saves it; a plain module (a tower no model class wraps) as its config
    and its own state dict in one safetensors file."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        model.save_pretrained(folder)
        return
    from safetensors.torch import save_model

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------------ observe
@dataclass
class Seen:
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    via: str


class _Watch(TorchFunctionMode):
    """Which modules hand q/k/v to an attention kernel, and with what shapes (the innermost module)."""

    def __init__(self, model):
        super().__init__()
        self.names = {m: n for n, m in model.named_modules()}
        self.stack: list = []
        self.seen: dict[str, Seen] = {}
        self.ran: set[str] = set()  # every module a forward entered
        self.in_kernel = 0
        self.last_product: dict = {}

    def pre(self, module, args):
        self.stack.append(module)
        name = self.names.get(module)
        if name is not None:
            self.ran.add(name)

    def post(self, module, args, out):
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    def record(self, module, seen: Seen) -> None:
        name = self.names.get(module)
        # what the module hands a kernel says more than a softmax it computed before (SAM 2 also softmaxes an
        # unused product of its (B, L, heads, d) query and key)
        if name is not None and (name not in self.seen or (self.seen[name].via == "softmax" != seen.via)):
            self.seen[name] = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.in_kernel and self.stack:
            if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3:
                q, k = args[0], args[1]
                if q.dim() == 4:
                    self.record(self.stack[-1], Seen(q.shape[1], k.shape[1], q.shape[-1], "sdpa"))
            elif func is torch.nn.functional.multi_head_attention_forward:
                heads = args[4] if len(args) > 4 else kwargs.get("num_heads")
                self.record(self.stack[-1], Seen(heads, heads, args[0].shape[-1] // heads, "multi_head_attention"))
            elif func in (torch.matmul, torch.Tensor.matmul, torch.bmm, torch.Tensor.__matmul__):
                # a product with a parameter (SwiftFormer's query @ w_g) scores tokens against a fixed vector, not
                # against each other's keys: no softmax(QK^T) follows from it
                if not any(isinstance(a, torch.nn.Parameter) for a in args[:2]):
                    self.last_product[self.stack[-1]] = args[0]
                else:
                    self.last_product.pop(self.stack[-1], None)
            elif func is torch.einsum and len(args) > 1:
                self.last_product[self.stack[-1]] = None  # a product whose operands' roles it does not say
            elif func in (torch.baddbmm, torch.Tensor.baddbmm):
                self.last_product[self.stack[-1]] = kwargs.get("batch1", args[1] if len(args) > 1 else None)
            elif func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax) and args:
                x = args[0]
                if isinstance(x, torch.Tensor) and x.dim() in (3, 4) and x.shape[-1] > 1:  # over one score: all 1
                    module = self.stack[-1]
                    if "softmax" in type(module).__name__.lower() and len(self.stack) > 1:
                        module = self.stack[-2]  # a softmax module counts for its caller
                    if module in self.last_product:  # scores from a product: attention, not a softmax over channels
                        self.record(module, self._scores(module, x))
        return func(*args, **kwargs)

    def _scores(self, module, scores: torch.Tensor) -> Seen:
        """Heads and head size of an eager softmax(Q K^T): from the query of the module's last product
        before it, (B, H, L, d); (B * H, L, d) gives the head size only (B may hold windows)."""
        q = self.last_product.get(module)
        if isinstance(q, torch.Tensor) and q.dim() == scores.dim() and q.shape[:-1] == scores.shape[:-1]:
            return Seen(q.shape[1] if q.dim() == 4 else None, None, q.shape[-1], "softmax")
        return Seen(None, None, None, "softmax")


_WATCH: _Watch | None = None


def _kernel(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    if _WATCH is not None:
        _WATCH.record(module, Seen(query.shape[1], key.shape[1], query.shape[-1], "attention-interface"))
        _WATCH.in_kernel += 1
    try:
        h, kvh = query.shape[1], key.shape[1]
        if kvh != h and h % kvh == 0:
            key = key.repeat_interleave(h // kvh, dim=1)
            value = value.repeat_interleave(h // kvh, dim=1)
        s = query.shape[-1] ** -0.5 if scaling is None else scaling
        w = torch.softmax((query @ key.transpose(-1, -2)) * s, dim=-1)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            pass
        return (w @ value).transpose(1, 2).contiguous(), None
    finally:
        if _WATCH is not None:
            _WATCH.in_kernel -= 1


def _windowed(cfg) -> dict:
    """RF-DETR's DINOv2 backbone splits the patch grid into num_windows x num_windows windows: an image whose
    side they divide, the config's image_size rounded up to patch_size * num_windows (518 -> 560, RF-DETR's own
    resolution)."""
    b = getattr(cfg, "backbone_config", None) or cfg
    step = b.patch_size * b.num_windows
    side = -(-b.image_size // step) * step
    return {"pixel_values": torch.randn(1, b.num_channels, side, side)}


# a forward whose inputs its main input's name does not say, made from its config's own sizes: {model_type: inputs}
OWN_INPUTS = {
    "rf_detr": _windowed,
    "rf_detr_dinov2": _windowed,
    # the conformer audio encoder phi4_multimodal feeds (B, frames, input_size) features and their mask (or None)
    "phi4_multimodal_audio": lambda cfg: {"hidden_states": torch.randn(1, 64, cfg.input_size), "mask": None},
    # an input image, a prompt image and its mask, each half of image_size's height (stacked on height to image_size)
    "seggpt": lambda cfg: {
        k: torch.randn(1, cfg.num_channels, cfg.image_size[0] // 2, cfg.image_size[1])
        for k in ("pixel_values", "prompt_pixel_values", "prompt_masks")
    },
}


def _inputs(model, config) -> list[dict]:
    """Small inputs to try, in turn, for the forward: its main input (and a decoder's), from the config's
    own sizes; then text and image together (CLIP-like models need both). A type of :data:`OWN_INPUTS`
    gets its own; a video model (its config has ``num_frames``) also gets a clip of frames, a codec (its
    config has ``audio_channels``) audio as (batch, channels, samples)."""
    own = OWN_INPUTS.get(getattr(config, "model_type", None))
    if own is not None:
        return [own(config)]
    sig = inspect.signature(model.forward).parameters
    cfgs = _configs(config)

    def get(*keys, default=None):
        for cfg in cfgs:
            for k in keys:
                v = getattr(cfg, k, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
                if isinstance(v, (list, tuple)) and v and isinstance(v[0], int):
                    return v[0]
        return default

    vocab = get("vocab_size", default=100)
    ids = torch.randint(3, max(4, min(vocab, 100)), (1, 8))
    size = get("image_size", "img_size", "input_size", default=224)
    height, width = size, size
    for cfg in cfgs:  # an image size given as (height, width): MGP-STR's (32, 128)
        v = getattr(cfg, "image_size", None)
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and x > 0 for x in v):
            height, width = v
            break
        if v is not None:
            break
    channels = get("num_channels", "in_channels", "in_chans", default=3)
    pixels = torch.randn(1, channels, height, width)
    text: dict = {"input_ids": ids} if "input_ids" in sig else {}
    if "decoder_input_ids" in sig and getattr(config, "is_encoder_decoder", False):
        text["decoder_input_ids"] = ids
    main = getattr(model, "main_input_name", None)
    tries = []
    if main == "input_features":
        mel = get("num_mel_bins", "feature_size", "input_feat_per_channel", default=80)
        frames = 3000 if "whisper" in str(config.model_type) else 64
        tries.append(
            {"input_features": torch.randn(1, mel, frames)} | {k: v for k, v in text.items() if k != "input_ids"}
        )
    elif main == "input_values":
        audio_channels = getattr(config, "audio_channels", None)
        audio = torch.randn(1, 4000) if not isinstance(audio_channels, int) else torch.randn(1, audio_channels, 4000)
        tries.append({"input_values": audio} | {k: v for k, v in text.items() if k != "input_ids"})
    elif main == "pixel_values" or ("pixel_values" in sig and not text):
        tries.append({"pixel_values": pixels} | {k: v for k, v in text.items() if k != "input_ids"})
        frames = getattr(config, "num_frames", None)
        if isinstance(frames, int) and frames > 0:  # a video model: (batch, frames, channels, height, width)
            video = torch.randn(1, frames, channels, height, width)
            tries.append({"pixel_values": video} | {k: v for k, v in text.items() if k != "input_ids"})
    if text:
        tries.append(text)
    if "pixel_values" in sig and text:
        tries.append(text | {"pixel_values": pixels})
    return tries


def observe(model, config, ran: set[str] | None = None) -> dict[str, Seen]:
    """The attention modules the model's forward runs, by qualified name; towers its forward did not run
    (a vision tower under text inputs) are run on their own inputs, each a model of transformers' own.
    ``ran`` gets the name of every module a forward entered. Raises the first forward's error when no
    forward ran any attention."""
    from transformers import PreTrainedModel

    seen: dict[str, Seen] = {}
    entered: set[str] = set() if ran is None else ran
    errors: list[Exception] = []
    for inputs in _inputs(model, config):
        try:
            seen.update(_observe(model, config, inputs, entered))
        except Exception as e:  # noqa: BLE001 - the next inputs may fit
            errors.append(e)
    for name, sub in model.named_modules():
        if name and isinstance(sub, PreTrainedModel) and not any(_inside(a, name) for a in seen):
            for inputs in _inputs(sub, sub.config):
                inner: set[str] = set()
                try:
                    seen.update({f"{name}.{a}": s for a, s in _observe(sub, sub.config, inputs, inner).items()})
                    break
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
                finally:
                    entered.update(f"{name}.{m}" if m else name for m in inner)
    if not seen and errors:
        raise errors[0]
    if not seen and not _inputs(model, config):
        raise RuntimeError(f"no inputs the census can make for {type(model).__name__}.forward")
    return seen


def _observe(model, config, inputs: dict, ran: set[str]) -> dict[str, Seen]:
    """One forward under the census kernel; where a family's code does not take it, under eager attention
    (its sdpa or softmax is then what is caught)."""
    try:
        return _observe_with(model, config, inputs, "census", ran)
    except Exception:  # noqa: BLE001
        return _observe_with(model, config, inputs, "eager", ran)


def _observe_with(model, config, inputs: dict, implementation: str, ran: set[str]) -> dict[str, Seen]:
    import transformers

    global _WATCH
    if "census" not in transformers.AttentionInterface._global_mapping:
        transformers.AttentionInterface.register("census", _kernel)
    for cfg in _configs(config):
        with contextlib.suppress(Exception):
            cfg._attn_implementation_internal = implementation
    watch = _Watch(model)
    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(watch.pre),
        torch.nn.modules.module.register_module_forward_hook(watch.post, always_call=True),
    ]
    _WATCH = watch
    try:
        torch.manual_seed(0)
        with torch.no_grad(), watch:
            model(
                **inputs, **({"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {})
            )
    finally:
        _WATCH = None
        for h in handles:
            h.remove()
        ran.update(watch.ran)
    return watch.seen


# ------------------------------------------------------------------------------------------ judge
def _reason(message: str) -> str:
    for name, pattern in REASONS:
        if re.search(pattern, message):
            return name
    return "other"


def _one_line(e: BaseException | None) -> str:
    text = f"{type(e).__name__}: {e}" if e is not None else "?"
    return text.splitlines()[0][:300] if text else "?"


def _layer_of(name: str, model) -> tuple[str, tuple[int, ...]] | None:
    """(stack, layer) of module ``name`` in the model's own terms: the stack is the outermost list of
    repeated blocks on its path, the layer the indices in every such list below it (Swin: stage, block).
    A list whose entries are all of different classes (T5's self-, cross-attention, feed-forward) is the
    parts of one layer, not layers."""
    parts = name.split(".")
    stack, key = None, []
    for i, part in enumerate(parts):
        if part.isdigit() and i:
            parent = model.get_submodule(".".join(parts[:i]))
            if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)):
                classes = [type(m) for m in parent]
                if len(parent) == 1 or len(set(classes)) < len(classes):
                    stack = stack if stack is not None else ".".join(parts[:i])
                    key.append(int(part))
    return (stack, tuple(key)) if stack is not None else None


def _inside(inner: str, outer: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte: a weight left as torch.empty made it (MoE experts some types never initialize) may hold
    NaN, which torch.equal calls different from itself."""
    return _key(a.detach().cpu().contiguous()) == _key(b.detach().cpu().contiguous())


def _key(t: torch.Tensor) -> tuple:
    t = t.detach().contiguous()
    return (t.dtype, tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def census_one(
    model_type: str,
    work: Path | None = None,
    holding: type | None = None,
    within: dict | None = None,
    mappings: tuple[str, ...] = BASE_FIRST,
) -> Verdict:
    """The verdict on ``model_type``. A config type no class builds alone (T5Gemma2's decoder config) is
    judged inside the type whose config nests it: that type's verdict, if the model built holds it.
    ``holding``: a config class the built model's config must nest, else the type is unbuildable;
    ``within``: config values given at creation (that sub-config, as its defaults); ``mappings``: the Auto
    mappings the class comes from (:data:`HEAD_FIRST`: the head class a Hub checkpoint is saved from)."""
    import time

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        folder = Path(tmp) / "model"
        try:
            model, config = build(model_type, folder, mappings, created=within)
        except Exception as e:  # noqa: BLE001
            outer = _nesting(model_type) if holding is None and "no model class" in str(e) else None
            if outer is None:
                return Verdict(model_type, f"unbuildable: {_one_line(e)}", seconds=time.perf_counter() - start)
            parent, key, own = outer
            # the parent built with that sub-config even where its default leaves it out (Gemma 4's towers)
            v = census_one(parent, work, holding=own, within={key: {}}, mappings=mappings)
            v.detail = f"no model class of its own: judged inside {parent} (its {key}); {v.detail}"
            v.model_type, v.judged_by, v.seconds = model_type, f"inside {parent}", time.perf_counter() - start
            return v
        roots, attention = _built_from(model, holding) if holding is not None else ([""], [])
        if not roots:
            del model
            return Verdict(model_type, f"unbuildable: no module built from a {holding.__name__}")
        try:
            v = _judge(model_type, model, config, folder, Path(tmp))
        finally:
            del model
        if holding is not None and not attention and v.verdict == "right":
            # its modules are built (an embedder, a convolutional head), none of them attention
            v.verdict = f"none: no attention module built from a {holding.__name__} ({', '.join(roots[:3])})"
        v.seconds = time.perf_counter() - start
        return v


def _built_from(model, config_class: type) -> tuple[list[str], list[str]]:
    """(the modules of ``model`` given a ``config_class`` config when built, the modules inside them its code
    names or shapes as attention)."""
    roots = [
        n
        for n, m in model.named_modules()
        if any(isinstance(c, config_class) for c in m.__dict__.get("_census_configs", ()))
    ]
    roots = [r for r in roots if not any(_inside(r, o) and r != o for o in roots)]  # the outermost
    return roots, [a for a in _attention_modules(model) if any(_inside(a, r) for r in roots)]


def _nesting(model_type: str) -> tuple[str, str, type] | None:
    """(the type whose config declares ``model_type``'s config as a sub-config, under which key, that config
    class), or None."""
    from transformers import CONFIG_MAPPING

    own = CONFIG_MAPPING[model_type]
    for parent in CONFIG_MAPPING:
        if parent == model_type:
            continue
        try:
            subs = getattr(CONFIG_MAPPING[parent], "sub_configs", None) or {}
        except Exception:  # noqa: BLE001 - a type whose config does not import
            continue
        key = next((k for k, c in subs.items() if c is own), None)
        if key is not None:
            return parent, key, own
    return None


class _Names:
    """Checkpoint tensor names <-> the model's own parameter names, matched by their bytes (a checkpoint may
    spell names another way than the modules: transformers' key mappings)."""

    def __init__(self, model, saved: dict[str, torch.Tensor]):
        by_bytes: dict[tuple, list[str]] = {}
        for name, t in model.state_dict(keep_vars=False).items():
            by_bytes.setdefault(_key(t), []).append(name)
        self.to_model = {n: by_bytes.get(_key(t), []) or self._by_name(model, n) for n, t in saved.items()}

    @staticmethod
    def _by_name(model, tensor: str) -> list[str]:
        """A tensor the model stores otherwise (transformers converts some on save): the model's parameter of
        that name, or of that name less the base model's prefix, if there is one."""
        params = dict(model.named_parameters())
        prefix = getattr(model, "base_model_prefix", "")
        names = (tensor, tensor.removeprefix(prefix + ".")) if prefix else (tensor,)
        return [n for n in dict.fromkeys(names) if n in params][:1]

    def modules(self, tensor: str) -> list[str]:
        """The model modules that own checkpoint tensor ``tensor``."""
        return [m.rpartition(".")[0] for m in self.to_model.get(tensor, [])]


def _judge(model_type: str, model, config, folder: Path, tmp: Path) -> Verdict:
    import surgeon
    from surgeon.errors import SurgeonError

    ran: set[str] = set()
    try:
        seen = observe(model, config, ran)
        why = ""
    except Exception as e:  # noqa: BLE001
        seen, why = None, _one_line(e)
    reports = {}
    for layers in ("all", "-1"):
        try:
            reports[layers] = surgeon.reinit_checkpoint(folder, layers=layers, output=tmp / f"out{layers}", seed=0)
        except SurgeonError as e:
            if layers == "-1" and "selects only layers without attention" in str(e):
                reports[layers] = None  # judged below: the model's own last layer must run no attention
                continue
            reason = _reason(str(e))
            if reason == "no attention" and seen is not None and not seen:
                return Verdict(model_type, "none: no attention, and the forward runs none", str(e)[:200])
            if reason == "no attention" and seen is None and not _attention_modules(model):
                return Verdict(model_type, "none: no attention, and the model's code has no attention module", why)
            return Verdict(model_type, f"refused: {reason}", str(e).splitlines()[0][:400])
        except Exception as e:  # noqa: BLE001
            return Verdict(model_type, f"crash: {_one_line(e)}")
    n = len(reports["all"].blocks)
    judged_by = "forward"
    if seen is None:
        seen = declared_attention(model)
        if not seen:
            return Verdict(model_type, f"unjudged: the forward did not run ({why})", blocks=n)
        judged_by = "construction"
    else:  # attention modules no forward of the census entered (a tower its inputs did not run): as built
        run = len(seen)
        seen = dict(seen)
        for name, built in declared_attention(model).items():
            if name not in ran and not any(_inside(name, a) or _inside(a, name) for a in seen):
                seen[name] = built
    saved = _tensors(folder)
    names = _Names(model, saved)
    problems = []
    for layers, report in reports.items():
        if report is None:
            problems += _no_last_attention(model, seen)
            continue
        problems += [
            f"{p} (--layers {layers})"
            for p in _problems(model, seen, report, saved, names, tmp / f"out{layers}", layers == "-1")
        ]
    wrong = [p for p in problems if not p.startswith("unjudged: ")]
    if problems and not wrong:
        return Verdict(
            model_type, problems[0], "; ".join(problems[:4]), blocks=n, notes=reports["all"].notes, judged_by=judged_by
        )
    if wrong:
        problems = wrong
        return Verdict(
            model_type,
            f"wrong: {problems[0]}",
            "; ".join(problems[:4]),
            blocks=n,
            notes=reports["all"].notes,
            judged_by=judged_by,
        )
    how = (
        f"{run} attention modules run" + (f", {len(seen) - run} more as built" if len(seen) > run else "")
        if judged_by == "forward"
        else f"{len(seen)} attention modules as built (the forward did not run: {why})"
    )
    return Verdict(model_type, "right", f"{n} blocks, {how}", blocks=n, notes=reports["all"].notes, judged_by=judged_by)


def _problems(model, seen, report, saved, names: _Names, out: Path, last_only: bool) -> list[str]:
    problems: list[str] = []
    after = _tensors(out)
    problems += [f"the output lacks {n}" for n in saved if n not in after][:1]
    loaded, why = _load(model, out)
    if loaded is not None:  # judged on the model's own parameters, as its loader reads the output
        old = model.state_dict()
        new = loaded.state_dict()
        changed_params = {n: new[n] for n in old if n in new and not _same(old[n], new[n])}
        changed_modules = {n.rpartition(".")[0] for n in changed_params}
    else:
        original = _load(model, out.parent / "model")[1]
        if not original:
            return problems + [f"the output does not load back: {why}"]
        changed = [n for n, t in saved.items() if n in after and not _same(after[n], t)]
        changed_params = {}
        changed_modules = {m for n in changed for m in names.modules(n)}
        if any(not names.modules(n) for n in changed):  # a tensor saved otherwise than the model holds it
            return problems + [f"unjudged: the model's own class does not load its own checkpoint ({original[:120]})"]

    def attention_of(module: str) -> str | None:
        owners = [a for a in seen if _inside(module, a) or _inside(a, module)]
        return max(owners, key=len) if owners else None

    ran = [name for name, _ in model.named_modules() if any(_inside(a, name) or _inside(name, a) for a in seen)]
    seen = dict(seen)
    for m in sorted(changed_modules):
        if attention_of(m) is None:
            # no forward ran its attention (or ran it where the census cannot see): the heads its attention module
            # was built with and declares, a judgement made at construction
            found = _declared(model, m)
            if found is not None:
                seen[found[0]] = found[1]
    for m in sorted(changed_modules):
        if attention_of(m) is None:
            # run: the projection, or the module that holds it, was entered (not merely a tower around it)
            if m not in ran and m.rpartition(".")[0] not in ran:
                problems.append(f"unjudged: {m} changed, and no forward runs it")
            elif "attention" in type(model.get_submodule(m.rpartition(".")[0] or m)).__name__.lower():
                problems.append(f"unjudged: {m} changed in an attention class whose softmax is not torch's")
            else:
                problems.append(f"{m} changed, but the forward computes no softmax attention there")
    for name, weight in changed_params.items():
        a = attention_of(name.rpartition(".")[0])
        if a is not None:
            layer = loaded.get_submodule(name.rpartition(".")[0]) if loaded is not None else None
            if type(layer).__name__ == "Conv1D":  # GPT-2's Conv1D stores (in, out)
                weight = weight.T
            problems += _conditioned_per_head(name, weight, seen[a])
    for row in report.rows:
        block = row.block
        if row.role != "q" or block.module.endswith(":context"):
            continue
        for m in names.modules(block.q.weight.tensor):
            a = attention_of(m)
            s = seen.get(a) if a else None
            if s is None:
                continue
            for what, ours, theirs in (
                ("heads", block.heads, s.heads),
                ("kv heads", block.kv_heads, s.kv_heads),
                ("head size", block.head_dim, s.head_dim),
            ):
                if theirs is not None and ours != theirs:
                    problems.append(f"{m}: {ours} {what}, the forward uses {theirs}")
    notes = " ".join(report.notes)
    # a block several layers run (Zamba's shared attention, tied across its hybrid layers): selecting one of
    # them changes it for all, which the report must say
    shared = " ".join(n for n in report.notes if "is one block that layers" in n)
    last: dict[str, tuple[int, ...]] = {}
    for a in seen:
        place = _layer_of(a, model)
        if place is not None:
            last[place[0]] = max(last.get(place[0], ()), place[1])
    for a in seen:
        place = _layer_of(a, model)
        wanted = not last_only or place is None or place[1] == last.get(place[0])
        touched = any(_inside(m, a) or _inside(a, m) for m in changed_modules)
        if wanted and not touched and not _named(a, names, notes):
            problems.append(f"{a} runs attention, left untouched without a word")
        if last_only and touched and not wanted and not _named(a, names, shared):
            problems.append(f"{a} changed, not in the last layer")
    return problems


HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attention_heads_per_partition", "heads")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "dim_head", "d_head", "key_value_proj_dim")


def _config_of(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def _attention_modules(model) -> list[str]:
    """The model's modules that its own code names or shapes as attention: a class called so, torch's
    MultiheadAttention, or a module declaring its heads (for a model whose forward the census cannot run)."""
    return [
        name
        for name, m in model.named_modules()
        if re.search(r"att(ention|n)|multihead|mha", type(m).__name__, re.I) or _attr(m, HEADS_ATTRS)
    ]


def _declared(model, module: str) -> tuple[str, Seen] | None:
    """The nearest module at or above ``module`` that declares its heads and head size, for attention no forward
    of the census ran."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        seen = _declares(model.get_submodule(name))
        if seen is not None:
            return name, seen
    return None


def _declares(m) -> Seen | None:
    """The heads, key/value heads and head size module ``m`` declares: as attributes (the model's own
    ``self.num_heads``, ``self.head_dim``), else as the arguments its constructor received (a Perceiver
    resampler's ``n_heads``, ``head_dim``); None where it declares no heads and head size."""
    heads, head_dim = _attr(m, HEADS_ATTRS), _attr(m, HEAD_DIM_ATTRS)
    if heads is None and head_dim and hasattr(m, "num_key_value_groups"):  # the config it was built with
        heads = _attr(getattr(m, "config", None), HEADS_ATTRS)
    via = "attributes"
    args = m.__dict__.get("_census_built_with", {})
    if not (heads and head_dim) and args:
        heads, head_dim, via = heads or _arg(args, HEADS_ARGS), head_dim or _arg(args, HEAD_DIM_ARGS), "constructor"
    if heads and not head_dim:  # heads declared, the head size what the forward splits its own query into
        query = next((c for n, c in m.named_children() if QUERY_CHILD.match(n) and hasattr(c, "out_features")), None)
        if query is not None and query.out_features % heads == 0 and not QKV_CHILD.match(_child_name(m, query)):
            head_dim, via = query.out_features // heads, "declared heads, split query"
    if head_dim and not heads:  # a head size declared, the heads what the query's width holds of it (ESMFold2)
        query = next((c for n, c in m.named_children() if QUERY_CHILD.match(n) and hasattr(c, "out_features")), None)
        if query is not None and query.out_features % head_dim == 0 and not QKV_CHILD.match(_child_name(m, query)):
            heads, via = query.out_features // head_dim, "declared head size, split query"
    if not (heads and head_dim):
        return None
    groups = getattr(m, "num_key_value_groups", None)
    kv = (
        _attr(m, KV_ATTRS)
        or _arg(args, KV_ATTRS)
        or (heads // groups if isinstance(groups, int) and groups > 0 else None)
    )
    return Seen(heads, kv, head_dim, via)


HEADS_ARGS = HEADS_ATTRS + ("attention_heads", "num_head")
HEAD_DIM_ARGS = HEAD_DIM_ATTRS + ("attention_head_dim", "kv_channels", "dim_per_head")


def _arg(args: dict[str, int], names) -> int | None:
    return next((args[n] for n in names if isinstance(args.get(n), int) and args[n] > 0), None)


# a module with a child of such a name projects queries (a Mamba mixer declares heads, but projects none)
QUERY_CHILD = re.compile(
    r"(q|query|to_q|to_qkv|q_proj|qkv|qkv_proj|wq|wqkv|c_attn|query_key_value|Wqkv|q_lin|query_net)$"
)


QKV_CHILD = re.compile(r"(to_qkv|qkv|qkv_proj|wqkv|c_attn|query_key_value|Wqkv)$")


def _child_name(parent, child) -> str:
    return next(n for n, c in parent.named_children() if c is child)


def declared_attention(model) -> dict[str, Seen]:
    """The construction-time capture: every attention module the model's own code built (its class names it
    attention, or it declares heads), with the heads and head size it declares, where it declares both; the
    innermost such module of each nest (the one that owns the projections). What judges a model whose
    forward the census cannot run."""
    found = {}
    for name, m in model.named_modules():
        if not name or next(m.parameters(), None) is None:
            continue
        seen = _declares(m)
        if seen is not None and (
            re.search(r"att(ention|n)|multihead|mha", type(m).__name__, re.I)
            or any(QUERY_CHILD.match(child) for child, _ in m.named_children())
        ):
            found[name] = seen
    return {n: s for n, s in found.items() if not any(o != n and _inside(o, n) for o in found)}


def _attr(module, names) -> int | None:
    return next((v for v in (getattr(module, n, None) for n in names) if isinstance(v, int) and v > 0), None)


def _conditioned_per_head(name: str, weight: torch.Tensor, seen: Seen) -> list[str]:
    """A re-initialized projection weight with one row block per head of the forward (heads x head size
    output features): each head's block has condition number 1, and -- unless it is the value identity --
    two neighbouring heads are independent draws, not one orthonormal block cut in two."""
    if weight.dim() != 2 or not seen.head_dim:
        return []
    d = seen.head_dim
    counts = {c for c in (seen.heads, seen.kv_heads) if c}
    rows = weight.shape[0]
    if rows not in {c * d for c in counts} or weight.shape[1] < 2 * d:
        return []
    w = weight.double()
    blocks = w.reshape(rows // d, d, -1)
    sv = torch.linalg.svdvals(blocks)
    kappa = (sv[:, 0] / sv[:, -1].clamp_min(1e-30)).max().item()
    if kappa > 1.001:
        return [f"{name}: a head of the forward ({d} rows) has condition number {kappa:.3g}, not 1"]
    identity = bool(((w == 0) | (w == w.abs().max())).all())
    if rows // d > 1 and not identity:
        cross = (blocks[0] @ blocks[1].T).abs().max().item() / (sv[0, 0].item() ** 2)
        if cross < 1e-6:
            return [f"{name}: heads 0 and 1 of the forward are one orthonormal block (the heads were cut wider)"]
    return []


def _no_last_attention(model, seen) -> list[str]:
    """surgeon said the last layer runs no attention: the model's own modules must agree."""
    places = [p for p in (_layer_of(a, model) for a in seen) if p is not None]
    problems = []
    for stack in {p[0] for p in places}:
        children = model.get_submodule(stack)
        last = len(children) - 1
        if any(p[0] == stack and p[1][0] == last for p in places):
            problems.append(f"--layers -1 refused, but layer {last} of {stack} runs attention")
    return problems


def _named(attention: str, names: _Names, notes: str) -> bool:
    """Whether the report names the attention module (by its checkpoint path, or its layer's)."""
    for tensor, modules in names.to_model.items():
        if any(_inside(m, attention) for m in modules):
            parts = tensor.split(".")
            for i in range(len(parts) - 1, 0, -1):
                if ".".join(parts[:i]) in notes:
                    return True
    return False


def _load(model, folder: Path):
    """(the model's own class loaded from ``folder``, None) with every key, or (None, why)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):  # a plain module: built from its config, its state dict loaded strictly
        from safetensors.torch import load_model

        try:
            loaded = type(model)(_config_of(folder))
            load_model(loaded, str(folder / "model.safetensors"), strict=True)
        except Exception as e:  # noqa: BLE001
            return None, _one_line(e)
        return loaded.eval(), ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded, info = type(model).from_pretrained(folder, output_loading_info=True)
    except Exception as e:  # noqa: BLE001
        return None, _one_line(e)
    bad = list(info.get("missing_keys", [])) + list(info.get("unexpected_keys", []))
    if bad:
        return None, f"{type(model).__name__} misses or does not expect {sorted(bad)[:2]}"
    return loaded, ""
