"""Head counts, head dim and fused-layout flags from a Hugging Face ``config.json``.

Families spell the same fact differently (``num_attention_heads``, ``n_head``, ``num_heads``, ...);
encoder-decoder models have per-stack counts; multimodal models nest a config per tower. This module
turns all of that into one answer per stack of layers, with the user's hints
(:mod:`surgeon.detect.hints`) checked against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from ..errors import LayoutError, opt
from ..vocab.config_keys import (
    BLOCKS_PER_STAGE_KEYS,
    FRAMEWORK_CONFIGS,
    FUSED_PACKING_BY_MODEL_TYPE,
    GROUP_HEADS,
    HEAD_DIM_KEYS,
    HEAD_DIM_SIDE,
    HEAD_RATIOS,
    HEAD_WIDTHS,
    HEADS_KEYS,
    HIDDEN_KEYS,
    KV_HEADS_KEYS,
    LAYER_TYPE_KEYS,
    LAYER_TYPE_PREFIXES,
    LAYER_TYPE_SCALES,
    LINEAR_LAYER_TYPES,
    MEGATRON_LEGACY_QKV,
    MEGATRON_VERSION,
    PER_LAYER_CONFIG_KEYS,
    PER_LAYER_SUFFIX,
    PER_STAGE_SUFFIX,
    ROTARY_FREE_LATENT_LAYERS,
    SUBCONFIG_BY_PATH,
    V_HEAD_DIM_KEYS,
    nested,
)
from . import subconfigs
from .families import Latent
from .hints import Hints
from .layout_file import LAYOUT_KEYS, Layout
from .libraries import fused_packing as library_packing
from .libraries import normalize_config, stack_scope
from .subconfigs import HEAD_FACTS


@dataclass(frozen=True)
class StackFacts:
    heads: int | list[int] | None
    kv_heads: int | list[int] | None
    head_dim: int | None
    hidden: int | None
    source: str  # where the numbers came from, for messages
    v_head_dim: int | None = None  # a value head size of its own (MiMo-V2-Flash's v_head_dim), where it differs
    hinted: tuple[str, ...] = ()  # the hints (num_heads, num_kv_heads, head_dim) the user gave for these numbers

    def pick(self, value: int | list[int] | None, stage: int | None) -> int | None:
        if isinstance(value, list):  # per-stage lists (Swin): indexed by the stage number
            if stage is None or stage >= len(value):
                return None
            return value[stage]
        return value


class ConfigView:
    def __init__(
        self, config: dict | None, hints: Hints | None = None, aliases: Mapping[str, tuple[str, ...]] | None = None
    ) -> None:
        self.config = (
            normalize_config(config) or {}
        )  # a library's own config (diffusers, open_clip, timm) in these terms
        self.has_config = config is not None
        self.hints = hints or Hints()
        # a stack's other spellings (surgeon.detect.renames: the names transformers loads the checkpoint's as)
        self.aliases = dict(aliases or {})
        # how messages name it: a framework's own file (litgpt's model_config.yaml), else config.json
        self.file = next((f.file for f in FRAMEWORK_CONFIGS if self.model_type == f.model_type), "config.json")

    @property
    def model_type(self) -> str | None:
        model_type = self.config.get("model_type")
        return model_type if isinstance(model_type, str) else None  # a list or object names no family

    def _scope(self, stack: str) -> tuple[dict, str]:
        """The (sub)config that describes ``stack``, and its name; where the stack's own name leads to a config
        that says no heads, the first of its aliases that leads to one that does."""
        scope, source = self._scope_of(stack)
        if _first([scope], HEAD_FACTS) is None:
            for alias in self.aliases.get(stack, ()):
                other, named = self._scope_of(alias)
                if _first([other], HEAD_FACTS) is not None:
                    return other, f"{named} (for {stack}, which transformers names {alias})"
        return scope, source

    def _scope_of(self, stack: str) -> tuple[dict, str]:
        """The (sub)config that describes ``stack`` by its own name, and its name.

        Each word of the path in turn may name a tower nested in the config chosen so far
        (:func:`surgeon.detect.subconfigs.subconfig_key`): ``vlm.language_model.layers`` is described by ``vlm_config``'s
        ``text_config``; ``decoder.bert.encoder.layer`` (an EncoderDecoderModel's decoder) by ``decoder``.
        """
        library = stack_scope(self.config, stack)
        if library is not None:
            return library, "the library's config"
        scope, names = self.config, []
        overrides = SUBCONFIG_BY_PATH.get(self.model_type or "", {})
        # a whole stack's path, also under a head model's prefix (T5Gemma 2's model.encoder.layers)
        whole = next((v for k, v in overrides.items() if "." in k and subconfigs.under_one_word(stack.lower(), k)), "")
        if whole and (own := subconfigs.override(scope, whole)) is not None:
            return own[0], f"{self.file} {own[1]}"  # a whole stack's own entry (T5Gemma 2, Evolla's resampler)
        for word in (w.lower() for w in stack.split(".")):
            spec = overrides.get(word, "") if scope is self.config else ""
            if (
                "/" in spec and (own := subconfigs.override(scope, spec)) is not None
            ):  # "key/prefix", "/prefix" of this config
                scope = own[0]
                names.append(own[1])
                continue
            key = spec
            found = key if isinstance(nested(scope, key), dict) else subconfigs.subconfig_key(scope, word)
            if found is not None:
                key = found
                scope = nested(scope, key)
                names.append(key)
            elif (prefixed := subconfigs.prefixed_scope(scope, word)) is not None:
                scope, prefix = prefixed
                names.append(prefix + "*")
        return scope, f"{self.file} " + ".".join(names) if names else self.file

    def doubt(self, stack: str, module: str) -> str | None:
        """Why surgeon cannot tell which config ``stack``'s heads come from, or None: config.json gives heads
        under a prefix that a word of the path names (``resampler_heads`` for ``...compressor_resampler...``),
        other than those of the config the path leads to, and no SUBCONFIG_BY_PATH entry settles it."""
        scope, source = self._scope(stack)
        ours = self.facts(stack).heads
        for word in module.split("."):
            key = GROUP_HEADS.get(word)
            if key is not None and key in scope and scope[key] != ours:
                return (
                    f"cannot tell the heads of {module}: it runs {source} {key} ({scope[key]}) groups as heads, "
                    f"and {source} says {ours} heads; leave it out of the selection"
                )
        if source.endswith("*"):  # the path's own prefixed keys were read
            return None
        ours_all = ours if isinstance(ours, list) else [ours]
        words = (p for w in stack.lower().split(".") for p in w.split("_") if len(p) > 3 and p not in _SIDE_WORDS)
        for part in dict.fromkeys(words):
            for key in (f"{part}_{k}" for k in HEADS_KEYS):
                theirs = self.config.get(key)
                if isinstance(theirs, int) and not isinstance(theirs, bool) and theirs > 0 and theirs not in ours_all:
                    return (
                        f"cannot tell which config {module or stack} was built from: {source} says {ours} heads, "
                        f"{self.file} {key} says {theirs}; pass {opt('num_heads', f'{stack}=N')} and "
                        f"{opt('head_dim', f'{stack}=D')}, or leave it out of the selection"
                    )
        return None

    def linear_layer(self, stack: str, layer: int) -> bool:
        """Whether the config says layer ``layer`` of ``stack`` is linear attention (LINEAR_LAYER_TYPES)."""
        return self._layer_type(self._scope(stack)[0], layer) in LINEAR_LAYER_TYPES

    @staticmethod
    def _layer_type(scope: dict, layer: int | None) -> str | None:
        for key in LAYER_TYPE_KEYS:
            types = scope.get(key)
            if layer is not None and isinstance(types, list) and layer < len(types) and isinstance(types[layer], str):
                return types[layer]
        return None

    def _layer_facts(self, scope: dict, layer: int | None) -> list[dict]:
        """What the config says of layer ``layer`` alone, first: its per-layer entries, the keys of its
        layer type (LAYER_TYPE_PREFIXES), its entry in per-layer lists."""
        if layer is None:
            return []
        out = []
        for key in PER_LAYER_CONFIG_KEYS:
            table = scope.get(key)
            if isinstance(table, dict):
                out += [
                    v
                    for k, v in table.items()
                    if isinstance(v, dict) and str(k).strip().isascii() and str(k).strip().isdigit() and int(k) == layer
                ]
        layer_type = self._layer_type(scope, layer) or ""
        prefix = LAYER_TYPE_PREFIXES.get(layer_type)
        if prefix:
            out.append({k.removeprefix(prefix): v for k, v in scope.items() if k.startswith(prefix)})
        scales = LAYER_TYPE_SCALES.get((str(scope.get("model_type")), layer_type), {})
        scaled = {k: scope[k] * f for k, f in scales.items() if isinstance(scope.get(k), int)}
        out += [scaled] if scaled else []
        lists = {
            k.removesuffix(PER_LAYER_SUFFIX): v[layer]
            for k, v in scope.items()
            if k.endswith(PER_LAYER_SUFFIX) and isinstance(v, list) and layer < len(v) and isinstance(v[layer], int)
        }
        return out + ([lists] if lists else []) + self._stage_facts(scope, layer)

    @staticmethod
    def _stage_facts(scope: dict, layer: int) -> list[dict]:
        """The per-stage entries (``*_per_stage``) of the stage that flat block ``layer`` belongs to, where
        the config counts each stage's blocks (BLOCKS_PER_STAGE_KEYS)."""
        for key in BLOCKS_PER_STAGE_KEYS:
            counts = scope.get(key)
            if not (isinstance(counts, list) and all(isinstance(c, int) and c >= 0 for c in counts)):
                continue
            stage = next((i for i, end in enumerate(accumulate(counts)) if layer < end), None)
            if stage is None:
                return []
            return [
                {
                    k.removesuffix(PER_STAGE_SUFFIX): v[stage]
                    for k, v in scope.items()
                    if k.endswith(PER_STAGE_SUFFIX) and isinstance(v, list) and len(v) == len(counts)
                }
            ]
        return []

    def facts(self, stack: str, *, cross: bool = False, layer: int | None = None) -> StackFacts:
        """Heads, key/value heads, head size and width of ``stack``'s attention (``cross``: its
        cross-attention, where the config gives that its own: Dia's cross_num_attention_heads; ``layer``:
        of that layer, where the config says more of it: Gemma-4's per_layer_config)."""
        scope, source = self._scope(stack)
        nested = (
            self._layer_facts(scope, layer)
            + [scope]
            + [v for k, v in scope.items() if k in ("attn_config", "attention_config") and isinstance(v, dict)]
        )
        decoder = any("decoder" in w for w in stack.lower().split("."))
        side = "decoder" if decoder else "encoder"
        # per-stack keys first: encoder_attention_heads (BART), encoder_num_attention_heads (Moonshine)
        crossed = _sided("cross", HEADS_KEYS + KV_HEADS_KEYS + HEAD_DIM_KEYS) if cross else ()
        heads = _first(
            nested,
            tuple(k for k in crossed if k.removeprefix("cross_") in HEADS_KEYS)
            + (f"{side}_{'cross' if cross else 'self'}_attention_heads",)  # LW-DETR, RF-DETR
            + (f"{side}_attention_heads", f"num_{side}_attention_heads")
            + _sided(side, HEADS_KEYS)
            + HEADS_KEYS,
        )
        kv_heads = _first(
            nested,
            tuple(k for k in crossed if k.removeprefix("cross_") in KV_HEADS_KEYS)
            + _sided(side, KV_HEADS_KEYS)
            + KV_HEADS_KEYS,
        )
        # Multi-query flags win over a kv-heads count that the model does not use (Falcon, GPTBigCode).
        if scope.get("new_decoder_architecture"):
            pass
        elif scope.get("multi_query") is True:
            kv_heads = 1
        elif self.model_type == "falcon" or "multi_query" in scope or scope.get("multi_query_attention") is False:
            kv_heads = None
        head_dim = _first(
            nested,
            tuple(k for k in crossed if k.removeprefix("cross_") in HEAD_DIM_KEYS)
            + _sided(side, HEAD_DIM_KEYS)
            + (HEAD_DIM_KEYS if HEAD_DIM_SIDE.get(str(scope.get("model_type")), side) == side else ()),
        )
        hidden = _first(nested, HIDDEN_KEYS)
        for key, share in HEAD_RATIOS.items():  # heads divided by a ratio, of a share of the width (ConvBERT)
            ratio = _first(nested, (key,))
            if isinstance(ratio, int) and isinstance(heads, int) and isinstance(hidden, int) and head_dim is None:
                heads = max(1, heads // ratio)
                head_dim = hidden // heads // share
        width = HEAD_WIDTHS.get(str(scope.get("model_type")))
        if heads is None and width and isinstance(hidden, int) and hidden % width == 0:
            heads, head_dim = hidden // width, width  # the family's code derives them (HEAD_WIDTHS)
        hinted = {name: self.hints.get(name, stack) for name in ("num_heads", "num_kv_heads", "head_dim")}
        for flag, said in (("num_heads", heads), ("num_kv_heads", kv_heads), ("head_dim", head_dim)):
            hint = hinted[flag]
            if hint is not None and said is not None and hint != said and not self.hints.force:
                if flag in self.hints.from_layout and isinstance(self.hints.layout, Layout):
                    raise LayoutError(
                        f"layout file {self.hints.layout.path}: {LAYOUT_KEYS[flag]} {hint} contradicts {source}, which "
                        f"says {said} for {stack or 'the model'}: fix or leave out {LAYOUT_KEYS[flag]} there, or pass "
                        f"{opt('force_hints', True)} to override the config"
                    )
                raise LayoutError(
                    f"{opt(flag, hint)} contradicts {source}, which says {said} for {stack or 'the model'}: leave {opt(flag)} out, "
                    f"or pass {opt('force_hints', True)} to override the config"
                )
        if hinted["num_heads"] is not None:
            heads, source = hinted["num_heads"], opt("num_heads")
        if hinted["num_kv_heads"] is not None:
            kv_heads = hinted["num_kv_heads"]
        if hinted["head_dim"] is not None:
            head_dim = hinted["head_dim"]
        v_head_dim = _first(nested, V_HEAD_DIM_KEYS)
        return StackFacts(
            heads,
            kv_heads,
            head_dim if isinstance(head_dim, int) else None,
            hidden if isinstance(hidden, int) else None,
            source,
            v_head_dim if isinstance(v_head_dim, int) and not isinstance(v_head_dim, bool) and v_head_dim > 0 else None,
            tuple(name for name, value in hinted.items() if value is not None),
        )

    def latent_sizes(self, stack: str, latent: Latent, layer: int | None = None) -> tuple[int, int, int] | None:
        """(key size without the rotary part, rotary part, value size) of ``stack``'s latent attention in layer
        ``layer``, as the config gives them (the keys ``latent`` names; what the config says of that layer alone
        first: Dots 3's per_layer_config), or None. A layer its family builds without a rotary part
        (ROTARY_FREE_LATENT_LAYERS: Mistral Large 4's no_rope_layers) has its rotary size folded into the key's."""
        scope, _ = self._scope(stack)
        scopes = self._layer_facts(scope, layer) + [scope]
        sizes = [
            next((s[k] for s in scopes if isinstance(s.get(k), int) and not isinstance(s.get(k), bool)), None)
            for k in (latent.nope_key, latent.rope_key, latent.value_key)
        ]
        nope, rope, value = (v if isinstance(v, int) and v >= 0 else None for v in sizes)
        if nope is None or rope is None or value is None or nope + rope == 0 or value == 0:
            return None
        if self._rotary_free(scope, layer):
            return nope + rope, 0, value
        return nope, rope, value

    @staticmethod
    def _rotary_free(scope: dict, layer: int | None) -> bool:
        """Whether the config marks latent attention layer ``layer`` as built without a rotary part."""
        key, marker = ROTARY_FREE_LATENT_LAYERS.get(str(scope.get("model_type")), ("", None))
        marks = scope.get(key) if key else None
        if layer is None or not isinstance(marks, list) or layer >= len(marks):
            return False
        return marks[layer] == marker and not isinstance(marks[layer], bool)

    def fused_packing(self, tensor: str, stack: str, module: str = "") -> str | None:
        """How the fused tensor ``tensor`` (e.g. "query_key_value") of this model packs its rows,
        or None when the config does not say (the rule's default applies where it has one)."""
        scope, _ = self._scope(stack)
        model_type = scope.get("model_type")
        model_type = model_type if isinstance(model_type, str) and model_type else self.model_type or ""
        if tensor == "query_key_value":
            if model_type == "falcon" or "new_decoder_architecture" in scope:
                if scope.get("new_decoder_architecture"):
                    return "grouped"
                return "qkv" if scope.get("multi_query", True) else "interleaved"
            if model_type == "chatglm" or "multi_query_attention" in scope:
                # ChatGLM2/3 split [Q | K | V] with multi-query groups, else view rows as (heads, 3 * d)
                return "qkv" if scope.get("multi_query_attention") else "interleaved"
        if tensor == "query_key_value" and MEGATRON_VERSION in scope:  # Megatron-LM's legacy model_optim_rng.pt
            return megatron_legacy_packing(scope[MEGATRON_VERSION])
        if tensor == "c_attn" and model_type == "gpt_bigcode" and scope.get("multi_query") is False:
            return "interleaved"  # GPTBigCode without multi-query views c_attn as (heads, 3 * d)
        return FUSED_PACKING_BY_MODEL_TYPE.get((tensor, model_type)) or library_packing(tensor, module, self.config)


# path words whose prefixed heads facts() reads itself (decoder_attention_heads for a decoder's stack)
_SIDE_WORDS = ("encoder", "decoder", "cross")


def megatron_legacy_packing(version: object) -> str:
    """How a Megatron-LM legacy checkpoint of ``version`` packs query_key_value (config_keys.MEGATRON_LEGACY_QKV)."""
    number = version if isinstance(version, (int, float)) and not isinstance(version, bool) else None
    packing = MEGATRON_LEGACY_QKV.get(float(number)) if number is not None else None
    if packing is None:
        known = ", ".join(f"{v:g}" for v in MEGATRON_LEGACY_QKV)
        raise LayoutError(
            f"a Megatron-LM checkpoint of checkpoint_version {version!r}: surgeon knows how query_key_value packs its "
            f"rows in versions {known} only; load it and save it again with Megatron-LM (which writes version 3.0), "
            "then run surgeon on that"
        )
    return packing


def with_transformers_defaults(config: dict | None) -> dict | None:
    """``config`` with what its model type's config class defaults to filled in, where transformers is
    installed and knows the type (None otherwise): save_pretrained writes only the values that differ from
    those defaults, so a config.json may leave out the heads of a tower it nests. Nothing is read from the
    folder for this; the defaults are transformers' own code."""
    defaults = _defaults(config.get("model_type") if config else None)
    return None if defaults is None or config is None else _merged(defaults, config)


def _defaults(model_type: object) -> dict | None:
    if not isinstance(model_type, str) or not model_type:
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type).to_dict()
    except Exception:  # noqa: BLE001 - transformers absent, or a type it does not know: no defaults
        return None


def _merged(defaults: dict, config: dict) -> dict:
    out = dict(defaults)
    for key, value in config.items():
        base = out.get(key)
        if isinstance(value, dict) and isinstance(base, dict):
            if value.get("model_type", base.get("model_type")) != base.get("model_type"):
                base = _defaults(value.get("model_type")) or {}  # a nested config of another type than the default's
            out[key] = _merged(base, value)
        else:
            out[key] = value
    return out


def _sided(side: str, keys: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{side}_{key}" for key in keys)


def _first(scopes: list[dict], keys: tuple[str, ...]) -> Any:
    for scope in scopes:
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
            if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
                return value
    return None
