"""Find attention blocks from tensor names, shapes and config.json.

Each family's naming is a :class:`Rule` in :data:`RULES`: which tensors (relative to the attention
module) hold the projections and how each packs its (role, head) slots. Matching a rule yields
:class:`~surgeon.detect.blocks.AttentionBlock` data; nothing downstream knows about family names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TypeVar

from ..errors import CheckpointError, LayoutError, NoAttentionFoundError, UnsupportedWeightsError, opt
from ..open.formats.base import TensorInfo
from .blocks import AttentionBlock, Projection, Rows, Unreadable, packed_size, slot_offsets, split_module
from .config import ConfigView, Hints, StackFacts, with_transformers_defaults
from .families import (
    LATENTS,
    MODULE_FACTS,
    QUANT_PARAMS,
    REFUSED,
    RULES,
    SECOND_SETS,
    SHARED_BLOCKS,
    Latent,
    Part,
    Rule,
    projection_names,
)
from .libraries import companion_block, kv_map, library_notes, roles_by_position, with_separate_biases
from .notes import block_notes, linear_notes, projectionless, unknown_attention
from .placement import join, kind, place, stack_depths
from .result import Detection
from .shapes import heads_from_head_dim, pointwise, solve
from .shapes import packing as part_packing

T = TypeVar("T")


def detect(
    tensors: Mapping[str, TensorInfo],
    config: dict | None = None,
    hints: Hints | None = None,
    *,
    source: str = "the checkpoint",
    defaults: bool = False,
) -> Detection:
    """Find every attention block. Raises NoAttentionFoundError if there is none. Where config.json leaves
    out what a block needs, its model type's defaults in transformers are tried (``defaults``: this is that try)."""
    hints = (hints or Hints()).with_layout_counts(config)  # a layout file's heads: hints where none is given
    view = ConfigView(config, hints)
    _refuse_quantized(tensors)
    matches = match_modules(tensors, hints.layout_rules + RULES)
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
            if rule is LATENT_RULE:
                blocks.append(_latent_block(module, latents[module], stack, layer, tensors, view, facts))
                continue
            block = _build(module, rule, stack, layer, stage, tensors, view, facts)
            blocks.append(replace(block, kind=fixed[1]) if fixed is not None else block)
        except LayoutError as e:  # this block cannot be read; the others still can
            unreadable.append(Unreadable(stack, layer, module, e.message))
            errors.append(e)
    blocks = with_companions(roles_by_position(blocks, tensors), tensors)
    refused = [u for u in _refused(tensors) if u.module not in matches]
    if errors and not defaults and (filled := with_transformers_defaults(config)) is not None:
        try:
            again = detect(tensors, filled, hints, source=source, defaults=True)
        except LayoutError:
            again = None
        if again is not None and len(again.unreadable) < len(errors) + len(_refused(tensors)) + len(
            unknown_attention(tensors, [owner(p[0]) for p in placed])[0]
        ):
            filled_in = (
                f"config.json leaves out facts of {view.model_type} blocks (save_pretrained writes only what differs "
                f"from the defaults): read from transformers' defaults for {view.model_type}"
            )
            return replace(again, notes=[filled_in, *again.notes])
    unknown, left_alone = unknown_attention(tensors, [owner(p[0]) for p in placed])
    unreadable += refused + unknown
    if not blocks:
        if errors:
            raise errors[0]
        if refused:
            more = sum(1 for u in refused if u.why.endswith(refused[0].why.partition(" uses ")[2])) - 1
            where = refused[0].module + (f" and {more} more use " if more else " uses ")
            raise UnsupportedWeightsError(where + refused[0].why.partition(" uses ")[2])
        raise NoAttentionFoundError(_nothing_found(tensors, notes + [u.why for u in unknown], source))
    _refuse_mixed_widths(blocks, view)
    blocks = shared_blocks(blocks, view)
    depths = stack_depths([b.stack for b in blocks], tensors)
    notes = block_notes(blocks, view) + library_notes(blocks) + notes
    return Detection(
        blocks,
        notes,
        depths=depths,
        unreadable=unreadable,
        left_alone=linear_notes(linear) + left_alone + projectionless(tensors),
    )


LATENT_RULE = Rule("latent (MLA)", ())  # a match read by _latent_block, not by parts


def latent_modules(tensors: Mapping[str, TensorInfo]) -> dict[str, Latent]:
    """The modules that hold multi-head latent attention (LATENTS), each with its spelling: its down-projection
    beside the per-head key/value up-projection and a query projection."""
    out: dict[str, Latent] = {}
    for latent in LATENTS:
        marker = "." + latent.marker + ".weight"
        for name in tensors:
            if name.endswith(marker) or name == marker[1:]:
                module = name[: -len(marker)] if name.endswith(marker) else ""
                if join(module, latent.kv + ".weight") in tensors and any(
                    join(module, q + ".weight") in tensors for q in latent.query
                ):
                    out.setdefault(module, latent)
    return out


