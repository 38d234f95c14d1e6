"""Find attention blocks from tensor names, shapes and config.json.

Each family's naming is a :class:`Rule` in :data:`RULES`: which tensors (relative to the attention
module) hold the projections and how each packs its (role, head) slots. Matching a rule yields
:class:`~surgeon.spec.AttentionBlock` data; nothing downstream knows about family names.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import LayoutError, NoAttentionFoundError, UnsupportedWeightsError, opt
from ..formats.base import TensorInfo
from ..spec import AttentionBlock, Projection, Rows, packed_size, slot_offsets
from .config import ConfigView, Hints


@dataclass(frozen=True)
class Part:
    """One tensor of a layout: its weight (and bias) name under the attention module."""

    weight: str
    bias: str | None
    packing: str  # a key of spec.PACKINGS, or "auto" (query_key_value: decided by the config)
    orientation: str = "linear"  # "linear" (out, in), "conv1d" (in, out), or "shape" (decide from shapes)
    bias_packing: str | None = None  # when the bias is packed differently (nn.MultiheadAttention)


@dataclass(frozen=True)
class Rule:
    name: str
    parts: tuple[Part, ...]


def _separate(q: str, k: str, v: str) -> Rule:
    return Rule("separate", tuple(Part(f"{m}.weight", f"{m}.bias", r) for m, r in ((q, "q"), (k, "k"), (v, "v"))))


def _fused(module: str, packing: str, orientation: str = "linear") -> Rule:
    return Rule(f"fused {module}", (Part(f"{module}.weight", f"{module}.bias", packing, orientation),))


# Tried in order at every module; rules with more tensors come first so that GPT-2's cross-attention
# (q_attn + c_attn) is not taken for a self-attention c_attn.
RULES: tuple[Rule, ...] = (
    _separate("q_proj", "k_proj", "v_proj"),  # Llama, Mistral, Qwen2, Gemma, Phi, OPT, GPT-J, BART, Whisper, CLIP
    _separate("query", "key", "value"),  # BERT, RoBERTa, ELECTRA, ViT, DeiT, Swin
    _separate("q_lin", "k_lin", "v_lin"),  # DistilBERT
    _separate("query_proj", "key_proj", "value_proj"),  # DeBERTa-v2
    _separate("wq", "wk", "wv"),  # Meta Llama reference code
    _separate("to_q", "to_k", "to_v"),  # diffusers and lucidrains-style modules
    _separate("q", "k", "v"),  # T5
    Rule(
        "fused cross c_attn",  # GPT-2 cross-attention: Conv1D q_attn, Conv1D c_attn holding [K | V]
        (Part("q_attn.weight", "q_attn.bias", "q", "conv1d"), Part("c_attn.weight", "c_attn.bias", "kv", "conv1d")),
    ),
    _fused("c_attn", "qkv", "shape"),  # GPT-2 (Conv1D), nanoGPT and GPTBigCode (Linear)
    _fused("query_key_value", "auto"),  # GPT-NeoX, Bloom (interleaved), Falcon (three layouts)
    _fused("Wqkv", "qkv"),  # MPT, ModernBERT
    _fused("qkv_proj", "qkv"),  # Phi-3
    _fused("qkv", "qkv"),  # timm ViT, nanoGPT-style
    _fused("to_qkv", "qkv"),
    Rule("fused in_proj", (Part("in_proj_weight", "in_proj_bias", "qkv"),)),  # nn.MultiheadAttention
    Rule(  # nn.MultiheadAttention with kdim/vdim != embed_dim: separate weights, one packed bias
        "separate in_proj",
        tuple(Part(f"{r}_proj_weight", "in_proj_bias", r, bias_packing="qkv") for r in "qkv"),
    ),
)

CROSS_WORDS = ("encdecattention", "encoder_attn", "crossattention", "cross_attn", "cross_attention", "crossattn", "src_attn", "multihead_attn")
# Tensors that quantization libraries put beside (or instead of) a projection's float weight.
QUANT_PARAMS = ("qweight", "qzeros", "scales", "g_idx", "SCB", "weight_format", "weight_scale", "weight_packed", "weight_zero_point", "absmax", "quant_map", "quant_state")

_NUMERIC = re.compile(r"^\d+$")


@dataclass
class Detection:
    blocks: list[AttentionBlock]
    tensors_seen: int
    notes: list[str] = field(default_factory=list)  # why candidates were rejected, for "nothing found"

    def stacks(self) -> list[str]:
        seen: list[str] = []
        for b in self.blocks:
            if b.stack not in seen:
                seen.append(b.stack)
        return seen


def detect(tensors: Mapping[str, TensorInfo], config: dict | None = None, hints: Hints | None = None, *, source: str = "the checkpoint") -> Detection:
    """Find every attention block. Raises NoAttentionFoundError if there is none."""
    view = ConfigView(config, hints)
    _refuse_quantized(tensors)
    matches = _match_modules(tensors)
    notes = _partial_matches(tensors, matches)
    placed = _place(matches)
    blocks = [_build(module, rule, stack, layer, stage, tensors, view) for module, rule, stack, layer, stage in placed]
    if not blocks:
        raise NoAttentionFoundError(_nothing_found(tensors, notes, source))
    return Detection(blocks, len(tensors), _assumed_layouts(blocks, view) + notes)


# Fused tensors whose packing is a naming convention rather than something config.json states.
_CONVENTIONAL = {"fused qkv": "timm/nanoGPT", "fused to_qkv": "chunk(3)"}


def _assumed_layouts(blocks: list[AttentionBlock], view: ConfigView) -> list[str]:
    """Say so when a fused layout rests on a naming convention alone (no model_type to confirm it)."""
    if view.model_type:
        return []
    notes = []
    for layout in dict.fromkeys(b.layout for b in blocks):
        if layout in _CONVENTIONAL:
            tensor = layout.split()[1]
            notes.append(
                f"{tensor} tensors are read as blocked [Q | K | V] (the {_CONVENTIONAL[layout]} convention; no config.json "
                "model_type confirms it); if your model interleaves heads, check with the Python API (surgeon.inspect(module))"
            )
    return notes


def _refuse_quantized(tensors: Mapping[str, TensorInfo]) -> None:
    leaves = {p.weight.rsplit(".", 1)[0] for rule in RULES for p in rule.parts if "." in p.weight}
    for name in tensors:
        module, _, param = name.rpartition(".")
        if param in QUANT_PARAMS and module.rpartition(".")[2] in leaves:
            raise UnsupportedWeightsError(
                f"{module} is quantized ({param} {tensors[name].dtype}): surgeon rewrites float weights only; "
                "re-initialize the float checkpoint, then quantize"
            )


def _match_modules(tensors: Mapping[str, TensorInfo]) -> dict[str, Rule]:
    """Attention module path -> the first rule all of whose weights exist under it."""
    candidates: dict[str, None] = {}
    for name in tensors:
        for rule in RULES:
            for part in rule.parts:
                if name == part.weight:
                    candidates.setdefault("", None)
                elif name.endswith("." + part.weight):
                    candidates.setdefault(name[: -len(part.weight) - 1], None)
    found: dict[str, Rule] = {}
    for module in candidates:
        for rule in RULES:
            if all(_join(module, p.weight) in tensors for p in rule.parts):
                found[module] = rule
                break
    # A module that is itself a projection of a matched parent (e.g. "...attn.qkv" inside timm
    # when "...attn" matched) is not a second attention block.
    return found


def _partial_matches(tensors: Mapping[str, TensorInfo], matches: dict[str, Rule]) -> list[str]:
    notes = []
    seen = set()
    for name in tensors:
        for rule in RULES:
            if len(rule.parts) < 2:
                continue
            for part in rule.parts:
                if not name.endswith("." + part.weight):
                    continue
                module = name[: -len(part.weight) - 1]
                if module in matches or (module, rule.name) in seen:
                    continue
                seen.add((module, rule.name))
                have = [p.weight for p in rule.parts if _join(module, p.weight) in tensors]
                missing = [p.weight for p in rule.parts if _join(module, p.weight) not in tensors]
                if len(have) >= 2:
                    notes.append(f"{module}: has {', '.join(have)} but no {', '.join(missing)}")
    return notes


def _join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if module else leaf


def _place(matches: dict[str, Rule]) -> list[tuple[str, Rule, str, int, int | None]]:
    """Give each matched module its stack, its layer index in the stack and (Swin) its stage.

    Modules whose paths differ only in numbers form a group (e.g. ``model.layers.#.self_attn``).
    The numbers that vary inside a group index the layers; the stack is the path before the first
    of them. Layers are numbered by rank over the stack, so self- and cross-attention of one
    decoder share layer numbers.
    """
    groups: dict[str, list[str]] = defaultdict(list)
    for module in matches:
        parts = module.split(".") if module else []
        groups[".".join("#" if _NUMERIC.match(p) else p for p in parts)].append(module)
    placed_raw = []
    for template, modules in groups.items():
        parts = template.split(".") if template else []
        numeric = [i for i, p in enumerate(parts) if p == "#"]
        split = [m.split(".") for m in modules]
        varying = [i for i in numeric if len({s[i] for s in split}) > 1] or numeric[:1]
        for module, comps in zip(modules, split):
            # A module outside any numbered list (SigLIP's pooling head) is a stack of its own.
            stack = ".".join(comps[: varying[0]]) if varying else module
            key = tuple(int(comps[i]) for i in varying)
            stage = key[0] if len(key) > 1 else None
            placed_raw.append((module, stack, len(varying), key, stage))
    ranks: dict[tuple[str, int], list[tuple[int, ...]]] = defaultdict(list)
    for _, stack, depth, key, _ in placed_raw:
        ranks[(stack, depth)].append(key)
    order = {k: sorted(set(v)) for k, v in ranks.items()}
    stack_of = {module: stack for module, stack, *_ in placed_raw}
    stack_order: dict[str, int] = {}
    for module in matches:  # stacks in the order their tensors appear in the checkpoint
        stack_order.setdefault(stack_of[module], len(stack_order))
    placed = [
        (module, matches[module], stack, order[(stack, depth)].index(key), stage)
        for module, stack, depth, key, stage in placed_raw
    ]
    placed.sort(key=lambda p: (stack_order[p[2]], p[3], _kind(p[0]) == "cross", p[0]))
    return placed


def _kind(module: str) -> str:
    leaf_words = [w.lower() for w in module.split(".")[-2:]]
    return "cross" if any(w in CROSS_WORDS for w in leaf_words) else "self"


def _build(module: str, rule: Rule, stack: str, layer: int, stage: int | None, tensors: Mapping[str, TensorInfo], view: ConfigView) -> AttentionBlock:
    facts = view.facts(stack)
    heads = facts.pick(facts.heads, stage)
    where = module or "the top-level attention module"
    if heads is None:
        raise LayoutError(
            f"cannot tell the number of heads of {where}: "
            f"{facts.source + ' does not say' if view.has_config else 'there is no config.json beside the weights'}; "
            f"pass {opt('num_heads', 'N')} (and {opt('num_kv_heads')} for grouped-query attention), or {opt('config', 'PATH')}"
        )
    kv_hint = facts.pick(facts.kv_heads, stage)
    parts = [(p, tensors[_join(module, p.weight)]) for p in rule.parts]
    for part, info in parts:
        if not info.is_float:
            raise UnsupportedWeightsError(
                f"{info.name} is {info.dtype}, not a float matrix: it looks quantized or integer; "
                "surgeon rewrites float16/bfloat16/float32 projections only"
            )
        if len(info.shape) != 2:
            raise LayoutError(f"{info.name} has shape {list(info.shape)}; a projection weight must be 2-D")
        if 0 in info.shape:
            raise LayoutError(
                f"{info.name} has shape {list(info.shape)}: an empty projection has no heads to re-initialize; "
                "the checkpoint is damaged or not a model surgeon can rewrite"
            )
    packings = [_packing(p, view, stack, where) for p, _ in parts]
    layout = _solve(parts, packings, heads, kv_hint, facts.head_dim, facts.hidden, where, facts.source)
    head_dim, kv_heads, orientations = layout
    projections = {}
    for (part, info), packing, axis in zip(parts, packings, orientations):
        offsets = slot_offsets(packing, heads, kv_heads, head_dim)
        in_features = info.shape[1 - axis]
        bias_name = _join(module, part.bias) if part.bias else None
        bias_offsets = slot_offsets(part.bias_packing or packing, heads, kv_heads, head_dim)
        for role, offs in offsets.items():
            bias = None
            if bias_name in tensors and tensors[bias_name].shape == (packed_size(part.bias_packing or packing, heads, kv_heads, head_dim),):
                bias = Rows(bias_name, 0, bias_offsets[role], head_dim)
            projections[role] = Projection(role, Rows(info.name, axis, offs, head_dim), bias, in_features)  # type: ignore[arg-type]
    return AttentionBlock(
        stack=stack,
        layer=layer,
        kind=_kind(module),  # type: ignore[arg-type]
        module=module,
        layout=rule.name,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        q=projections["q"],
        k=projections["k"],
        v=projections["v"],
    )


def _packing(part: Part, view: ConfigView, stack: str, where: str) -> str:
    if part.packing in ("q", "k", "v"):
        return part.packing
    packing = view.fused_packing(part.weight.rsplit(".", 1)[0], stack) or (None if part.packing == "auto" else part.packing)
    if packing is None:
        raise LayoutError(
            f"cannot tell how {_join(where, part.weight)} packs query/key/value: it is interleaved per head in "
            "GPT-NeoX/Bloom and grouped in Falcon, and "
            + ("config.json (model_type) does not say" if view.has_config else "there is no config.json beside the weights")
            + f"; pass {opt('config', 'PATH')}"
        )
    return packing


def _solve(parts, packings, heads: int, kv_hint, head_dim_hint, hidden, where: str, source: str):
    """Find (head_dim, kv_heads, output axis per part) that fit every tensor's shape."""
    tried = []
    for orientations in _orientation_choices(parts):
        outs = [info.shape[axis] for (_, info), axis in zip(parts, orientations)]
        ins = [info.shape[1 - axis] for (_, info), axis in zip(parts, orientations)]
        for head_dim in _head_dim_candidates(parts, packings, outs, ins, heads, head_dim_hint, hidden):
            for kv_heads in _kv_candidates(packings, outs, heads, head_dim, kv_hint):
                if heads % kv_heads:
                    continue
                try:
                    sizes = [packed_size(p, heads, kv_heads, head_dim) for p in packings]
                except ValueError:
                    continue
                if sizes == outs:
                    return head_dim, kv_heads, orientations
                tried.append(f"{heads} heads x {head_dim} (kv {kv_heads}) needs {sizes} output features")
    shapes = ", ".join(f"{info.name.rsplit('.', 2)[-2] if '.' in info.name else info.name} {list(info.shape)}" for _, info in parts)
    raise LayoutError(
        f"the shapes of {where} ({shapes}) do not fit {heads} heads from {source}"
        f"{' (' + tried[0] + ')' if tried else ''}; check the config or pass {opt('num_heads')}/{opt('num_kv_heads')}/{opt('head_dim')}"
    )


def _orientation_choices(parts):
    choices = [[]]
    for part, info in parts:
        axes = {"linear": [0], "conv1d": [1], "shape": [0, 1]}[part.orientation]
        choices = [c + [a] for c in choices for a in axes]
    return [tuple(c) for c in choices]


def _head_dim_candidates(parts, packings, outs, ins, heads, hint, hidden):
    if hint:
        return [hint]
    cands = []
    for packing, out in zip(packings, outs):
        if packing == "q" and out % heads == 0:
            cands.append(out // heads)
    width = hidden or ins[0]
    if width % heads == 0:
        cands.append(width // heads)
    return list(dict.fromkeys(cands))


def _kv_candidates(packings, outs, heads, head_dim, hint):
    if hint:
        return [hint]
    cands = []
    for packing, out in zip(packings, outs):
        if out % head_dim:
            continue
        slots = out // head_dim
        if packing in ("k", "v"):
            cands.append(slots)
        elif packing in ("qkv", "grouped") and (slots - heads) % 2 == 0 and slots > heads:
            cands.append((slots - heads) // 2)
        elif packing == "kv" and slots % 2 == 0:
            cands.append(slots // 2)
    cands.append(heads)
    return [c for c in dict.fromkeys(cands) if c > 0]


def _nothing_found(tensors: Mapping[str, TensorInfo], notes: list[str], source: str) -> str:
    names = list(tensors)
    sample = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    known = "q_proj/k_proj/v_proj, query/key/value, q_lin, q/k/v, wq, to_q; fused c_attn, query_key_value, Wqkv, qkv, qkv_proj, in_proj_weight"
    why = f"; closest: {notes[0]}" if notes else ""
    return (
        f"no attention found in {source}: looked at {len(names)} tensors ({sample}) and none sits under a module "
        f"with projections named {known}{why}"
    )
