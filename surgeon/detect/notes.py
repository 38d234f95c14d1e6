"""What detection says about the blocks it found: layouts read by convention, gated queries, shared-block adapters."""

from __future__ import annotations

from collections.abc import Mapping

from ..formats.base import TensorInfo
from ..vocab.blocks import AttentionBlock, Unreadable
from ..vocab.selection import format_indices
from .config import ConfigView
from .families import (
    ATTENTION_WORDS,
    NO_PROJECTION_ATTENTION,
    NOT_ATTENTION_WORDS,
    NOT_QK_ATTENTION,
    QUERY_KEY_WORDS,
    SHARED_BLOCKS,
    projection_names,
)
from .placement import join, place


def block_notes(blocks: list[AttentionBlock], view: ConfigView) -> list[str]:
    """The notes on ``blocks`` a user should read, in the order a report shows them."""
    return _assumed_layouts(blocks, view) + _gated(blocks) + _latent(blocks) + _tiled(blocks) + _adapters(blocks, view)


# Fused tensors whose packing is a naming convention rather than something config.json states.
_CONVENTIONAL = {"fused qkv": "timm/nanoGPT", "fused to_qkv": "chunk(3)"}


def _assumed_layouts(blocks: list[AttentionBlock], view: ConfigView) -> list[str]:
    """Say so when a fused layout rests on a naming convention alone (no model_type to confirm it)."""
    if view.model_type or view.config.get(
        "architecture"
    ):  # a timm config names the model (FUSED_PACKING_BY_ARCHITECTURE)
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


def _gated(blocks: list[AttentionBlock]) -> list[str]:
    gated = [b for b in blocks if b.layout.endswith("gated q")]
    if not gated:
        return []
    return [
        f"gated attention: {gated[0].q.weight.tensor.rsplit('.', 1)[0]} (and {len(gated) - 1} more) holds per head {gated[0].head_dim} query rows, "
        "then the output gate's rows; the query rows are re-initialized, the gate rows are kept byte for byte"
    ]


def _latent(blocks: list[AttentionBlock]) -> list[str]:
    latent = [b for b in blocks if b.layout == "latent (MLA)"]
    if not latent:
        return []
    b = latent[0]
    more = f" and {len(latent) - 1} more" if len(latent) > 1 else ""
    notes = [
        f"multi-head latent attention: {b.module}{more}: per head, the query ({b.q.head_dim} rows of "
        f"{b.q.weight.tensor.rsplit('.', 1)[0]}), the key without its rotary part ({b.k.head_dim} rows) and the value "
        f"({b.v.head_dim} rows of {b.k.weight.tensor.rsplit('.', 1)[0]}, over the {b.k.in_features}-wide latent) are "
        "re-initialized; the shared down-projections, their norms and the rotary key part every head shares are kept, "
        "so each head's map from the hidden state also passes through them"
    ]
    return notes


def _tiled(blocks: list[AttentionBlock]) -> list[str]:
    """Where a block's value heads are wider together than their input, the block value identity tiles it."""
    wide = [b for b in blocks if b.kv_heads * b.v.head_dim > b.v.in_features]
    if not wide:
        return []
    b = wide[0]
    more = f" (and {len(wide) - 1} more blocks)" if len(wide) > 1 else ""
    return [
        f"{b.module}{more}: {b.kv_heads} value heads of {b.v.head_dim} are wider than their {b.v.in_features} input "
        f"features: the block value identity tiles them, head h reading the features of head h mod "
        f"{max(b.v.in_features // b.v.head_dim, 1)} (each head kappa 1)"
    ]


def _adapters(blocks: list[AttentionBlock], view: ConfigView) -> list[str]:
    rule = SHARED_BLOCKS.get(view.model_type or "")
    if (
        rule is None
        or not rule.adapters_flag
        or view.config.get(rule.adapters_flag) is not True
        or not any(b.shared_layers for b in blocks)
    ):
        return []
    return [
        f"each layer adds its own adapter to the shared block's q/k/v ({rule.adapters_flag}); the adapters are kept, so a "
        "layer's query/key/value maps are the re-initialized weights plus its adapter"
    ]


