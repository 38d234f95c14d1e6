"""Index specs (``--layers``, ``--heads``), targets and attention kinds.

An index spec is ``all`` or a comma-separated list of items, each one of
``N`` (one index), ``A-B`` (inclusive range), ``A-`` (from A to the last).
Negative numbers count from the end: ``-1`` is the last, ``-4-`` the last four,
``-4--2`` the fourth-last to the second-last.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import SelectionError, opt
from .blocks import ROLES, Role

IndexSpec = str | int | Iterable[int] | None

_ITEM = re.compile(r"^(-?\d+)(?:(-)(-?\d+)?)?$")


@dataclass(frozen=True)
class IndexSelection:
    """A ``--layers``/``--heads`` spec, read: its spelling as given (what records show) and its items.

    Made by :func:`parse_indices`, which refuses what no model can make sense of; :meth:`resolve` checks the
    indices against a model's count.
    """

    what: str  # "layer" or "head": the word the errors use
    given: str | int | tuple | None  # as given: a spec string, one number, the items of a list, None (all)
    items: tuple[tuple[int, int | None], ...] | None  # (start, end; None: to the last), None: all

    @property
    def all(self) -> bool:
        return self.items is None

    @property
    def spelled(self) -> str:
        """The selection as a message spells it."""
        if isinstance(self.given, (str, int)):
            return str(self.given)
        return format_indices(sorted(self.given)) if self.given is not None else "all"

    def resolve(self, count: int, *, where: str) -> list[int]:
        """The selected indices of ``count`` items (numbered 0..count-1), sorted; ``where`` names their owner."""
        if self.items is None:
            return list(range(count))
        picked: set[int] = set()
        for start, end in self.items:
            first = _absolute(start, count, what=self.what, where=where)
            last = count - 1 if end is None else _absolute(end, count, what=self.what, where=where)
            if last < first:
                raise SelectionError(
                    f"{self.what} range {_item(start, end)!r} is empty: its end comes before its start"
                )
            picked.update(range(first, last + 1))
        return sorted(picked)


def _item(start: int, end: int | None) -> str:
    return f"{start}-" if end is None else f"{start}-{end}"


def parse_indices(spec: IndexSpec | IndexSelection, *, what: str) -> IndexSelection:
    """``spec`` read as a selection of ``what`` ("layer", "head"); an :class:`IndexSelection` is returned as it is.

    Raises:
        SelectionError: ``spec`` is no spec: an item is not N, A-B or A-, a range is empty whatever the count,
            or a list holds a non-integer.
    """
    if isinstance(spec, IndexSelection):
        return spec
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        return IndexSelection(what, spec, None)
    if isinstance(spec, bool):
        raise SelectionError(f"{what}s must be a spec like '0-3,7' or a list of integers, not {spec!r}")
    if isinstance(spec, int):
        return IndexSelection(what, spec, ((spec, spec),))
    if isinstance(spec, str):
        items: list[tuple[int, int | None]] = []
        for raw in spec.split(","):
            item = raw.strip()
            match = _ITEM.match(item)
            if not match:
                raise SelectionError(
                    f"cannot read {what} spec item {item!r} in {spec!r}: "
                    f"use N, A-B, A- or all, e.g. '0-3,7' (negative counts from the end)"
                )
            start = int(match.group(1))
            if match.group(2) is None:
                items.append((start, start))
                continue
            end = None if match.group(3) is None else int(match.group(3))
            if end is not None and (start < 0) == (end < 0) and end < start:  # empty whatever the count
                raise SelectionError(f"{what} range {item!r} is empty: its end comes before its start")
            items.append((start, end))
        return IndexSelection(what, spec, tuple(items))
    try:
        given = tuple(spec)
        values = [int(i) for i in given]
    except (TypeError, ValueError):
        raise SelectionError(f"{what}s must be a spec like '0-3,7' or a list of integers, not {spec!r}") from None
    return IndexSelection(what, given, tuple((i, i) for i in values))


def resolve_indices(spec: IndexSpec, count: int, *, what: str, where: str) -> list[int]:
    """Resolve ``spec`` against ``count`` items (numbered 0..count-1) to a sorted list.

    ``what`` names the items ("layer", "head"), ``where`` their owner for error messages.
    """
    return parse_indices(spec, what=what).resolve(count, where=where)


def _absolute(index: int, count: int, *, what: str, where: str) -> int:
    resolved = index + count if index < 0 else index
    if not 0 <= resolved < count:
        have = f"{what}s 0-{count - 1}" if count > 1 else f"only {what} 0"
        raise SelectionError(f"{what} {index} is out of range: {where} has {have}")
    return resolved


def format_indices(indices: Sequence[int]) -> str:
    """Compact form of a sorted index list: [0,1,2,5] -> '0-2,5'."""
    parts: list[str] = []
    run: list[int] = []
    for i in indices:
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(_run(run))
        run = [i]
    if run:
        parts.append(_run(run))
    return ",".join(parts)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


TARGETS: tuple[Role, ...] = ROLES
# Spellings that are refused with a hint, never guessed: 'query' (write q), 'qk' (write q,k).
_TARGET_HINTS = {"query": "q", "key": "k", "value": "v"}


def parse_targets(spec: str | Iterable[str] | None) -> tuple[Role, ...]:
    """``'q,k'`` / ``['q', 'v']`` -> ordered subset of ('q', 'k', 'v'). Only q, k and v are accepted."""
    if spec is None:
        return TARGETS
    if isinstance(spec, str):
        items = [s.strip().lower() for s in spec.split(",") if s.strip()]
    else:
        items = [str(s).strip().lower() for s in spec]
    if not items:
        raise SelectionError(f"no targets given: use any of q,k,v (e.g. {opt('targets', 'q,k')})")
    chosen = set()
    for item in items:
        if item not in TARGETS:
            if item in _TARGET_HINTS:
                hint = f"write {_TARGET_HINTS[item]}"
            elif item and set(item) <= set(TARGETS):
                hint = f"write {','.join(item)}, comma-separated"
            else:
                hint = f"use any of q,k,v, comma-separated (e.g. {opt('targets', 'q,k')})"
            raise SelectionError(f"unknown target {item!r}: {hint}")
        chosen.add(item)
    return tuple(t for t in TARGETS if t in chosen)


ATTENTION_KINDS = ("self", "cross", "all")


def parse_attention(kind: str | None) -> tuple[str, ...]:
    kind = (kind or "all").lower()
    if kind not in ATTENTION_KINDS:
        raise SelectionError(f"unknown attention kind {kind!r}: use self, cross or all")
    return ("self", "cross") if kind == "all" else (kind,)
