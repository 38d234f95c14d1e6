"""From resolved attention cores to AttentionBlocks: heads, placement, the shared-initializer facts."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Literal

import numpy as np
import onnx

from ...errors import LayoutError, NoAttentionFoundError, UnsupportedWeightsError, opt
from ...vocab.blocks import ROLES, AttentionBlock, Projection, Rows
from ...vocab.detection import Detection, GraphFacts
from ..config import ConfigView
from ..families import REFUSED
from ..hints import Hints
from ..placement import place, stack_depths
from .found import Core, Proj
from .graph import Fail, Graph
from .walker import Walker


# --- from resolved cores to blocks ----------------------------------------------------------------
def find_attention(
    model: onnx.ModelProto,
    const: Callable[[str], np.ndarray | None],
    config: dict | None = None,
    hints: Hints | None = None,
    *,
    source: str = "the model",
    constants: dict[str, onnx.TensorProto] | None = None,
) -> Detection:
    """Every attention block of an ONNX model, in graph order, with the graph's facts (``Detection.graph``).
    Raises NoAttentionFoundError if none. ``constants``: weights kept in Constant nodes, by output name
    (read like initializers)."""
    graph = Graph(model, const, constants)
    walker = Walker(graph)
    resolved: list[Core] = []
    failures: list[str] = []
    cores = walker.cores()
    for n in cores:
        try:
            resolved.append(walker.resolve(n))
        except Fail as exc:
            failures.append(f"{graph.describe(n)}: {exc}")
    if not resolved:
        _refuse_named(graph, source)
        _refuse_qdq(graph, source)
        raise NoAttentionFoundError(_nothing_found(graph, cores, failures, source))
    resolved, scopes, repeats = _one_per_weight_set(resolved, _scopes(graph, resolved))
    fallback = [graph.nodes[c.node].name or f"{graph.nodes[c.node].op_type}_{c.node}" for c in resolved]
    placed = _place_cores(scopes, fallback)
    view = ConfigView(config, hints)
    blocks, notes = [], [f"skipped {f}" for f in failures] + repeats
    # (module, role) -> {"weight": node indices, "bias": node indices} that read its initializers
    users: dict[tuple[str, str], dict[str, frozenset[int]]] = {}
    # node index -> (block label, role) for every projection node, to name other users in messages
    owners: dict[int, tuple[str, str]] = {}
    for core, (stack, layer, module) in zip(resolved, placed):
        block, note = _block(graph, core, module, stack, layer, view)
        if note:
            notes.append(note)
        blocks.append(block)
        for role, p in zip("qkv", (core.q, core.k, core.v)):
            users[(module, role)] = {"weight": frozenset(p.weight_nodes), "bias": frozenset(p.bias_nodes)}
            for m in p.weight_nodes | p.bias_nodes:
                owners.setdefault(m, (block.label, role))
    return Detection(tuple(blocks), tuple(notes), GraphFacts(graph, users, owners), depths=_depths(graph, blocks))


def _depths(graph: Graph, blocks: list[AttentionBlock]) -> dict[str, int]:
    """Layers per stack, those without attention included: from initializer names (legacy and dynamo
    exports keep parameter paths), else from every node's scope (read only when the names say nothing)."""
    stacks = [b.stack for b in blocks]
    return stack_depths(stacks, graph.inits) or stack_depths(
        stacks, (s for s in map(graph.scope, range(len(graph.nodes))) if s)
    )


def _refuse_named(graph: Graph, source: str) -> None:
    """A layout surgeon refuses (REFUSED: multi-head latent attention), named where the exporter kept
    its module names in node or initializer names, rather than "no attention found"."""
    names = [n.name for n in graph.nodes] + list(graph.inits)
    for rule in REFUSED:
        leaves = [w.rsplit(".", 1)[0] for w in rule.weights]
        if all(any(leaf in name for name in names) for leaf in leaves):
            raise UnsupportedWeightsError(
                f"{source} uses {rule.name} ({', '.join(leaves)}), which surgeon does not re-initialize: {rule.why}"
            )


def _weight_set(core: Core) -> tuple:
    return tuple((p.weight, p.axis, p.base, p.width, p.bias, p.bias_base) for p in (core.q, core.k, core.v))


