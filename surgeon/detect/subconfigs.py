"""Which (sub)config of a config.json describes a stack, word by word of its module path: the config nested under a
key a word names (``visual`` names ``vision_config``), keys under a prefix a word names (SeamlessM4T's
``t2u_model``: ``t2u_*``), a family's own entry (SUBCONFIG_BY_PATH: a nested key, "key/prefix", "/prefix").

Nothing here imports torch, numpy or onnx.
"""

from __future__ import annotations

from ..vocab.config_keys import HEAD_DIM_KEYS, HEADS_KEYS, HIDDEN_KEYS, SUBCONFIG_WORDS, nested


def subconfig_key(scope: dict, word: str) -> str | None:
    """The key of the config nested in ``scope`` that a module-path word names, or None: a word of
    SUBCONFIG_WORDS (``visual`` names ``vision_config``), or the key's own stem (``qformer`` names
    ``qformer_config``, ``image_model`` names ``image_config``, ``image_encoder`` names ``image_model_config``);
    the closest spelling wins."""
    best, best_score = None, 0
    for key, value in scope.items():
        if not isinstance(value, dict) or not any(k in value for k in ("model_type",) + HEADS_KEYS + HIDDEN_KEYS):
            continue
        stem = key.removesuffix("_config")
        if word == stem:
            score = 4
        elif any(m in word for m in SUBCONFIG_WORDS.get(key, ())):
            score = 3
        elif word.startswith(stem + "_") or stem.startswith(word + "_"):
            score = 2
        elif len(word) > 2 and word.split("_")[0] == stem.split("_")[0] and stem != word.split("_")[0] + "s":
            score = 1
        else:
            continue
        if score > best_score:
            best, best_score = key, score
    return best


def prefixed_scope(scope: dict, word: str) -> tuple[dict, str] | None:
    """A tower whose facts sit in the config under a prefix its module's name starts with (SeamlessM4T's
    t2u_model: t2u_decoder_attention_heads, t2u_hidden_size, ...), as a config of its own."""
    heads = HEADS_KEYS + tuple(f"{side}_attention_heads" for side in ("encoder", "decoder"))
    for prefix in (word + "_", word.split("_")[0] + "_"):  # SAM2-video's memory_attention_num_attention_heads
        if len(prefix) < 3 or (prefix == word.split("_")[0] + "_" and word == prefix[:-1]):
            continue
        sub = {k.removeprefix(prefix): v for k, v in scope.items() if k.startswith(prefix)}
        if any(k in sub for k in heads):
            return {**sub, "model_type": scope.get("model_type")}, prefix
    return None


def under_one_word(stack: str, path: str) -> bool:
    """``stack`` is ``path``, or ``path`` under one more word (a head model's ``model.``)."""
    return stack == path or (stack.endswith("." + path) and "." not in stack[: -len(path) - 1])


HEAD_FACTS = HEADS_KEYS + HEAD_DIM_KEYS + tuple(f"{side}_attention_heads" for side in ("encoder", "decoder"))


def override(scope: dict, spec: str) -> tuple[dict, str] | None:
    """The config a SUBCONFIG_BY_PATH entry names, and how messages name it: "key" (a nested config, dotted),
    "key/prefix" (its keys under a prefix), "/prefix" (this config's keys under a prefix); None if absent."""
    key, slash, prefix = spec.partition("/")
    base = nested(scope, key) if key else scope
    if not isinstance(base, dict):
        return None
    if not slash:
        return base, key
    return {
        k.removeprefix(prefix): v for k, v in base.items() if k.startswith(prefix)
    }, f"{key + '.' if key else ''}{prefix}*"