def _latent_block(
    module: str,
    latent: Latent,
    stack: str,
    layer: int,
    tensors: Mapping[str, TensorInfo],
    view: ConfigView,
    facts: StackFacts,
) -> AttentionBlock:
    """One multi-head latent attention block: per head, the query rows, the key's rows without its rotary
    part and the value rows, over the latents; the shared down-projections are not part of it."""
    where = module or "the top-level attention module"
    heads = facts.pick(facts.heads, None)
    sizes = view.latent_sizes(stack, latent)
    if not isinstance(heads, int) or sizes is None:
        missing = "the number of heads" if not isinstance(heads, int) else "its head sizes"
        keys = f"{latent.nope_key}, {latent.rope_key}, {latent.value_key}"
        raise LayoutError(
            f"cannot tell {missing} of the latent attention {where}: {facts.source} does not say (it needs "
            f"num_attention_heads, {keys}); pass {opt('config', 'PATH')} with the model's config.json"
        )
    nope, rope, value = sizes
    query = next(join(module, q + ".weight") for q in latent.query if join(module, q + ".weight") in tensors)
    kv, down = tensors[join(module, latent.kv + ".weight")], tensors[join(module, latent.marker + ".weight")]
    q = tensors[query]
    for info in (q, kv, down):
        _check_part(info, view, stack, module)
    width = kv.shape[1]
    want = {
        query: (heads * (nope + rope), q.shape[1]),
        kv.name: (heads * (nope + value), width),
        down.name: (width + rope, down.shape[1]),
    }
    for name, shape in want.items():
        if tensors[name].shape != shape:
            raise LayoutError(
                f"the shapes of the latent attention {where} do not fit {heads} heads of {nope}+{rope} query/key and "
                f"{value} value features from {facts.source}: {name} is {list(tensors[name].shape)}, not {list(shape)}; "
                f"check the config or pass {opt('config', 'PATH')}"
            )
    step = nope + value
    qk = nope + rope
    q_bias = join(owner(module), query.rsplit(".", 2)[-2] + ".bias")
    kv_bias = join(owner(module), latent.kv + ".bias")  # litgpt's kv_b_proj has one (config.bias); DeepSeek's none
    k_rows, v_rows = tuple(h * step for h in range(heads)), tuple(h * step + nope for h in range(heads))

    def biased(rows: tuple[int, ...], size: int) -> Rows | None:
        return Rows(kv_bias, 0, rows, size) if kv_bias in tensors else None

    return AttentionBlock(
        stack=stack,
        layer=layer,
        kind=kind(module),
        module=module,
        layout=LATENT_RULE.name,
        heads=heads,
        kv_heads=heads,
        head_dim=qk,
        q=Projection(
            "q",
            Rows(query, 0, tuple(h * qk for h in range(heads)), qk),
            Rows(q_bias, 0, tuple(h * qk for h in range(heads)), qk) if q_bias in tensors else None,
            q.shape[1],
        ),
        k=Projection("k", Rows(kv.name, 0, k_rows, nope), biased(k_rows, nope), width),
        v=Projection("v", Rows(kv.name, 0, v_rows, value), biased(v_rows, value), width),
        kv_map=kv_map(module),
    )


def _refused(tensors: Mapping[str, TensorInfo]) -> list[Unreadable]:
    """The modules of each refused layout present (REFUSED), each with why."""
    out = []
    for rule in REFUSED:
        modules = [n[: -len(rule.weights[0]) - 1] for n in tensors if n.endswith("." + rule.weights[0])]
        modules = [m for m in modules if all(join(m, w) in tensors for w in rule.weights)]
        places = place(modules)
        for m in modules:
            why = f"{m} uses {rule.name}, which surgeon does not re-initialize: {rule.why}"
            out.append(Unreadable(places[m].stack, places[m].layer, m, why))
    return out