def _one_per_weight_set(cores: list[Core], scopes: list[str | None]) -> tuple[list[Core], list[str | None], list[str]]:
    """One core per module called several times with its Q/K/V weights (ALBERT's shared layers):
    one block, changed once, as in its PyTorch checkpoint; the nodes of every call are that block's
    users. The calls are told by their weights and their scope: the same module path (the legacy
    exporter numbers repeated calls ``attention_1``, ``attention_2``), or none. Layers of their own
    whose equal weights the exporter stored once (deep copies) stay blocks of their own."""
    first: dict[tuple, int] = {}
    uses: dict[tuple, int] = defaultdict(int)
    kept_cores: list[Core] = []
    kept_scopes: list[str | None] = []
    for core, scope in zip(cores, scopes):
        key = (_weight_set(core), re.sub(r"_\d+$", "", scope) if scope else None)
        uses[key] += 1
        if key not in first:
            first[key] = len(kept_cores)
            kept_cores.append(core)
            kept_scopes.append(scope)
            continue
        kept = kept_cores[first[key]]
        for mine, other in ((kept.q, core.q), (kept.k, core.k), (kept.v, core.v)):
            mine.weight_nodes |= other.weight_nodes
            mine.bias_nodes |= other.bias_nodes
    repeated = [n for n in uses.values() if n > 1]
    notes = []
    if repeated:
        notes.append(
            f"{len(repeated)} set{'s' if len(repeated) > 1 else ''} of attention weights {'are' if len(repeated) > 1 else 'is'} "
            f"used by {sum(repeated)} attention calls (weights shared across layers): one block for each set, changed once"
        )
    return kept_cores, kept_scopes, notes


def _block(
    graph: Graph, core: Core, module: str, stack: str, layer: int, view: ConfigView
) -> tuple[AttentionBlock, str | None]:
    q, k, v = core.q, core.k, core.v
    where = f"{module} ({graph.describe(core.node)})"
    d = q.head_dim or k.head_dim
    note = None
    if d is None and core.num_heads:
        d = q.width // core.num_heads if q.width % core.num_heads == 0 else None
    if d is None:
        facts = view.facts(stack)
        if facts.head_dim:
            d = facts.head_dim
        elif isinstance(facts.heads, int) and q.width % facts.heads == 0:
            d = q.width // facts.heads
    if d is None:
        raise LayoutError(
            f"cannot tell the heads of {where}: no Reshape splits its {q.width} query features and the op has no "
            f"num_heads attribute; pass {opt('num_heads', 'N')} (and {opt('num_kv_heads')}), or {opt('config', 'PATH')}"
        )
    for role, p in (("query", q), ("key", k), ("value", v)):
        if p.head_dim is not None and p.head_dim != d:
            raise LayoutError(
                f"{where}: the {role} heads are {p.head_dim} wide but the query heads {d}; surgeon needs one head size per block"
            )
        if p.width % d:
            raise LayoutError(
                f"{where}: the {role} projection has {p.width} features, not a multiple of the head size {d}"
            )
    heads, kv_heads = q.width // d, k.width // d
    if v.width // d != kv_heads or heads % kv_heads:
        raise LayoutError(
            f"{where}: {heads} query, {kv_heads} key and {v.width // d} value heads of size {d} do not form grouped attention"
        )
    if core.num_heads and core.num_heads != heads:
        raise LayoutError(
            f"{where}: num_heads={core.num_heads} but its {q.width} query features are {heads} heads of {d}"
        )
    hinted = view.hints.get("num_heads", module)
    if hinted and hinted != heads:
        note = f"{opt('num_heads', hinted)} ignored for {module}: the graph splits it into {heads} heads of {d}"
    projections = {}
    for role, p, count in zip(ROLES, (q, k, v), (heads, kv_heads, kv_heads)):
        offsets = tuple(p.base + h * d for h in range(count))
        bias = Rows(p.bias, 0, tuple(o - p.bias_base for o in offsets), d) if p.bias else None
        projections[role] = Projection(role, Rows(p.weight, p.axis, offsets, d), bias, p.in_features)
    layout = _layout(q, k, v)
    if core.label:
        layout = f"{core.label}: {layout}"
    kind: Literal["self", "cross"] = (
        "self" if q.source == k.source or core.label in ("com.microsoft.Attention",) else "cross"
    )
    block = AttentionBlock(
        stack, layer, kind, module, layout, heads, kv_heads, d, projections["q"], projections["k"], projections["v"]
    )
    return block, note


def _layout(q: Proj, k: Proj, v: Proj) -> str:
    op = q.op if q.op == k.op == v.op else "/".join(dict.fromkeys((q.op, k.op, v.op)))
    if q.weight == k.weight == v.weight:
        return "packed qkv" if op == "packed" else f"{op} qkv (fused)"
    if k.weight == v.weight:
        return f"{op} q + kv (fused)"
    return f"{op} q/k/v"


