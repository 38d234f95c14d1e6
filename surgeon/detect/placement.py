"""Where each attention module sits: its stack, its layer in the stack, its stage and its kind.

One rule for every route (tensor names, ONNX scopes, nn.Module paths): module paths that differ
only in numbers form a group (``model.layers.#.self_attn``); the numbers that vary inside a group
index the layers, and the stack is the path before the first of them. A layer is the model's own
number from the path (``model.layers.3`` is layer 3 even when layers 0-2 are Mamba or convolution
layers without attention), so self- and cross-attention of one decoder share layer numbers; where
two numbers vary (Swin's stage and block) the layers are numbered by rank over the stack. The stage
(Swin's per-stage head counts) is read from the path itself: the first number of a path that has several.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .families import CROSS_BY_PATH, CROSS_ROLES, CROSS_WORDS, INDEXED_NAMES

NUMERIC = re.compile(r"^\d+$")
_INDEXED = tuple(re.compile(p) for p in INDEXED_NAMES)
_CROSS_PATHS = tuple(re.compile(p) for p in CROSS_BY_PATH)


def _number(part: str) -> int | None:
    """The layer number a path component stands for: "3", or "encoder_layer_3" (INDEXED_NAMES)."""
    if NUMERIC.match(part):
        return int(part)
    for pattern in _INDEXED:
        match = pattern.match(part)
        if match:
            return int(match.group(1))
    return None


def join(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if module else leaf


def kind(module: str) -> Literal["self", "cross"]:
    """ "cross" when one of the last two path components is a cross-attention word, the path is one a library
    writes for cross-attention (CROSS_BY_PATH) or the module's role in its block says so (CROSS_ROLES), else "self".
    What a path cannot tell (SELF_BESIDE, CROSS_BY_POSITION) is settled with the other names in
    :func:`surgeon.detect.libraries.roles_by_position`."""
    comps = module.split(".")
    leaf_words = [w.lower() for w in comps[-2:]]
    if any(w in CROSS_WORDS for w in leaf_words):
        return "cross"
    if any(p.search(module) for p in _CROSS_PATHS):  # the library's module tree (CROSS_BY_PATH): vit-pytorch CrossViT
        return "cross"
    # the module's role in its block (CROSS_ROLES): diffusers' transformer_blocks.N.attn2
    return "cross" if any(comps[-3:-2] == [block] and comps[-1] == leaf for block, leaf in CROSS_ROLES) else "self"


@dataclass(frozen=True)
class Place:
    stack: str
    layer: int
    stage: int | None


def place(modules: Iterable[str], *, lone: str = "module") -> dict[str, Place]:
    """The place of each module path, keyed by path.

    ``lone``: the stack of a path without any number (SigLIP's pooling head): "module" makes it a
    stack of its own, "top" puts it in the top-level stack "".
    """
    modules = list(dict.fromkeys(modules))
    groups: dict[str, list[str]] = defaultdict(list)
    for module in modules:
        groups[_template(module)].append(module)
    raw: dict[str, tuple[str, int, tuple[int, ...], int | None]] = {}
    for template, members in groups.items():
        numeric = [i for i, p in enumerate(template.split(".") if template else []) if p == "#"]
        split = [m.split(".") for m in members]
        varying = [i for i in numeric if len({s[i] for s in split}) > 1] or numeric[:1]
        for module, comps in zip(members, split):
            if varying:
                stack = ".".join(comps[: varying[0]])
            else:
                stack = module if lone == "module" else ""
            key = tuple(_number(comps[i]) or 0 for i in varying)
            stage = _number(comps[numeric[0]]) if len(numeric) > 1 else None
            raw[module] = (stack, len(varying), key, stage)
    ranks: dict[tuple[str, int], set[tuple[int, ...]]] = defaultdict(set)
    for stack, depth, key, _ in raw.values():
        ranks[(stack, depth)].add(key)
    order = {k: sorted(v) for k, v in ranks.items()}
    return {
        m: Place(stack, key[0] if depth == 1 else order[(stack, depth)].index(key), stage)
        for m, (stack, depth, key, stage) in raw.items()
    }


def stack_depths(stacks: Iterable[str], names: Iterable[str]) -> dict[str, int]:
    """Layers in each stack, counting those without attention: one more than the highest number
    that follows ``stack.`` in any tensor or module name (a hybrid's Mamba layer 5 counts)."""
    wanted = {s for s in stacks if s}
    depths: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts[1:], 1):
            if NUMERIC.match(part):
                stack = ".".join(parts[:i])
                if stack in wanted:
                    depths[stack] = max(depths.get(stack, 0), int(part) + 1)
    return depths


def _template(module: str) -> str:
    return ".".join("#" if _number(p) is not None else p for p in module.split(".")) if module else ""
