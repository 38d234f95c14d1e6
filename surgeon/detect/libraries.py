"""What libraries beyond transformers fix about a layout, read from their data rows in :mod:`.families`.

* :func:`normalize_config`: head counts from the library's own config file, in config.json terms,
  per stack (diffusers UNets, open_clip model JSON, timm config.json, OLMo-core's config of a run).
* :func:`fused_packing`: a timm fused ``qkv`` whose packing depends on the model (MaxViT).
* :func:`kv_map`: how a library maps query heads to key/value heads (x-transformers).
* :func:`separate_biases` and :func:`companion_block`: every Q/K/V of a block (timm EVA's ``q_bias`` /
  ``v_bias``, the context stream of diffusers' joint attention).

Nothing here imports torch, numpy or onnx.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, LayoutError, opt
from ..vocab.blocks import ROLES, AttentionBlock, Projection, Rows, slot_offsets, split_module
from .families import (
    COMPANION_STREAMS,
    CROSS_BY_POSITION,
    CROSS_BY_WIDTH,
    DIFFUSERS_HEADS_AS_HEAD_DIM,
    FUSED_PACKING_BY_ARCHITECTURE,
    KV_MAP_BY_PATH,
    MAXXVIT_WORDS,
    OLMO_CORE_ATTENTION_KEYS,
    OLMO_CORE_HEADS,
    OLMO_CORE_MODEL_CLASS,
    SELF_BESIDE,
    SEPARATE_BIASES,
    TIMM_HEAD_DIM,
    TIMM_HEADS,
)

STACKS = "surgeon:stacks"  # key of a normalized config: first path component of a stack -> its facts


def normalize_config(config: dict | None) -> dict | None:
    """``config`` with a library's own spelling of heads added in config.json terms (a copy), or as is."""
    if not config:
        return config
    for reader in (_diffusers_unet, _open_clip, _timm, _olmo_core):
        extra = reader(config)
        if extra:
            return {**config, **extra}
    return config