def linear_notes(linear: dict[str, list[int]]) -> list[str]:
    """One note per stack whose config marks layers as linear attention, which surgeon leaves alone."""
    return [
        f"left alone: {len(layers)} linear-attention layer{'s' if len(layers) > 1 else ''} of {stack or 'the model'} "
        f"({format_indices(sorted(layers))}): config.json marks them linear attention, not softmax attention"
        for stack, layers in linear.items()
    ]


def projectionless(tensors: Mapping[str, TensorInfo]) -> list[str]:
    """One note per kind of attention that has no projections to re-initialize (NO_PROJECTION_ATTENTION)."""
    notes = []
    for word, what in NO_PROJECTION_ATTENTION.items():
        modules = list(
            dict.fromkeys(f".{n}".rpartition(f".{word}.")[0][1:] for n in tensors if f".{word}." in f".{n}.")
        )
        if modules:
            more = f" and {len(modules) - 1} more" if len(modules) > 1 else ""
            notes.append(f"left alone: {join(modules[0], word)}{more}: {what}")
    return notes


def unknown_attention(tensors: Mapping[str, TensorInfo], matched: list[str]) -> tuple[list[Unreadable], list[str]]:
    """Modules named like attention (ATTENTION_WORDS) that hold projection-like matrices no rule reads and
    no found block is in or around: attention surgeon cannot read (refused when selected), or attention
    without a query-key product (NOT_QK_ATTENTION: only named). Returns both."""
    owners = matched  # the modules that hold the found blocks' tensors
    query_key = _query_key_modules(tensors)
    found: dict[str, list[str]] = {}
    for name, info in tensors.items():
        if len(info.shape) < 2:
            continue
        parts = name.split(".")[:-1]
        hits = [i for i, p in enumerate(parts) if any(w in p.lower() for w in ATTENTION_WORDS)]
        if not hits or any(w in parts[hits[-1]].lower() for w in NOT_ATTENTION_WORDS):
            hits = [len(parts) - 2] if len(parts) > 1 and parts[:-1] in query_key else []
            if not hits:
                continue
        module = ".".join(parts[: hits[-1] + 1])
        if any(_inside(o, module) or _inside(module, o) for o in owners):
            continue
        found.setdefault(module, []).append(name[len(module) + 1 :])
    found = {m: names for m, names in found.items() if len(names) >= 2}
    places = place(found)
    unread, notes = [], []
    for module, names in found.items():
        other = next((why for mark, why in NOT_QK_ATTENTION.items() if any(n.startswith(mark) for n in names)), None)
        if other is not None:
            notes.append(module)
            continue
        why = (
            f"{module} looks like attention ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) but holds no "
            f"projections named as surgeon knows them ({', '.join(projection_names()[:6])}, ...)"
        )
        unread.append(Unreadable(places[module].stack, places[module].layer, module, why))
    if not notes:
        return unread, []
    kind = next(why for mark, why in NOT_QK_ATTENTION.items() if any(n.startswith(mark) for n in found[notes[0]]))
    more = f" and {len(notes) - 1} more like it" if len(notes) > 1 else ""
    return unread, [f"left alone: {notes[0]}{more}: {kind}"]


def _query_key_modules(tensors: Mapping[str, TensorInfo]) -> list[list[str]]:
    """The module paths (as lists of parts) with child matrices named for the query, the key and the value
    (QUERY_KEY_WORDS), whatever the module's own name."""
    children: dict[tuple[str, ...], set[str]] = {}
    for name, info in tensors.items():
        parts = name.split(".")
        if len(info.shape) >= 2 and len(parts) > 2:
            children.setdefault(tuple(parts[:-2]), set()).add(parts[-2].lower())
    return [
        list(module)
        for module, names in children.items()
        if all(any(set(w) & set(n.split("_")) for n in names) for w in QUERY_KEY_WORDS)
        and len({n for n in names if any(set(w) & set(n.split("_")) for w in QUERY_KEY_WORDS)}) >= 3
    ]


def _inside(inner: str, outer: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")
