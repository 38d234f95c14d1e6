"""A user's layout file (``--layout FILE``): attention projections as data, in the schema of :data:`RULES`.

The file is JSON::

    {"rules": [{"name": "my attention",
                "parts": [{"weight": "my_q.weight", "bias": "my_q.bias", "packing": "q"},
                          {"weight": "my_k.weight", "packing": "k"},
                          {"weight": "my_v.weight", "packing": "v", "orientation": "linear"}],
                "requires": []}],
     "heads": 4, "kv_heads": "n_kv_head", "head_dim": {"encoder.layers": 16}}

Each rule is a :class:`~surgeon.detect.families.Rule` (tensor names relative to the attention module,
``packing`` a key of :data:`surgeon.spec.PACKINGS`, ``orientation`` linear / conv1d / shape); the rules are
tried before the built-in ones and their packing is taken as said. ``heads``, ``kv_heads`` and ``head_dim``
are each a number, one number per stack, or the config.json field that holds it; they act as
``num_heads``/``num_kv_heads``/``head_dim`` hints where those are not given. :func:`emit` writes what a
checkpoint's detection found in the same form, so that the file fed back gives the same blocks.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import LayoutError, OptionError, OutputError, opt
from ..spec import PACKINGS, AttentionBlock
from .families import Part, Rule

ORIENTATIONS = ("linear", "conv1d", "shape")
_TOP = ("rules", "heads", "kv_heads", "head_dim")
_RULE = ("name", "parts", "requires")
_PART = ("weight", "bias", "packing", "orientation", "bias_packing")
_NUMBERS = {"heads": "num_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim"}  # file key -> hint
LAYOUT_KEYS = {hint: key for key, hint in _NUMBERS.items()}  # hint -> the file's key
_MAX_BYTES = 1 << 20  # a layout is a few rules: a bigger file is not one

Count = int | str | dict[str, int] | None  # a number, the config field that holds it, or one per stack


@dataclass(frozen=True)
class Layout:
    """A layout file once read: its rules (tried first) and what it says about heads."""

    rules: tuple[Rule, ...]
    heads: Count = None
    kv_heads: Count = None
    head_dim: Count = None
    path: str = ""  # where it was read, for messages and the model card

    def counts(self, config: Mapping[str, Any] | None) -> dict[str, int | dict[str, int]]:
        """The hint each number gives (``num_heads`` -> 4), a config field's read from ``config``."""
        out: dict[str, int | dict[str, int]] = {}
        for key, hint in _NUMBERS.items():
            value = getattr(self, key)
            if isinstance(value, str):
                said = (config or {}).get(value)
                if isinstance(said, bool) or not isinstance(said, int) or said < 1:
                    where = "config.json has no such field" if said is None else f"it holds {said!r}, not a count"
                    raise LayoutError(f"layout file {self.path}: {key} names config field {value!r}, but {where}")
                value = said
            if value is not None:
                out[hint] = value
        return out


def read_layout(path: str | os.PathLike[str]) -> Layout:
    """Read and check a layout file; a one-line OptionError naming the field at fault otherwise."""
    where = f"layout file {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError as e:
        raise OptionError(f"cannot read {opt('layout', path)}: {e.strerror or e}") from None
    if len(raw) > _MAX_BYTES:
        raise OptionError(f"{where} is over {_MAX_BYTES} bytes: a layout file holds a few rules")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise OptionError(f"{where} is not JSON ({e}); write it as in `surgeon inspect --emit-layout FILE`") from None
    _keys(data, _TOP, where, required=("rules",))
    rules = data["rules"]
    if not isinstance(rules, list) or not rules:
        raise OptionError(f"{where}: rules must be a non-empty list of rules")
    return Layout(
        tuple(_rule(r, f"{where}: rules[{i}]", i) for i, r in enumerate(rules)),
        heads=_count(data.get("heads"), f"{where}: heads"),
        kv_heads=_count(data.get("kv_heads"), f"{where}: kv_heads"),
        head_dim=_count(data.get("head_dim"), f"{where}: head_dim"),
        path=str(path),
    )


