"""``surgeon inspect --emit-layout``: what a detection found, written as a layout file (layout_file.py reads
it back), so a user can start a layout of their own from it."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, LayoutError, OutputError, opt
from ..files.bounded import loads, read_bytes, refuse_special
from ..vocab.blocks import AttentionBlock
from .by_name import match_modules, place_matches
from .config import ConfigView
from .families import RULES, Rule
from .latent import LATENT_RULE
from .layout_file import MAX_LAYOUT_BYTES
from .shapes import packing as part_packing


def emit(
    tensors: Mapping[str, Any], config: dict | None, hints: Any, blocks: Sequence[AttentionBlock]
) -> dict[str, Any]:
    """The layout of ``blocks`` (found by tensor names in ``tensors``) as a layout file's JSON object:
    each rule that matched with its packing and orientation as read, and the heads, key/value heads
    and head size per stack (one number where every stack agrees; left to the config where the
    blocks of one stack differ)."""
    view = ConfigView(config, hints)
    rules = list(view.hints.layout_rules) + list(RULES)
    by_module = {b.module: b for b in blocks}
    resolved: dict[int, tuple[Rule, str]] = {}  # index of the rule tried -> (as read, the module that read it)
    for module, rule, stack, _, _ in place_matches(match_modules(tensors, tuple(rules))):
        block = by_module.get(module)
        if rule is LATENT_RULE or block is None or "[" in module:
            continue  # latent attention and second sets: not in this schema; the built-in tables read them
        axes = {p.weight.tensor: p.weight.axis for p in block.projections}
        parts = []
        for p in rule.parts:
            tensor = f"{module}.{p.weight}" if module else p.weight
            packing = p.packing if rule in view.hints.layout_rules else part_packing(p, view, stack, module, module)
            orientation = p.orientation
            if orientation == "shape" and tensor in axes:
                orientation = "linear" if axes[tensor] == 0 else "conv1d"
            parts.append(replace(p, packing=packing, orientation=orientation))
        read = replace(rule, parts=tuple(parts))
        index = next(i for i, r in enumerate(rules) if r is rule)
        if index in resolved and resolved[index][0] != read:
            raise LayoutError(
                f"cannot write one layout file: rule {rule.name!r} reads {module} and {resolved[index][1]} "
                "with different packings or orientations"
            )
        resolved.setdefault(index, (read, module))
    if not resolved:
        raise LayoutError("no attention found by tensor names, so there is no layout to write")
    out: dict[str, Any] = {"rules": [_rule_json(resolved[i][0]) for i in sorted(resolved)]}
    for key, attr in (("heads", "heads"), ("kv_heads", "kv_heads"), ("head_dim", "head_dim")):
        per_stack: dict[str, set[int]] = {}
        for b in blocks:
            per_stack.setdefault(b.stack, set()).add(getattr(b, attr))
        if any(len(v) != 1 for v in per_stack.values()):
            continue
        values = {s: next(iter(v)) for s, v in per_stack.items()}
        out[key] = next(iter(values.values())) if len(set(values.values())) == 1 else values
    return out


def _rule_json(rule: Rule) -> dict[str, Any]:
    parts = []
    for p in rule.parts:
        part: dict[str, Any] = {"weight": p.weight, "bias": p.bias, "packing": p.packing, "orientation": p.orientation}
        if p.bias_packing is not None:
            part["bias_packing"] = p.bias_packing
        parts.append(part)
    out: dict[str, Any] = {"name": rule.name, "parts": parts}
    if rule.requires:
        out["requires"] = list(rule.requires)
    return out


def write_layout(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a layout file atomically (a temporary file beside it, then renamed)."""
    target = Path(path)
    refuse_special(
        target, what=opt("emit_layout"), error=OutputError
    )  # a FIFO would block the check below, a device take the file
    if target.is_dir():
        raise OutputError(f"{opt('emit_layout', path)} is a folder; give a file name such as layout.json")
    if not target.parent.is_dir():
        raise OutputError(f"{opt('emit_layout', path)}: the folder {target.parent} does not exist")
    if target.exists() and not _is_layout(target):  # never over a checkpoint's file (or anything else)
        raise OutputError(
            f"{opt('emit_layout', path)} exists and is not a layout file: give a new file name such as layout.json"
        )
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _is_layout(path: Path) -> bool:
    """Whether an existing file is a layout file (a JSON object with rules), which may be written over."""
    try:
        data = loads(read_bytes(path, what="layout file", limit=MAX_LAYOUT_BYTES), where="layout file")
    except CheckpointError:
        return False
    return isinstance(data, dict) and "rules" in data