def _refuse_mixed_widths(blocks: list[AttentionBlock], view: ConfigView) -> None:
    """One --num-heads without a config cannot be right for blocks of different widths: a count that
    fits one splits the others into heads they do not have (a 4-head block read as 16 heads)."""
    count = view.hints.num_heads
    if view.has_config or view.hints.force or not isinstance(count, int):
        return
    widths: dict[int, list[AttentionBlock]] = {}
    for b in blocks:
        widths.setdefault(b.heads * b.head_dim, []).append(b)
    if len(widths) < 2:
        return
    listed = "; ".join(
        f"{w} wide: {', '.join(b.module or '(top level)' for b in bs[:2])}{', ...' if len(bs) > 2 else ''}"
        for w, bs in widths.items()
    )
    stacks = {w: {b.stack for b in bs} for w, bs in widths.items()}
    apart = all(not (a & b) for i, a in enumerate(stacks.values()) for b in list(stacks.values())[i + 1 :])
    per_stack = ",".join(f"{s}=N" for ss in stacks.values() for s in sorted(ss) if s)
    how = (
        f"give each stack its own count ({opt('num_heads', per_stack)})"
        if apart and per_stack
        else "describe the model"
    )
    raise LayoutError(
        f"one {opt('num_heads', count)} for attention blocks of different widths ({listed}): a count that fits one splits "
        f"the others into heads they do not have; {how}, pass {opt('config', 'PATH')}, or {opt('force_hints', True)} to split every block into {count} heads"
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


def _refuse_quantized(tensors: Mapping[str, TensorInfo]) -> None:
    leaves = {p.weight.rsplit(".", 1)[0] for rule in RULES for p in rule.parts if "." in p.weight}
    for name in tensors:
        module, _, param = name.rpartition(".")
        if param in QUANT_PARAMS and module.rpartition(".")[2] in leaves:
            raise UnsupportedWeightsError(
                f"{module} is quantized ({param} {tensors[name].dtype}): surgeon rewrites float weights only; "
                "re-initialize the float checkpoint, then quantize",
                tensor=name,
            )


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
                _refuse_marker_names(module)
                found[module] = rule
                break
    # A module that is itself a projection of a matched parent (e.g. "...attn.qkv" inside timm
    # when "...attn" matched) is not a second attention block.
    for module in list(found):
        for tag, rule in SECOND_SETS:
            if all(join(module, p.weight) in tensors for p in rule.parts):
                found[f"{module}[{tag}]"] = rule
    return found


def _refuse_marker_names(module: str) -> None:
    """A checkpoint's module path that ends like a block surgeon names ("x:context", "x[global]") would read as one."""
    if split_module(module)[0] != module:
        raise CheckpointError(
            f"the tensors under {module} look like attention projections, but their module path ends like the name "
            "surgeon gives a block's second stream or set (':context', '[global]'): rename the tensors (e.g. with "
            "safetensors' save_file) so their paths do not end so"
        )


def owner(module: str) -> str:
    """The module that holds a block's tensors: "x.attention.self" for its second set "x.attention.self[global]"."""
    return split_module(module)[0]


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
        _check_part(info, view, stack, module)
    # a layout file's packing is taken as it says; the built-in rules' may depend on the family
    user = rule in view.hints.layout_rules
    packings = [p.packing if user else part_packing(p, view, stack, module, where) for p, _ in parts]
    v_dim = facts.v_head_dim if "v" in packings else None
    layout = solve(parts, packings, heads, kv_hint, facts.head_dim, facts.hidden, where, facts.source, v_dim)
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


def _check_part(info: TensorInfo, view: ConfigView, stack: str, module: str) -> None:
    """A projection weight surgeon can rewrite: a float, non-empty 2-D matrix (or a pointwise convolution)."""
    if not info.is_float:
        raise UnsupportedWeightsError(
            f"{info.name} is {info.dtype}, not a float matrix: it looks quantized or integer; "
            "surgeon rewrites float16/bfloat16/float32 projections only",
            tensor=info.name,
        )
    if len(info.shape) != 2 and not pointwise(info, view, stack, module):
        raise LayoutError(
            f"{info.name} has shape {list(info.shape)}; a projection weight must be 2-D", tensor=info.name
        )
    if 0 in info.shape:
        raise LayoutError(
            f"{info.name} has shape {list(info.shape)}: an empty projection has no heads to re-initialize; "
            "the checkpoint is damaged or not a model surgeon can rewrite",
            tensor=info.name,
        )


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
) -> dict[str, Projection]:
    """The q/k/v projections one weight tensor holds (a gate's rows are not attention: left out)."""
    projections = {}
    offsets = slot_offsets(packing, heads, kv_heads, head_dim)
    in_features = info.shape[1 - axis]
    bias_name = join(owner(module), part.bias) if part.bias else None
    bias_offsets = slot_offsets(part.bias_packing or packing, heads, kv_heads, head_dim)
    for role, offs in offsets.items():
        if role not in ("q", "k", "v"):
            continue  # a gate: not attention, left as it is
        bias = None
        if (
            bias_name is not None
            and bias_name in tensors
            and tensors[bias_name].shape == (packed_size(part.bias_packing or packing, heads, kv_heads, head_dim),)
        ):
            bias = Rows(bias_name, 0, bias_offsets[role], head_dim)
        projections[role] = Projection(role, Rows(info.name, axis, offs, head_dim), bias, in_features)  # type: ignore[arg-type]
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
    known = ", ".join(projection_names())
    why = f"; closest: {notes[0]}" if notes else ""
    return (
        f"no attention found in {source}: looked at {len(names)} tensors ({sample}) and none sits under a module "
        f"with projections named {known}{why}; name yours in a layout file ({opt('layout', 'FILE')})"
    )
