"""What the user says about heads, head size and layout (``--num-heads``, ``--layout`` ...), read and checked.

A count is one number for every stack or one per stack; :class:`Hints` holds them as read, and
:class:`~surgeon.detect.config.ConfigView` weighs them against what config.json says.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import LayoutError, OptionError, opt
from .families import Rule
from .layout_file import Layout, read_layout

HintValue = int | dict[str, int] | None  # a hint once read: one count, or one per stack
HintInput = (
    int | str | Mapping[str, int] | None
)  # what a caller may pass: 16, "16", "encoder=16,decoder=4", {"encoder": 16}


HINT_KEYWORDS = ("num_heads", "num_kv_heads", "head_dim", "force_hints", "layout")  # as the API's keywords spell them


@dataclass(frozen=True)
class Hints:
    """What the user says about heads, overriding config.json (``--num-heads`` etc.).

    Each count is one number for every stack, or one per stack: ``{"encoder": 16, "decoder": 4}``
    (on the command line ``encoder=16,decoder=4``); a key names a stack by its path or a word of it
    (``encoder``, ``vision`` for ``vision_model.encoder.layers``), and the first word of a path that a
    key names decides, as for the nested configs.

    Args:
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention).
        head_dim: Head size, where it is not width / heads.
        force: A hint wins even where config.json says otherwise.
        layout: A layout file (or a read one) whose rules are tried before the built-in ones.

    Raises:
        OptionError: A count is not one of 1 or more, nor one per stack; the layout file cannot be read.
        LayoutError: The layout file's rules are malformed.
    """

    num_heads: HintInput = None
    num_kv_heads: HintInput = None
    head_dim: HintInput = None
    force: bool = False  # --force-hints: a hint wins even where config.json says otherwise
    # --layout FILE: the user's rules, tried before the built-in ones (a path is read here)
    layout: Layout | str | os.PathLike[str] | None = None
    from_layout: tuple[str, ...] = ()  # the counts above that the layout file gave (for messages)

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, parse_hint(name, getattr(self, name)))
        if self.layout is not None and not isinstance(self.layout, Layout):
            object.__setattr__(self, "layout", read_layout(self.layout))

    @property
    def layout_rules(self) -> tuple[Rule, ...]:
        """The layout file's rules (none without one)."""
        return self.layout.rules if isinstance(self.layout, Layout) else ()

    def with_layout_counts(self, config: Mapping[str, Any] | None) -> Hints:
        """These hints with the layout file's heads, key/value heads and head size where none is given."""
        if not isinstance(self.layout, Layout):
            return self
        counts = {k: v for k, v in self.layout.counts(config).items() if getattr(self, k) is None}
        return replace(self, **counts, from_layout=tuple(counts)) if counts else self  # type: ignore[arg-type]

    def get(self, name: str, stack: str) -> int | None:
        """The count ``name`` says for ``stack`` (None: not said for it)."""
        value = getattr(self, name)
        if not isinstance(value, dict):
            return value  # an int or None once read (__post_init__)
        if stack in value:
            return value[stack]
        for word in stack.split("."):  # the first word a key names decides (decoder.bert.encoder.layer: decoder)
            for key, count in value.items():
                if _names(key, word):
                    return count
        return None

    @classmethod
    def build(cls, hints: Hints | None = None, /, **keywords: Any) -> Hints:
        """``hints`` (default: none) with the hints given as keywords replaced (``force_hints`` is ``force``)."""
        unknown = sorted(set(keywords) - set(HINT_KEYWORDS))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the hints are {', '.join(HINT_KEYWORDS)}")
        if hints is not None and not isinstance(hints, cls):
            raise TypeError(f"hints must be a surgeon.Hints, not {type(hints).__name__}")
        if "force_hints" in keywords:
            keywords["force"] = keywords.pop("force_hints")
        return replace(hints if hints is not None else cls(), **keywords)

    def check_stacks(self, stacks: list[str]) -> None:
        """Every per-stack key names a stack of the model."""
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            for key in value if isinstance(value, dict) else ():
                if not any(_names(key, s) for s in stacks):
                    shown = ", ".join(s or "(top level)" for s in stacks)
                    raise LayoutError(
                        f"{opt(name, _spelled(value))} names {key!r}, which is no stack of this model: its stacks are {shown}"
                    )
            for stack in stacks if isinstance(value, dict) else ():  # one key per stack, never a silent choice
                keys = [k for k in value if k == stack or any(_names(k, w) for w in stack.split("."))]
                if len(keys) > 1:
                    raise LayoutError(
                        f"{opt(name, _spelled(value))} names the stack {stack} twice ({keys[0]!r} and {keys[1]!r}): "
                        "give one count per stack"
                    )

    def spelled(self, name: str) -> str | None:
        """The hint as a command line writes it (``16``, ``encoder=16,decoder=4``), or None."""
        value = getattr(self, name)
        return None if value is None else _spelled(value)


def _names(key: str, stack: str) -> bool:
    """Whether a per-stack key names ``stack``: its path, or a word of it (``vision`` names ``vision_model``)."""
    return key == stack or any(key == w or key == w.split("_")[0] for w in stack.split("."))


def _spelled(value: HintInput) -> str:
    return ",".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)


def parse_hint(name: str, value: object) -> HintValue:
    """``16``, ``"16"``, ``"encoder=16,decoder=4"`` or ``{"encoder": 16}`` -> an int or a per-stack dict."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if "=" not in text:
            value = int(text) if text.isascii() and text.isdigit() else text
        else:
            pairs = [item.partition("=") for item in text.split(",") if item.strip()]
            if any(not k.strip() or not (v.strip().isascii() and v.strip().isdigit()) for k, _, v in pairs):
                raise OptionError(
                    f"cannot read {opt(name, text)}: give one count (16) or one per stack (encoder=16,decoder=4)"
                )
            value = {k.strip(): int(v) for k, _, v in pairs}
    if isinstance(value, Mapping):
        if not value or any(
            not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 1 for k, v in value.items()
        ):
            raise OptionError(
                f"{opt(name)} per stack must map stack names to counts of 1 or more, e.g. encoder=16,decoder=4"
            )
        return dict(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(
            f"{opt(name)} must be a count of 1 or more, or one per stack (encoder=16,decoder=4), not {value!r}"
        )
    return value