def _keys(data: object, allowed: tuple[str, ...], where: str, *, required: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise OptionError(f"{where} must be an object with the keys {', '.join(allowed)}")
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise OptionError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(allowed)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise OptionError(f"{where}: {missing[0]} is missing")


def _name(value: object, where: str, *, optional: bool = False) -> str | None:
    """A tensor name relative to the attention module: dotted words, no empty word."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or any(not w for w in value.split(".")):
        raise OptionError(f"{where} must be a tensor name under the attention module (e.g. my_q.weight), not {value!r}")
    return value


def _choice(value: object, allowed, where: str) -> str:
    if value not in allowed:
        raise OptionError(f"{where} is {value!r}; it must be one of {', '.join(allowed)}")
    return str(value)


def _rule(data: object, where: str, index: int) -> Rule:
    _keys(data, _RULE, where, required=("parts",))
    assert isinstance(data, dict)
    name = data.get("name", f"layout file rule {index}")
    if not isinstance(name, str) or not name:
        raise OptionError(f"{where}.name must be a non-empty string")
    parts = data["parts"]
    if not isinstance(parts, list) or not parts:
        raise OptionError(f"{where}.parts must be a non-empty list of parts")
    read = tuple(_part(p, f"{where}.parts[{i}]") for i, p in enumerate(parts))
    requires = data.get("requires", [])
    if not isinstance(requires, list):
        raise OptionError(f"{where}.requires must be a list of tensor names")
    # every role once: a rule's parts together hold one query, one key and one value projection
    roles = [r for p in read for r in dict.fromkeys(role for role, _ in PACKINGS[p.packing](2, 2)) if r != "gate"]
    for role in "qkv":
        if roles.count(role) != 1:
            raise OptionError(
                f"{where}.parts hold {roles.count(role)} {role} projections: the parts' packings together "
                "must hold one query, one key and one value projection"
            )
    return Rule(name, read, tuple(str(_name(r, f"{where}.requires[{i}]")) for i, r in enumerate(requires)))


def _part(data: object, where: str) -> Part:
    _keys(data, _PART, where, required=("weight", "packing"))
    assert isinstance(data, dict)
    bias_packing = data.get("bias_packing")
    return Part(
        str(_name(data["weight"], f"{where}.weight")),
        _name(data.get("bias"), f"{where}.bias", optional=True),
        _choice(data["packing"], tuple(PACKINGS), f"{where}.packing"),
        _choice(data.get("orientation", "linear"), ORIENTATIONS, f"{where}.orientation"),
        None if bias_packing is None else _choice(bias_packing, tuple(PACKINGS), f"{where}.bias_packing"),
    )


def _count(value: object, where: str) -> Count:
    def number(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if value is None or number(value):
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and value and all(isinstance(k, str) and number(v) for k, v in value.items()):
        return dict(value)
    raise OptionError(
        f'{where} is {value!r}; it must be a count of 1 or more, one per stack ({{"encoder": 12}}), '
        'or the config.json field that holds it ("n_head")'
    )


# --- what a detection found, in the same form ---------------------------------------------------


def emit(tensors: Mapping[str, Any], config: dict | None, hints: Any, blocks: list[AttentionBlock]) -> dict[str, Any]:
    """The layout of ``blocks`` (found by tensor names in ``tensors``) as a layout file's JSON object:
    each rule that matched with its packing and orientation as read, and the heads, key/value heads
    and head size per stack (one number where every stack agrees; left to the config where the
    blocks of one stack differ)."""
    from .by_name import LATENT_RULE, match_modules, place_matches
    from .config import ConfigView
    from .shapes import packing as part_packing

    view = ConfigView(config, hints)
    rules = list(view.hints.layout_rules) + list(_builtin())
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


def _builtin() -> tuple[Rule, ...]:
    from .families import RULES

    return RULES


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
        with open(path, "rb") as f:
            data = json.loads(f.read(_MAX_BYTES + 1).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "rules" in data
