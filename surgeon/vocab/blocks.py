"""Attention blocks and projections described as data.

A projection is "which tensor, which rows, which orientation, how many heads": :class:`Rows` says
where each head's ``head_dim`` output features start inside one tensor, along which axis. Fused
layouts differ only in how the (role, head) slots are ordered inside a tensor, so each one is a
single entry of :data:`PACKINGS`; every other part of surgeon works on :class:`Projection` alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, TypeGuard

Role = Literal["q", "k", "v"]
ROLES: tuple[Role, ...] = ("q", "k", "v")


def is_role(name: str) -> TypeGuard[Role]:
    """Whether ``name`` is a projection's role (a packing's slot may also be a gate)."""
    return name in ROLES


Slot = tuple[str, int]  # (role, head): one block of head_dim output features

# surgeon's own suffixes on a block's module path: the second stream of a joint attention ("x:context")
# and a second set of a module's projections ("x[global]", Longformer). Only these, at the end, are
# markers; a checkpoint path that itself ends so is refused at detection (it would read as one).
STREAMS = ("context",)
SET_TAGS = ("global",)
_MARKED = re.compile(rf"(.*?)(?::({'|'.join(STREAMS)}))?(?:\[({'|'.join(SET_TAGS)})\])?", re.S)


def split_module(module: str) -> tuple[str, str, str]:
    """(the module that holds the tensors, its stream or "", its set tag or "") of a block's module path."""
    match = _MARKED.fullmatch(module)
    assert match is not None  # the pattern matches any text
    return match[1], match[2] or "", match[3] or ""


def owner(module: str) -> str:
    """The module that holds a block's tensors: "x.attention.self" for its second set "x.attention.self[global]"."""
    return split_module(module)[0]


@dataclass(frozen=True)
class Rows:
    """Where a projection's heads live inside one tensor.

    ``axis`` is the output-feature axis: 0 for an ``nn.Linear`` weight (out, in) or a bias,
    1 for a GPT-2 ``Conv1D`` weight or an ONNX ``MatMul`` initializer (in, out).
    Head ``h`` owns indices ``offsets[h] .. offsets[h] + size - 1`` along ``axis``.
    """

    tensor: str
    axis: int
    offsets: tuple[int, ...]
    size: int

    def head_slice(self, head: int) -> slice:
        start = self.offsets[head]
        return slice(start, start + self.size)


@dataclass(frozen=True)
class Projection:
    """The query, key or value projection of one attention block."""

    role: Role
    weight: Rows
    bias: Rows | None
    in_features: int

    @property
    def heads(self) -> int:
        return len(self.weight.offsets)

    @property
    def head_dim(self) -> int:
        return self.weight.size


@dataclass(frozen=True)
class Unreadable:
    """Attention surgeon found but cannot re-initialize faithfully (its heads, packing or projections are
    not known): never touched; a selection that includes it is refused, one that does not goes ahead."""

    stack: str
    layer: int
    module: str
    why: str  # one line: what is unknown


@dataclass(frozen=True)
class AttentionBlock:
    """One attention layer: its place in the model and its three projections."""

    stack: str  # module path of the layer list, e.g. "model.layers", "decoder.block"
    layer: int  # index inside its stack, from 0
    kind: Literal["self", "cross"]
    module: str  # the attention module, parent of the projections
    layout: str  # name of the layout rule that matched, e.g. "separate", "fused/interleaved"
    heads: int
    kv_heads: int
    head_dim: int
    q: Projection
    k: Projection
    v: Projection
    # Every layer of the stack that runs this one block, where several share it (Zamba2's shared
    # transformer); empty when only ``layer`` runs it.
    shared_layers: tuple[int, ...] = ()
    kv_map: str = "blocked"  # a key of KV_MAPS: which key/value head each query head reads

    @property
    def users(self) -> tuple[int, ...]:
        """The layers whose computation changes when this block changes."""
        return self.shared_layers or (self.layer,)

    @property
    def projections(self) -> tuple[Projection, Projection, Projection]:
        return (self.q, self.k, self.v)

    def projection(self, role: Role) -> Projection:
        return {"q": self.q, "k": self.k, "v": self.v}[role]

    def kv_head(self, head: int) -> int:
        """The key/value head that query head ``head`` reads."""
        return KV_MAPS[self.kv_map](head, self.heads, self.kv_heads)

    @property
    def label(self) -> str:
        layers = ",".join(map(str, self.users))
        _, stream, tag = split_module(self.module)
        tag = f" [{tag}]" if tag else ""
        base = f"{self.stack}.{layers}" if self.stack else layers
        return base + (f":{stream}" if stream else "") + tag

    def tensors(self) -> list[str]:
        names: list[str] = []
        for p in self.projections:
            for rows in (p.weight, p.bias):
                if rows is not None and rows.tensor not in names:
                    names.append(rows.tensor)
        return names

    def to_dict(self) -> dict:
        out = asdict(self)
        for role in ROLES:
            proj = out[role]
            for key in ("weight", "bias"):
                if proj[key] is not None:
                    proj[key]["offsets"] = list(proj[key]["offsets"])
        out["shared_layers"] = list(self.shared_layers)
        return out


