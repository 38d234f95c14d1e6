"""Head counts, head dim and fused-layout flags from a Hugging Face ``config.json``.

Families spell the same fact differently (``num_attention_heads``, ``n_head``, ``num_heads``, ...);
encoder-decoder models have per-stack counts; multimodal models nest a config per tower. This module
turns all of that into one answer per stack of layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError, opt
from .families import (  # noqa: F401
    FUSED_PACKING_BY_MODEL_TYPE,
    HEAD_DIM_KEYS,
    HEADS_KEYS,
    HIDDEN_KEYS,
    KV_HEADS_KEYS,
    SUBCONFIG_WORDS,
)
from .libraries import fused_packing as library_packing
from .libraries import normalize_config, stack_scope


@dataclass(frozen=True)
class Hints:
    """What the user says about heads, overriding config.json (``--num-heads`` etc.)."""

    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    force: bool = False  # --force-hints: a hint wins even where config.json says otherwise


@dataclass(frozen=True)
class StackFacts:
    heads: int | list[int] | None
    kv_heads: int | list[int] | None
    head_dim: int | None
    hidden: int | None
    source: str  # where the numbers came from, for messages

    def pick(self, value, stage: int | None):
        if isinstance(value, list):  # per-stage lists (Swin): indexed by the stage number
            if stage is None or stage >= len(value):
                return None
            return value[stage]
        return value


class ConfigView:
    def __init__(self, config: dict | None, hints: Hints | None = None) -> None:
        self.config = normalize_config(config) or {}  # a library's own config (diffusers, open_clip, timm) in these terms
        self.has_config = config is not None
        self.hints = hints or Hints()

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def _scope(self, stack: str) -> tuple[dict, str]:
        """The (sub)config that describes ``stack``, and its name.

        The first word of the path that names a tower decides: ``decoder.bert.encoder.layer`` (the
        decoder of an EncoderDecoderModel) is described by ``decoder``, not by ``encoder``.
        """
        library = stack_scope(self.config, stack)
        if library is not None:
            return library, "the library's config"
        for word in (w.lower() for w in stack.split(".")):
            for key, markers in SUBCONFIG_WORDS.items():
                sub = self.config.get(key)
                if isinstance(sub, dict) and any(m in word for m in markers):
                    return sub, f"config.json {key}"
        return self.config, "config.json"

    def facts(self, stack: str) -> StackFacts:
        scope, source = self._scope(stack)
        nested = [scope] + [v for k, v in scope.items() if k in ("attn_config", "attention_config") and isinstance(v, dict)]
        decoder = any("decoder" in w for w in stack.lower().split("."))
        side = "decoder" if decoder else "encoder"
        heads = _first(nested, (f"{side}_attention_heads", f"num_{side}_attention_heads") + HEADS_KEYS)
        kv_heads = _first(nested, KV_HEADS_KEYS)
        # Multi-query flags win over a kv-heads count that the model does not use (Falcon, GPTBigCode).
        if scope.get("new_decoder_architecture"):
            pass
        elif scope.get("multi_query") is True:
            kv_heads = 1
        elif self.model_type == "falcon" or "multi_query" in scope or scope.get("multi_query_attention") is False:
            kv_heads = None
        head_dim = _first(nested, HEAD_DIM_KEYS)
        hidden = _first(nested, HIDDEN_KEYS)
        for flag, hint, said in (("num_heads", self.hints.num_heads, heads), ("num_kv_heads", self.hints.num_kv_heads, kv_heads),
                                 ("head_dim", self.hints.head_dim, head_dim)):
            if hint is not None and said is not None and hint != said and not self.hints.force:
                raise LayoutError(
                    f"{opt(flag, hint)} contradicts {source}, which says {said} for {stack or 'the model'}: leave {opt(flag)} out, "
                    f"or pass {opt('force_hints', True)} to override the config"
                )
        if self.hints.num_heads is not None:
            heads, source = self.hints.num_heads, opt("num_heads")
        if self.hints.num_kv_heads is not None:
            kv_heads = self.hints.num_kv_heads
        if self.hints.head_dim is not None:
            head_dim = self.hints.head_dim
        return StackFacts(heads, kv_heads, head_dim if isinstance(head_dim, int) else None, hidden if isinstance(hidden, int) else None, source)

    def fused_packing(self, tensor: str, stack: str, module: str = "") -> str | None:
        """How the fused tensor ``tensor`` (e.g. "query_key_value") of this model packs its rows,
        or None when the config does not say (the rule's default applies where it has one)."""
        scope, _ = self._scope(stack)
        model_type = scope.get("model_type") or self.model_type or ""
        if tensor == "query_key_value":
            if model_type == "falcon" or "new_decoder_architecture" in scope:
                if scope.get("new_decoder_architecture"):
                    return "grouped"
                return "qkv" if scope.get("multi_query", True) else "interleaved"
            if model_type == "chatglm" or "multi_query_attention" in scope:
                # ChatGLM2/3 split [Q | K | V] with multi-query groups, else view rows as (heads, 3 * d)
                return "qkv" if scope.get("multi_query_attention") else "interleaved"
        if tensor == "c_attn" and model_type == "gpt_bigcode" and scope.get("multi_query") is False:
            return "interleaved"  # GPTBigCode without multi-query views c_attn as (heads, 3 * d)
        return FUSED_PACKING_BY_MODEL_TYPE.get((tensor, model_type)) or library_packing(tensor, module, self.config)


def _first(scopes: list[dict], keys: tuple[str, ...]) -> Any:
    for scope in scopes:
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
            if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
                return value
    return None
