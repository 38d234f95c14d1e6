"""Index specs (``--layers``, ``--heads``), targets and attention kinds.

An index spec is ``all`` or a comma-separated list of items, each one of
``N`` (one index), ``A-B`` (inclusive range), ``A-`` (from A to the last).
Negative numbers count from the end: ``-1`` is the last, ``-4-`` the last four,
``-4--2`` the fourth-last to the second-last.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..errors import SelectionError, opt
from .blocks import ROLES, Role

IndexSpec = str | int | Iterable[int] | None

_ITEM = re.compile(r"^(-?\d+)(?:(-)(-?\d+)?)?$")


def resolve_indices(spec: IndexSpec, count: int, *, what: str, where: str) -> list[int]:
    """Resolve ``spec`` against ``count`` items (numbered 0..count-1) to a sorted list.

    ``what`` names the items ("layer", "head"), ``where`` their owner for error messages.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        return list(range(count))
    if isinstance(spec, bool):
        raise SelectionError(f"{what}s must be a spec like '0-3,7' or a list of integers, not {spec!r}")
    if isinstance(spec, int):
        spec = [spec]
    if isinstance(spec, str):
        picked: set[int] = set()
        for raw in spec.split(","):
            item = raw.strip()
            match = _ITEM.match(item)
            if not match:
                raise SelectionError(
                    f"cannot read {what} spec item {item!r} in {spec!r}: "
                    f"use N, A-B, A- or all, e.g. '0-3,7' (negative counts from the end)"
                )
            start = _absolute(int(match.group(1)), count, what=what, where=where)
            if match.group(2) is None:
                picked.add(start)
                continue
            end = count - 1 if match.group(3) is None else _absolute(int(match.group(3)), count, what=what, where=where)
            if end < start:
                raise SelectionError(f"{what} range {item!r} is empty: its end comes before its start")
            picked.update(range(start, end + 1))
        return sorted(picked)
    try:
        values = [int(i) for i in spec]
    except (TypeError, ValueError):
        raise SelectionError(f"{what}s must be a spec like '0-3,7' or a list of integers, not {spec!r}") from None
    return sorted({_absolute(i, count, what=what, where=where) for i in values})


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
