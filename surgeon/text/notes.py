"""How many notes one stage may add to a report, and the line that counts the rest."""

from __future__ import annotations

from collections.abc import Sequence

NOTE_CAP = 5  # one stage's notes shown in a report; past it, one line says how many more there were


def capped(lines: Sequence[str], what: str = "notes") -> list[str]:
    """At most :data:`NOTE_CAP` of ``lines``, then one line counting the rest: a report never drops a note unsaid."""
    if len(lines) <= NOTE_CAP:
        return list(lines)
    return [*lines[:NOTE_CAP], f"and {len(lines) - NOTE_CAP} more {what}"]