def _scopes(graph: Graph, cores: list[Core]) -> list[str | None]:
    """The module path of each core: its own scope, else the common scope of its projections."""
    out: list[str | None] = []
    for core in cores:
        scope = graph.scope(core.node)
        if not scope:
            parents = []
            for p in (core.q, core.k, core.v):
                s = graph.scope(p.node)
                parents.append(s.rsplit(".", 1)[0] if s and "." in s else None)
            if all(parents):
                common = _common_prefix([s.split(".") for s in parents])  # type: ignore[union-attr]
                scope = ".".join(common) or None
        out.append(scope)
    return out


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return prefix


def _place_cores(scopes: list[str | None], fallback: list[str]) -> list[tuple[str, int, str]]:
    """(stack, layer, module) for each block, in the order given.

    Module paths that differ only in numbers form a group (``encoder.layer.#.attention.self``); the
    numbers that vary inside a group index the layers and the stack is the path before the first of
    them, as for named checkpoints. A module called several times (shared weights) becomes its own
    stack, numbered by call; blocks without any scope are numbered in graph order and named after
    their core node, grouped by that name's prefix (``_unscoped_stacks``).
    """
    counts: dict[str, int] = defaultdict(int)
    for s in scopes:
        if s:
            counts[s] += 1
    placed: dict[int, tuple[str, int, str]] = {}
    calls: dict[str, int] = defaultdict(int)
    grouped: list[tuple[int, str]] = []  # (index, scope) of the blocks placed by their numbered paths
    used = set(s for s in scopes if s)
    unscoped = [i for i, s in enumerate(scopes) if not s]
    numbers: dict[str, int] = defaultdict(int)
    for i, stack in zip(unscoped, _unscoped_stacks([fallback[i] for i in unscoped])):
        name = fallback[i] if fallback[i] not in used else f"{fallback[i]}.{i}"
        used.add(name)
        placed[i] = (stack, numbers[stack], name)
        numbers[stack] += 1
    for i, s in enumerate(scopes):
        if not s:
            continue
        if counts[s] > 1:
            placed[i] = (s, calls[s], f"{s}[{calls[s]}]")
            calls[s] += 1
        else:
            grouped.append((i, s))
    places = place((s for _, s in grouped), lone="top")
    for i, s in grouped:
        placed[i] = (places[s].stack, places[s].layer, s)
    return [placed[i] for i in range(len(scopes))]


def _unscoped_stacks(names: list[str]) -> list[str]:
    """The stack of each block the exporter left without a scope, from its core node's name: names
    that differ only in numbers (``Softmax_12``, ``Softmax_57``; ``node_softmax``, ``node_softmax_1``)
    form one group, numbered in graph order. One group is the top-level stack ""; several (an
    encoder's and a decoder's names) are stacks named by the text before the first number."""
    keys = [re.sub(r"[_./:-]*#$", "", re.sub(r"\d+", "#", n)) for n in names]
    groups = list(dict.fromkeys(keys))
    if len(groups) <= 1:
        return [""] * len(names)
    short = {k: re.sub(r"[_./:-]*#.*$", "", k).strip("_./:-") or k for k in groups}
    if len(set(short.values())) < len(groups):
        short = {k: k.replace("#", "").strip("_./:-") or k for k in groups}
    if len(set(short.values())) < len(groups):
        short = {k: k for k in groups}
    return [short[k] for k in keys]


def _refuse_qdq(graph: Graph, source: str) -> None:
    """A QDQ graph (int8 export) hides its projections behind QuantizeLinear/DequantizeLinear: say so."""
    qdq = [n for n in graph.nodes if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    if qdq:
        raise UnsupportedWeightsError(
            f"{source} is quantized (QuantizeLinear/DequantizeLinear): re-initialize the float model, then quantize again "
            f"({len(qdq)} such nodes)"
        )


def _nothing_found(graph: Graph, cores: list[int], failures: list[str], source: str) -> str:
    if not cores:
        return (
            f"no attention found in {source}: its graph ({len(graph.nodes)} nodes) has no Softmax and no Attention, "
            "MultiHeadAttention or GroupQueryAttention node, which is where surgeon starts looking"
        )
    shown = "; ".join(failures[:4]) + (f"; and {len(failures) - 4} more" if len(failures) > 4 else "")
    return f"no attention found in {source}: looked at {len(cores)} Softmax/attention node{'s' if len(cores) > 1 else ''} and none led to Q/K/V projections ({shown})"
