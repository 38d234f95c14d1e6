"""Find attention blocks from tensor names, shapes and config.json.

Each family's naming is a :class:`Rule` in :data:`RULES`: which tensors (relative to the attention
module) hold the projections and how each packs its (role, head) slots. Matching a rule yields
:class:`~surgeon.vocab.blocks.AttentionBlock` data; nothing downstream knows about family names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TypeVar

from ..errors import LayoutError, NoAttentionFoundError, UnsupportedWeightsError, opt
from ..formats.base import TensorInfo
from ..vocab.blocks import (
    AttentionBlock,
    Projection,
    Role,
    Rows,
    Unreadable,
    is_role,
    owner,
    packed_size,
    slot_offsets,
    split_module,
)
from ..vocab.detection import Detection
from .config import ConfigView, StackFacts, with_transformers_defaults
from .families import MODULE_FACTS, RULES, SECOND_SETS, SHARED_BLOCKS, Part, Rule
from .hints import Hints
from .latent import LATENT_RULE, latent_block, latent_modules
from .layout_file import Layout
from .libraries import companion_block, kv_map, library_notes, roles_by_position, with_separate_biases
from .notes import block_notes, linear_notes, projectionless, unknown_attention
from .placement import join, kind, place, stack_depths
from .refusals import (
    check_part,
    refuse_marker_names,
    refuse_mixed_widths,
    refuse_quantized,
    refuse_rules_on_one_module,
    refuse_shared_rows,
    refused_layouts,
)
from .renames import stack_aliases
from .shapes import heads_from_head_dim, solve
from .shapes import packing as part_packing

T = TypeVar("T")


def detect(
    tensors: Mapping[str, TensorInfo],
    config: dict | None = None,
    hints: Hints | None = None,
    *,
    source: str = "the checkpoint",
    defaults: bool = False,
    aliases: Mapping[str, tuple[str, ...]] | None = None,
) -> Detection:
    """Find every attention block. Raises NoAttentionFoundError if there is none. Where config.json leaves
    out what a block needs, the stacks are looked up under the names transformers loads them as (``aliases``,
    surgeon.detect.renames), then its model type's defaults in transformers are tried (``defaults``: this is
    that try)."""
    hints = (hints or Hints()).with_layout_counts(config)  # a layout file's heads: hints where none is given
    view = ConfigView(config, hints, aliases)
    refuse_quantized(tensors)
    matches = match_modules(tensors, hints.layout_rules + RULES)
    refuse_rules_on_one_module(matches, hints.layout_rules, tensors)
    notes = _partial_matches(tensors, matches)
    latents = latent_modules(tensors)
    matches |= {m: LATENT_RULE for m in latents if m not in matches}
    placed = place_matches(matches)
    view.hints.check_stacks(list(dict.fromkeys(stack for _, _, stack, _, _ in placed)))
    blocks: list[AttentionBlock] = []
    unreadable: list[Unreadable] = []
    errors: list[LayoutError] = []
    linear: dict[str, list[int]] = {}
    for module, rule, stack, layer, stage in placed:
        if view.linear_layer(stack, layer):  # linear attention (gated delta-net, ...): not softmax attention
            linear.setdefault(stack, []).append(layer)
            continue
        fixed = next(
            (
                MODULE_FACTS[(view.model_type or "", w)]
                for w in module.split(".")
                if (view.model_type or "", w) in MODULE_FACTS
            ),
            None,
        )
        facts = view.facts(
            stack, cross=kind(module) == "cross" or fixed is not None, layer=layer
        )  # a contradicted hint: refused here
        if fixed is not None:
            facts = replace(facts, heads=fixed[0], kv_heads=fixed[0], head_dim=None, source=f"{view.model_type}'s code")
        try:
            if fixed is None and view.hints.get("num_heads", stack) is None and (doubt := view.doubt(stack, module)):
                raise LayoutError(doubt)
            if rule is LATENT_RULE:
                blocks.append(latent_block(module, latents[module], stack, layer, tensors, view, facts))
                continue
            block = _build(module, rule, stack, layer, stage, tensors, view, facts)
            blocks.append(replace(block, kind=fixed[1]) if fixed is not None else block)
        except LayoutError as e:  # this block cannot be read; the others still can
            unreadable.append(Unreadable(stack, layer, module, e.message))
            errors.append(e)
    blocks = with_companions(roles_by_position(blocks, tensors), tensors)
    refused = [u for u in refused_layouts(tensors) if u.module not in matches]
    owners = [owner(p[0]) for p in placed]
    if errors and aliases is None and (renamed := stack_aliases(config, tensors, [p[2] for p in placed])):
        named = detect(tensors, config, hints, source=source, defaults=defaults, aliases=renamed)
        if len(named.unreadable) < len(errors) + len(refused) + len(unknown_attention(tensors, owners)[0]):
            return named
    if errors and not defaults and (filled := with_transformers_defaults(config)) is not None:
        try:
            again = detect(tensors, filled, hints, source=source, defaults=True, aliases=aliases)
        except LayoutError:
            again = None
        if again is not None and len(again.unreadable) < len(errors) + len(refused_layouts(tensors)) + len(
            unknown_attention(tensors, owners)[0]
        ):
            filled_in = (
                f"config.json leaves out facts of {view.model_type} blocks (save_pretrained writes only what differs "
                f"from the defaults): read from transformers' defaults for {view.model_type}"
            )
            return replace(again, notes=(filled_in, *again.notes))
    unknown, left_alone = unknown_attention(tensors, owners)
    unreadable += refused + unknown
    if not blocks:
        if errors:
            raise errors[0]
        if refused:
            more = sum(1 for u in refused if u.why.endswith(refused[0].why.partition(" uses ")[2])) - 1
            where = refused[0].module + (f" and {more} more use " if more else " uses ")
            raise UnsupportedWeightsError(where + refused[0].why.partition(" uses ")[2])
        raise NoAttentionFoundError(_nothing_found(tensors, notes + [u.why for u in unknown], source))
    refuse_mixed_widths(blocks, view)
    refuse_shared_rows(blocks)
    blocks = shared_blocks(blocks, view)
    depths = stack_depths([b.stack for b in blocks], tensors)
    notes = block_notes(blocks, view) + library_notes(blocks) + notes
    return Detection(
        tuple(blocks),
        tuple(notes),
        depths=depths,
        unreadable=tuple(unreadable),
        left_alone=(*linear_notes(linear), *left_alone, *projectionless(tensors)),
        layout=hints.layout.recorded() if isinstance(hints.layout, Layout) else None,
    )


def shared_blocks(blocks: list[AttentionBlock], view: ConfigView) -> list[AttentionBlock]:
    """Mark the blocks that several layers run (Zamba's shared transformer) with all those layers."""
    rule = SHARED_BLOCKS.get(view.model_type or "")
    types = view.config.get(rule.types_key) if rule else None
    if rule is None or not isinstance(types, list):
        return blocks
    runs = [i for i, t in enumerate(types) if t == rule.type_name]
    count = view.config.get(rule.count_key) if rule.count_key else 1
    count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
    out = []
    for block in blocks:
        if rule.word not in block.module.split(".") or block.layer not in runs:
            out.append(block)
            continue
        first = runs.index(block.layer) % count
        users = tuple(runs[first::count])
        stored = [
            b.module for b in blocks if b.stack == block.stack and b.layer in users and rule.word in b.module.split(".")
        ]
        if len(stored) > 1:
            raise LayoutError(
                f"layers {','.join(map(str, users))} of {block.stack} run one shared block, and the checkpoint stores it "
                f"{len(stored)} times ({', '.join(stored)}): surgeon cannot tell which copy the model loads; save the model "
                "with save_pretrained, which stores it once"
            )
        out.append(replace(block, shared_layers=users) if len(users) > 1 else block)
    return out


def match_modules(tensors: Mapping[str, TensorInfo], rules: tuple[Rule, ...] = RULES) -> dict[str, Rule]:
    """Attention module path -> the first rule of ``rules`` all of whose weights exist under it."""
    candidates: dict[str, None] = {}
    for name in tensors:
        for rule in rules:
            for part in rule.parts:
                if name == part.weight:
                    candidates.setdefault("", None)
                elif name.endswith("." + part.weight):
                    candidates.setdefault(name[: -len(part.weight) - 1], None)
    found: dict[str, Rule] = {}
    for module in candidates:
        for rule in rules:
            if all(join(module, p.weight) in tensors for p in rule.parts) and all(
                join(module, r) in tensors for r in rule.requires
            ):
                refuse_marker_names(module)
                found[module] = rule
                break
    # A module that is itself a projection of a matched parent (e.g. "...attn.qkv" inside timm
    # when "...attn" matched) is not a second attention block.
    for module in list(found):
        for tag, rule in SECOND_SETS:
            if all(join(module, p.weight) in tensors for p in rule.parts):
                found[f"{module}[{tag}]"] = rule
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
                have = [p.weight for p in rule.parts if join(module, p.weight) in tensors]
                missing = [p.weight for p in rule.parts if join(module, p.weight) not in tensors]
                if len(have) >= 2:
                    notes.append(f"{module}: has {', '.join(have)} but no {', '.join(missing)}")
    return notes


def place_matches(matches: Mapping[str, T]) -> list[tuple[str, T, str, int, int | None]]:
    """(module, rule, stack, layer, stage) of each match (see surgeon.detect.placement), stacks in the
    order their tensors appear in the checkpoint, self- before cross-attention of a layer."""
    places = place(matches)
    stack_order: dict[str, int] = {}
    for module in matches:
        stack_order.setdefault(places[module].stack, len(stack_order))
    placed = [(m, matches[m], places[m].stack, places[m].layer, places[m].stage) for m in matches]
    placed.sort(key=lambda p: (stack_order[p[2]], p[3], kind(p[0]) == "cross", p[0]))
    return placed


def _build(
    module: str,
    rule: Rule,
    stack: str,
    layer: int,
    stage: int | None,
    tensors: Mapping[str, TensorInfo],
    view: ConfigView,
    facts: StackFacts,
) -> AttentionBlock:
    where = module or "the top-level attention module"
    heads = _heads(module, rule, stack, stage, tensors, view, facts, where)
    kv_hint = facts.pick(facts.kv_heads, stage)
    parts = [(p, tensors[join(owner(module), p.weight)]) for p in rule.parts]
    for _, info in parts:
        check_part(info, view, stack, module)
    # a layout file's packing is taken as it says; the built-in rules' may depend on the family
    user = rule in view.hints.layout_rules
    packings = [p.packing if user else part_packing(p, view, stack, module, where) for p, _ in parts]
    v_dim = facts.v_head_dim if "v" in packings else None
    layout = solve(
        parts, packings, heads, kv_hint, facts.head_dim, facts.hidden, where, facts.source, v_dim, facts.hinted
    )
    head_dim, kv_heads, orientations = layout
    projections = {}
    for (part, info), packing, axis in zip(parts, packings, orientations):
        size = v_dim if packing == "v" and v_dim else head_dim
        projections.update(_part_projections(module, part, info, packing, axis, heads, kv_heads, size, tensors))
    block = AttentionBlock(
        stack=stack,
        layer=layer,
        kind="self"
        if module.endswith("attn2") and view.config.get("double_self_attention") is True
        else kind(module),  # diffusers
        module=module,
        layout=rule.name
        + (", gated q" if "gated" in packings else "")
        + (f" [{split_module(module)[2]}]" if split_module(module)[2] else ""),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        q=projections["q"],
        k=projections["k"],
        v=projections["v"],
        kv_map=kv_map(module),
    )
    return with_separate_biases(block, {name: info.shape for name, info in tensors.items()})  # timm EVA


def _heads(
    module: str,
    rule: Rule,
    stack: str,
    stage: int | None,
    tensors: Mapping[str, TensorInfo],
    view: ConfigView,
    facts: StackFacts,
    where: str,
) -> int:
    """The block's number of (query) heads: from the config or hints, else from the head size; or refuse."""
    heads = facts.pick(facts.heads, stage)
    if heads is None and facts.head_dim:  # the head size alone settles the heads (timm MaxViT, --head-dim)
        heads = heads_from_head_dim(module, rule, tensors, view, stack, facts.head_dim)
    if heads is None:
        raise LayoutError(
            f"cannot tell the number of heads of {where}: "
            f"{facts.source + ' does not say' if view.has_config else 'there is no config.json beside the weights'}; "
            f"pass {opt('num_heads', 'N')} (or one per stack, {opt('num_heads', f'{stack or where}=N')}; and {opt('num_kv_heads')} for grouped-query attention), or {opt('config', 'PATH')}"
        )
    return heads


def _part_projections(
    module: str,
    part: Part,
    info: TensorInfo,
    packing: str,
    axis: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tensors: Mapping[str, TensorInfo],
) -> dict[Role, Projection]:
    """The q/k/v projections one weight tensor holds (a gate's rows are not attention: left out)."""
    projections = {}
    offsets = slot_offsets(packing, heads, kv_heads, head_dim)
    in_features = info.shape[1 - axis]
    bias_name = join(owner(module), part.bias) if part.bias else None
    bias_offsets = slot_offsets(part.bias_packing or packing, heads, kv_heads, head_dim)
    for role, offs in offsets.items():
        if not is_role(role):
            continue  # a gate: not attention, left as it is
        bias = None
        if (
            bias_name is not None
            and bias_name in tensors
            and tensors[bias_name].shape == (packed_size(part.bias_packing or packing, heads, kv_heads, head_dim),)
        ):
            bias = Rows(bias_name, 0, bias_offsets[role], head_dim)
        projections[role] = Projection(role, Rows(info.name, axis, offs, head_dim), bias, in_features)
    return projections


def with_companions(
    blocks: list[AttentionBlock], tensors: Mapping[str, TensorInfo] | Mapping[str, tuple[int, ...]]
) -> list[AttentionBlock]:
    """Each block followed by its second stream, where it has one (joint attention's context)."""
    shapes = {name: info if isinstance(info, tuple) else info.shape for name, info in tensors.items()}
    out = []
    for block in blocks:
        out.append(block)
        companion = companion_block(block, shapes)
        if companion is not None:
            out.append(companion)
    return out


def _nothing_found(tensors: Mapping[str, TensorInfo], notes: list[str], source: str) -> str:
    names = list(tensors)
    sample = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    why = f"; closest: {notes[0]}" if notes else ""
    return (  # short: the names surgeon knows are a command away, not in the message
        f"no attention found in {_short(source)}: none of its {len(names)} tensors ({sample}) is named like a q/k/v "
        f"projection (`{LIST_NAMES}` lists them){why}; name yours with {opt('layout', 'FILE')}"
    )


def _short(source: str, limit: int = 48) -> str:
    """A long path as its last two parts (a temporary folder's name says nothing and fills the line)."""
    if len(source) <= limit or "/" not in source:
        return source
    return ".../" + "/".join(source.rstrip("/").split("/")[-2:])


LIST_NAMES = "surgeon inspect --list-names"  # the command that prints projection_names()