def _diffusers_unet(config: dict) -> dict | None:
    # unet_2d_condition.py: "num_attention_heads = num_attention_heads or attention_head_dim", so these configs'
    # attention_head_dim is the head count: per down block, reversed for the up blocks, the last for the mid block.
    if config.get("_class_name") not in DIFFUSERS_HEADS_AS_HEAD_DIM or "down_block_types" not in config:
        return None
    types = config["down_block_types"]
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise CheckpointError(
            f"the config's down_block_types is {_shown(types)}: a diffusers {config['_class_name']} config lists "
            "the class names of its down blocks there; is it the model's own config?"
        )
    heads = config.get("num_attention_heads") or config.get("attention_head_dim")
    blocks = len(types)
    per = [heads] * blocks if isinstance(heads, int) else heads if isinstance(heads, list) else []
    if len(per) != blocks or not all(isinstance(h, int) and h > 0 for h in per):
        return None
    return {
        "attention_head_dim": None,  # not a head size in these configs
        STACKS: {
            "down_blocks": {"num_attention_heads": per},
            "up_blocks": {"num_attention_heads": per[::-1]},
            "mid_block": {"num_attention_heads": per[-1]},
        },
    }


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _open_clip(config: dict) -> dict | None:
    # open_clip model_configs/*.json: vision_cfg (width, head_width = 64) and text_cfg (width, heads = 8);
    # the text tower sits at the top level of the state dict (transformer.resblocks), the vision tower
    # under visual.
    if isinstance(
        config.get("model_cfg"), dict
    ):  # open_clip_config.json of a Hub repo: {"model_cfg": ..., "preprocess_cfg": ...}
        config = config["model_cfg"]
    vision, text = config.get("vision_cfg"), config.get("text_cfg")
    if not isinstance(vision, dict) or not isinstance(text, dict):
        return None
    facts: dict[str, dict] = {}
    width, head_width = vision.get("width", 768), vision.get("head_width", 64)
    timm_tower = vision.get("timm_model_name")  # a timm trunk (visual.trunk): its own heads, not width // head_width
    if (
        not timm_tower
        and isinstance(width, int)
        and isinstance(head_width, int)
        and head_width > 0
        and width % head_width == 0
    ):
        facts["visual"] = {"num_attention_heads": width // head_width, "hidden_size": width}
    text_facts = {"num_attention_heads": text.get("heads", 8), "hidden_size": text.get("width", 512)}
    facts["transformer"] = facts["text"] = text_facts
    return {STACKS: facts}


def _timm(config: dict) -> dict | None:
    # timm's config.json (push_to_hf_hub): "architecture" and, when the model was built with other
    # arguments, "model_args"; the heads are otherwise the architecture's defaults.
    arch = config.get("architecture")
    if not isinstance(arch, str) or "model_type" in config:
        return None
    args = config.get("model_args")
    args = args if isinstance(args, dict) else {}
    heads = args.get("num_heads") or _by_prefix(TIMM_HEADS, arch)
    # maxxvit.py takes transformer_* keywords into MaxxVitTransformerCfg (_overlay_kwargs)
    head_dim = args.get("transformer_dim_head") or args.get("dim_head") or _by_prefix(TIMM_HEAD_DIM, arch)
    out: dict[str, Any] = {}
    if heads:
        out["num_heads"] = list(heads) if isinstance(heads, (list, tuple)) else heads
    if head_dim:
        out["head_dim"] = head_dim
    return out or None


def _by_prefix(table: Mapping[str, Any], arch: str) -> Any:
    best = max((p for p in table if arch == p or arch.startswith(p + "_")), key=len, default=None)
    return table[best] if best else None


def stack_scope(config: dict, stack: str) -> dict | None:
    """The facts a library config gives for ``stack`` (by its first path component), if any."""
    scopes = config.get(STACKS)
    if not isinstance(scopes, dict):
        return None
    first = stack.split(".")[0]
    return scopes.get(first)


def fused_packing(tensor: str, module: str, config: dict) -> str | None:
    """A timm fused tensor's packing where the model decides it; refuses MaxViT without its architecture."""
    arch = config.get("architecture")
    if isinstance(arch, str):
        for name, pattern, packing in FUSED_PACKING_BY_ARCHITECTURE:
            if name == tensor and re.match(pattern, arch):
                return packing
    if tensor == "qkv" and any(w in module.split(".") for w in MAXXVIT_WORDS):
        raise LayoutError(
            f"cannot tell how {module}.qkv packs query/key/value: timm MaxViT packs it per head ([q_h | k_h | v_h]) "
            "and its TensorFlow ports (maxvit_*_tf) as [Q | K | V]; "
            f"pass {opt('config', 'PATH')} with the timm config.json that names its architecture"
        )
    return None


def kv_map(module: str) -> str:
    """How query heads map to key/value heads in the library that wrote ``module`` (spec.KV_MAPS)."""
    for fragment, mapping in KV_MAP_BY_PATH.items():
        if f".{fragment}." in f".{module}.":
            return mapping
    return "blocked"


def with_separate_biases(block: AttentionBlock, shapes: Mapping[str, tuple[int, ...]]) -> AttentionBlock:
    """``block`` with the biases of a fused weight that keeps them as parameters of their own (timm
    EVA's q_bias / v_bias beside qkv.weight), where its projections have none."""
    roles: dict[str, Any] = {}
    for p in block.projections:
        owner, _, leaf = p.weight.tensor.removesuffix(".weight").rpartition(".")
        name = SEPARATE_BIASES.get(leaf, {}).get(p.role)
        bias = f"{owner}.{name}" if owner and name else name
        if p.bias is None and bias is not None and shapes.get(bias) == (p.heads * p.head_dim,):
            offsets = slot_offsets(p.role, block.heads, block.kv_heads, block.head_dim)[p.role]
            roles[p.role] = dataclasses.replace(p, bias=Rows(bias, 0, offsets, block.head_dim))
    return dataclasses.replace(block, **roles) if roles else block


def companion_block(block: AttentionBlock, shapes: Mapping[str, tuple[int, ...]]) -> AttentionBlock | None:
    """The second stream of ``block`` (joint attention's context projections), with the same heads."""
    for q, k, v, suffix in COMPANION_STREAMS:
        names = {r: f"{block.module}.{leaf}" if block.module else leaf for r, leaf in zip(ROLES, (q, k, v))}
        if not all(f"{n}.weight" in shapes for n in names.values()):
            continue
        projections = {}
        for role, name in names.items():
            count = block.heads if role == "q" else block.kv_heads
            shape = shapes[f"{name}.weight"]
            if len(shape) != 2 or shape[0] != count * block.head_dim:
                raise LayoutError(
                    f"{name}.weight has shape {list(shape)}, but {block.module} has {count} {role} heads of {block.head_dim}: "
                    f"the context stream must match them; check {opt('num_heads')}/{opt('head_dim')}"
                )
            offsets = slot_offsets(role, block.heads, block.kv_heads, block.head_dim)[role]
            bias = f"{name}.bias" if shapes.get(f"{name}.bias") == (shape[0],) else None
            projections[role] = Projection(
                role,
                Rows(f"{name}.weight", 0, offsets, block.head_dim),
                Rows(bias, 0, offsets, block.head_dim) if bias else None,
                shape[1],
            )
        return dataclasses.replace(
            block,
            module=block.module + suffix,
            layout="joint context",
            q=projections["q"],
            k=projections["k"],
            v=projections["v"],
        )
    return None


def roles_by_position(blocks: list[AttentionBlock], names: Mapping[str, Any]) -> list[AttentionBlock]:
    """Each block's kind where its place among the other names settles it: cross-attention in the stacks
    of CROSS_BY_POSITION, told by the entry's place among its stack's entries, or by keys that read another
    width than the queries (x-transformers' dim_context); self-attention where a role that is usually
    cross sits beside joint attention (SELF_BESIDE: SD3.5's dual attention)."""
    out = []
    for block in blocks:
        wider = block.k.in_features != block.q.in_features
        family = any(block.stack.endswith(stack) for stack in CROSS_BY_POSITION)
        cross = (family and (wider or _second_of_run(block, names))) or (block.layout in CROSS_BY_WIDTH and wider)
        if cross and block.kind == "self":
            block = dataclasses.replace(block, kind="cross")
        elif block.kind == "cross" and not wider and _beside_joint(block.module, names):
            block = dataclasses.replace(block, kind="self")
        out.append(block)
    return out


def _beside_joint(module: str, names: Mapping[str, Any]) -> bool:
    parent, _, leaf = module.rpartition(".")
    return any(leaf == role and f"{parent}.{sibling}" in names for role, sibling in SELF_BESIDE)


def _second_of_run(block: AttentionBlock, names: Mapping[str, Any]) -> bool:
    for stack, ff in CROSS_BY_POSITION.items():
        if not block.stack.endswith(stack) or not block.module.startswith(block.stack + "."):
            continue
        entry = block.module[len(block.stack) + 1 :].split(".")[0]
        if not (entry.isascii() and entry.isdigit()):  # "²".isdigit() too, and int() refuses it
            return False
        index = int(entry)
        # the entry before it is an attention entry (not a feedforward, and it exists)
        before = f"{block.stack}.{index - 1}"
        return (
            index > 0
            and not any(n.startswith(before + ff) for n in names)
            and any(n.startswith(before + ".") for n in names)
            and (index < 2 or any(n.startswith(f"{block.stack}.{index - 2}{ff}") for n in names))
        )
    return False


def library_notes(blocks: list[AttentionBlock]) -> list[str]:
    """What the report should say about a library's layout that changes what a selection means."""
    notes = []
    shared = [b for b in blocks if b.kv_map == "interleaved" and b.kv_heads < b.heads]
    if shared:
        b = shared[0]
        group = ",".join(str(h) for h in range(b.heads) if b.kv_head(h) == 0)
        notes.append(
            f"{b.stack}: query head h reads key/value head h % {b.kv_heads} (key/value head 0 serves query heads {group}); "
            "select whole groups to re-initialize keys and values"
        )
    second = next((b for b in blocks if split_module(b.module)[1]), None)
    if second is not None:
        notes.append(
            f"joint attention: the {split_module(second.module)[1]} stream's projections (add_q/k/v_proj) are re-initialized "
            f"with their block, the same heads (reported as {second.label})"
        )
    return notes


# --------------------------------------------------------------------------- OLMo-core
OLMO_MAX_LAYERS = 1 << 16  # a pattern is spelled out per layer: a claim of more layers is not a real model's


def _olmo_core(config: dict) -> dict | None:
    """config.json keys (and ``per_layer_config``) from OLMo-core's own config of a run (stepN/config.json:
    ``model`` is its TransformerConfig) or of a model, else None: ``d_model``, ``block.sequence_mixer`` (OLMo-core
    2: ``block.attention``) ``n_heads``, ``n_kv_heads`` (left out: one per head), ``head_dim``; per layer where
    ``block_overrides`` or a ``block_pattern`` of named blocks says so. Values of the wrong type: one line."""
    nested = config.get("model")
    model: dict = nested if isinstance(nested, dict) else config
    if model.get("_CLASS_") != OLMO_CORE_MODEL_CLASS:
        return None
    where = "model." if model is not config else ""
    out: dict[str, Any] = {"hidden_size": _olmo_count(model.get("d_model"), f"{where}d_model")}
    block, pattern = model.get("block"), model.get("block_pattern")
    per_layer: dict[str, dict] = {}
    if pattern is not None:  # block is {name: block config}; layer i is block[pattern[i % len(pattern)]]
        if not (isinstance(pattern, list) and pattern and isinstance(block, dict)):
            raise _olmo_bad(f"{where}block_pattern", pattern, "a list of the names of its blocks")
        layers = _olmo_count(model.get("n_layers"), f"{where}n_layers")
        if layers > OLMO_MAX_LAYERS:
            raise _olmo_bad(f"{where}n_layers", layers, f"at most {OLMO_MAX_LAYERS}")
        for i in range(layers):
            name = pattern[i % len(pattern)]
            if not isinstance(name, str) or not isinstance(block.get(name), dict):
                raise _olmo_bad(f"{where}block_pattern", name, f"the name of a block in {where}block")
            per_layer[str(i)] = _olmo_heads(block[name], f"{where}block.{name}")
    else:
        out.update(_olmo_heads(block, f"{where}block"))
    overrides = model.get("block_overrides")
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise _olmo_bad(f"{where}block_overrides", overrides, "an object of block configs by layer number")
        for layer, override in overrides.items():
            if not (str(layer).isascii() and str(layer).isdigit()):  # "²".isdigit(), and int() refuses it
                raise _olmo_bad(f"{where}block_overrides", layer, "a layer number")
            per_layer[str(int(layer))] = _olmo_heads(override, f"{where}block_overrides.{layer}")
    if per_layer:
        out["per_layer_config"] = per_layer
    return out


def _olmo_heads(block: Any, where: str) -> dict[str, int]:
    """A block config's heads in config.json terms (nothing for a block without attention: a recurrent mixer)."""
    if not isinstance(block, dict):
        raise _olmo_bad(where, block, "a block config")
    key = next((k for k in OLMO_CORE_ATTENTION_KEYS if k in block), None)
    attention = block.get(key) if key else None
    if not isinstance(attention, dict):
        raise _olmo_bad(f"{where}.{OLMO_CORE_ATTENTION_KEYS[0]}", attention, "the block's attention config")
    if attention.get("type", "attention") != "attention":
        return {}  # OLMo-core's other sequence mixers (gated delta net) have no heads of attention
    out = {}
    for field, ours in OLMO_CORE_HEADS.items():
        value = attention.get(field)
        if value is not None:
            out[ours] = _olmo_count(value, f"{where}.{key}.{field}")
    if "num_attention_heads" not in out:
        raise _olmo_bad(f"{where}.{key}.n_heads", None, "a positive integer")
    out.setdefault("num_key_value_heads", out["num_attention_heads"])  # OLMo-core: n_kv_heads None is n_heads
    return out


def _olmo_count(value: Any, where: str) -> int:
    if type(value) is not int or value <= 0:
        raise _olmo_bad(where, value, "a positive integer")
    return value


def _olmo_bad(where: str, value: Any, wanted: str) -> CheckpointError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return CheckpointError(
        f"the OLMo-core config's {where} is {shown}, where OLMo-core writes {wanted}: is it the run's own "
        f"config.json? Fix it, or pass {opt('config')} with the right one (or {opt('num_heads')} / "
        f"{opt('num_kv_heads')} with {opt('force_hints', True)})"
    )
