"""A user's layout file (``--layout FILE``): attention projections as data, in the schema of :data:`RULES`.

The file is JSON::

    {"rules": [{"name": "my attention",
                "parts": [{"weight": "my_q.weight", "bias": "my_q.bias", "packing": "q"},
                          {"weight": "my_k.weight", "packing": "k"},
                          {"weight": "my_v.weight", "packing": "v", "orientation": "linear"}],
                "requires": []}],
     "heads": 4, "kv_heads": "n_kv_head", "head_dim": {"encoder.layers": 16}}

Each rule is a :class:`~surgeon.detect.families.Rule` (tensor names relative to the attention module,
``packing`` a key of :data:`surgeon.vocab.blocks.PACKINGS`, ``orientation`` linear / conv1d / shape); the rules are
tried before the built-in ones and their packing is taken as said. ``heads``, ``kv_heads`` and ``head_dim``
are each a number, one number per stack, or the config.json field that holds it; they act as
``num_heads``/``num_kv_heads``/``head_dim`` hints where those are not given. :func:`emit` writes what a
checkpoint's detection found in the same form, so that the file fed back gives the same blocks.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, LayoutError, OptionError, opt
from ..files.bounded import loads, read_bytes
from ..vocab.blocks import PACKINGS
from .families import Part, Rule

ORIENTATIONS = ("linear", "conv1d", "shape")
_TOP = ("rules", "heads", "kv_heads", "head_dim")
_RULE = ("name", "parts", "requires")
_PART = ("weight", "bias", "packing", "orientation", "bias_packing")
_NUMBERS = {"heads": "num_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim"}  # file key -> hint
LAYOUT_KEYS = {hint: key for key, hint in _NUMBERS.items()}  # hint -> the file's key
MAX_LAYOUT_BYTES = 1 << 20  # a layout is a few rules: a bigger file is not one

Count = int | str | dict[str, int] | None  # a number, the config field that holds it, or one per stack


@dataclass(frozen=True)
class Layout:
    """A layout file once read: its rules (tried first) and what it says about heads."""

    rules: tuple[Rule, ...]
    heads: Count = None
    kv_heads: Count = None
    head_dim: Count = None
    path: str = ""  # where it was read, for messages and the model card
    sha256: str = ""  # of the file's bytes: the record keeps it, so verify uses the same layout

    def recorded(self) -> dict[str, str]:
        """What the record keeps of this layout: the file's name (not its folder) and the digest of its bytes."""
        return {"file": os.path.basename(self.path), "sha256": self.sha256}

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
    try:  # the shared opener: a FIFO or a device is refused without blocking, the size before a byte is read
        raw = read_bytes(os.fspath(path), what="layout file", limit=MAX_LAYOUT_BYTES)
    except CheckpointError as e:
        raise OptionError(e.message) from None
    try:  # the shared parser: the nesting is capped before json.loads can recurse
        data = loads(raw, where=where)
    except CheckpointError as e:
        raise OptionError(f"{e.message}; write it as inspect's {opt('emit_layout')} writes one") from None
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
        sha256=hashlib.sha256(raw).hexdigest(),
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


def _choice(value: object, allowed: tuple[str, ...], where: str) -> str:
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
    for i, part in enumerate(read):  # one tensor, one role: a tensor named twice would be two roles' rows
        for j, other in enumerate(read[:i]):
            if part.weight in (other.weight, other.bias):  # a bias shared by parts is one packed bias_packing
                raise OptionError(
                    f"{where}.parts[{j}] and parts[{i}] both name {part.weight}: each part's weight is its own "
                    "tensor (a packed tensor is one part whose packing holds its roles, e.g. qkv)"
                )
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