# How query heads share key/value heads under grouped-query attention: "blocked", query head h reads
# key/value head h // (H/KV) (transformers' repeat_kv, SDPA enable_gqa); "interleaved", h % KV
# (x-transformers repeats key/value heads as '(r kvh)').
KV_MAPS: dict[str, Callable[[int, int, int], int]] = {
    "blocked": lambda head, heads, kv_heads: head // (heads // kv_heads),
    "interleaved": lambda head, heads, kv_heads: head % kv_heads,
}


# --- fused layouts -------------------------------------------------------------------------
# A packing lists the (role, head) slots of one tensor in storage order; each slot is head_dim
# consecutive output features. ``heads`` query heads, ``kv_heads`` key/value heads.
Packing = Callable[[int, int], list[Slot]]


def _single(role: str) -> Packing:
    return lambda heads, kv_heads: [(role, h) for h in range(heads if role == "q" else kv_heads)]


def _blocked(roles: str) -> Packing:
    # [Q heads | K heads | V heads]: GPT-2 c_attn, timm/nanoGPT qkv, MPT/ModernBERT Wqkv,
    # Phi-3 qkv_proj and GPTBigCode c_attn (GQA/MQA sections), nn.MultiheadAttention in_proj.
    def slots(heads: int, kv_heads: int) -> list[Slot]:
        return [(r, h) for r in roles for h in range(heads if r == "q" else kv_heads)]

    return slots


def _interleaved(heads: int, kv_heads: int) -> list[Slot]:
    # rows viewed as (H, 3, d): GPT-NeoX/Pythia, Bloom, Falcon (multi_query=False, without new_decoder_architecture)
    if heads != kv_heads:
        raise ValueError("an interleaved (H, 3, d) layout has as many key/value heads as query heads")
    return [(r, h) for h in range(heads) for r in "qkv"]


def _grouped(heads: int, kv_heads: int) -> list[Slot]:
    # rows viewed as (KV, H/KV + 2, d): each group holds its query heads, then its key, then its value
    # (Falcon new_decoder_architecture)
    group = heads // kv_heads
    slots: list[Slot] = []
    for g in range(kv_heads):
        slots += [("q", g * group + i) for i in range(group)]
        slots += [("k", g), ("v", g)]
    return slots


def _codegen(heads: int, kv_heads: int) -> list[Slot]:
    # rows viewed as (4, 3, H/4, d): four model-parallel chunks, each [Q | V | K] of H/4 heads (CodeGen)
    chunks = 4
    if heads != kv_heads or heads % chunks:
        raise ValueError("CodeGen's qkv_proj packs 4 chunks of as many key/value heads as query heads")
    per = heads // chunks
    return [(r, c * per + i) for c in range(chunks) for r in "qvk" for i in range(per)]


def _gated(heads: int, kv_heads: int) -> list[Slot]:
    # gated attention (Qwen3-Next, Qwen3.5): q_proj rows viewed as (H, 2, d): each head's query, then the
    # gate of its output; the gate is no projection of attention and is never written
    return [(r, h) for h in range(heads) for r in ("q", "gate")]


def _gate_qkv(heads: int, kv_heads: int) -> list[Slot]:
    # [gate | Q | K | V], chunk(4) of equal parts (HRM's gqkv_proj); the gate is no projection of attention
    if heads != kv_heads:
        raise ValueError("a [gate | Q | K | V] chunk(4) layout has as many key/value heads as query heads")
    return [(r, h) for r in ("gate", "q", "k", "v") for h in range(heads)]


PACKINGS: dict[str, Packing] = {
    "q": _single("q"),
    "k": _single("k"),
    "v": _single("v"),
    "qkv": _blocked("qkv"),
    "kv": _blocked("kv"),
    "interleaved": _interleaved,
    "grouped": _grouped,
    "codegen": _codegen,
    "gated": _gated,
    "gate_qkv": _gate_qkv,
}


def slot_offsets(packing: str, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Offsets of each role's heads along the output axis of a tensor packed as ``packing``."""
    slots = PACKINGS[packing](heads, kv_heads)
    by_role: dict[str, dict[int, int]] = {}
    for index, (role, head) in enumerate(slots):
        by_role.setdefault(role, {})[head] = index * head_dim
    return {role: tuple(offsets[h] for h in sorted(offsets)) for role, offsets in by_role.items()}


def packed_size(packing: str, heads: int, kv_heads: int, head_dim: int) -> int:
    return len(PACKINGS[packing](heads, kv_heads)) * head_dim
