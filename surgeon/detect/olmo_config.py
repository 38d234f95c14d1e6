"""Head counts from OLMo-core's own config of a run, in config.json terms (families.OLMO_CORE_*).

OLMo-core writes the run's config beside each checkpoint (``stepN/config.json``): ``model`` is its
TransformerConfig, ``d_model`` the width, ``block.sequence_mixer`` (OLMo-core 2: ``block.attention``) the
attention's ``n_heads``, ``n_kv_heads`` (left out: one per head) and ``head_dim`` (left out: d_model / n_heads).
Blocks that ``block_overrides`` replace, or a ``block_pattern`` of named blocks, get facts per layer. A value
of the wrong type is refused in one line: it is read as data, never trusted to be what it claims.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from .families import OLMO_CORE_ATTENTION_KEYS, OLMO_CORE_HEADS, OLMO_CORE_MODEL_CLASS

MAX_LAYERS = 1 << 16  # a pattern is spelled out per layer: a claim of more layers is not a real model's


def olmo_core_config(config: dict) -> dict | None:
    """config.json keys (and ``per_layer_config``) for an OLMo-core config of a run or of a model, else None."""
    nested = config.get("model")
    model: dict = nested if isinstance(nested, dict) else config
    if model.get("_CLASS_") != OLMO_CORE_MODEL_CLASS:
        return None
    where = "model." if model is not config else ""
    out: dict[str, Any] = {"hidden_size": _count(model.get("d_model"), f"{where}d_model")}
    block, pattern = model.get("block"), model.get("block_pattern")
    per_layer: dict[str, dict] = {}
    if pattern is not None:  # block is {name: block config}; layer i is block[pattern[i % len(pattern)]]
        if not (isinstance(pattern, list) and pattern and isinstance(block, dict)):
            raise _bad(f"{where}block_pattern", pattern, "a list of the names of its blocks")
        layers = _count(model.get("n_layers"), f"{where}n_layers")
        if layers > MAX_LAYERS:
            raise _bad(f"{where}n_layers", layers, f"at most {MAX_LAYERS}")
        for i in range(layers):
            name = pattern[i % len(pattern)]
            if not isinstance(name, str) or not isinstance(block.get(name), dict):
                raise _bad(f"{where}block_pattern", name, f"the name of a block in {where}block")
            per_layer[str(i)] = _heads(block[name], f"{where}block.{name}")
    else:
        out.update(_heads(block, f"{where}block"))
    overrides = model.get("block_overrides")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise _bad(f"{where}block_overrides", overrides, "an object of block configs by layer number")
        for layer, override in overrides.items():
            if not str(layer).isdigit():
                raise _bad(f"{where}block_overrides", layer, "a layer number")
            per_layer[str(int(layer))] = _heads(override, f"{where}block_overrides.{layer}")
    if per_layer:
        out["per_layer_config"] = per_layer
    return out


def _heads(block: Any, where: str) -> dict[str, int]:
    """A block config's heads in config.json terms (nothing for a block without attention: a recurrent mixer)."""
    if not isinstance(block, dict):
        raise _bad(where, block, "a block config")
    key = next((k for k in OLMO_CORE_ATTENTION_KEYS if k in block), None)
    attention = block.get(key) if key else None
    if not isinstance(attention, dict):
        raise _bad(f"{where}.{OLMO_CORE_ATTENTION_KEYS[0]}", attention, "the block's attention config")
    if attention.get("type", "attention") != "attention":
        return {}  # OLMo-core's other sequence mixers (gated delta net) have no heads of attention
    out = {}
    for field, ours in OLMO_CORE_HEADS.items():
        value = attention.get(field)
        if value is not None:
            out[ours] = _count(value, f"{where}.{key}.{field}")
    if "num_attention_heads" not in out:
        raise _bad(f"{where}.{key}.n_heads", None, "a positive integer")
    out.setdefault("num_key_value_heads", out["num_attention_heads"])  # OLMo-core: n_kv_heads None is n_heads
    return out


def _count(value: Any, where: str) -> int:
    if type(value) is not int or value <= 0:
        raise _bad(where, value, "a positive integer")
    return value


def _bad(where: str, value: Any, wanted: str) -> CheckpointError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return CheckpointError(
        f"the OLMo-core config's {where} is {shown}, where OLMo-core writes {wanted}: is it the run's own "
        "config.json? Fix it, or pass --config with the right one (or --num-heads / --num-kv-heads with --force-hints)"
    )
